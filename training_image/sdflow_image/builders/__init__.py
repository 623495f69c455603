"""Tiny and full-size random models built in code, for tests, the demo and the GPU acceptance;
no job imports them (the image leaves them out: training_image/.dockerignore)."""
