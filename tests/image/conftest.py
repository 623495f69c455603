"""Fixtures of the image tests that several modules share (helpers stay in *_fixtures.py)."""

from __future__ import annotations

from download_fixtures import download_s3, image_server, opt_ml
from evaluation_fixtures import evaluation_models, tiny_clip_dir
from family_fixtures import family_base, family_dataset

__all__ = [
    "download_s3",
    "evaluation_models",
    "family_base",
    "family_dataset",
    "image_server",
    "opt_ml",
    "tiny_clip_dir",
]
