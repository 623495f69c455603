"""Stable Diffusion fine-tuning, split the way diffusers' and Colossal-AI's examples read.

- `model`: the pipeline's parts, the optimizer and the Booster each plugin needs, boosting.
- `loop`: the process group, the training steps, SIGTERM, resuming.
- `checkpoints`: complete-only checkpoints (staged, then renamed), pruned locally and in S3.
- `outputs`: the fine-tuned pipeline, its metadata, the loss curve and the samples.

`sdflow_image.train` is the entrypoint (flags, early checks, exit status). Nothing here is
imported before the early checks, so a bad flag fails before torch loads.
"""
