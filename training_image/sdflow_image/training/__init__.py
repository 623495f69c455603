"""Stable Diffusion fine-tuning, split the way diffusers' and Colossal-AI's examples read.

- `model`: the pipeline's parts, the EMA, SD's encode and loss (what differs by model family is
  in sdflow_image.families; what differs by backend, the wrapper, optimizer and checkpoint
  files, in sdflow_image.backends).
- `lora`: LoRA adapters on the denoiser: added, checkpointed, written in diffusers' format.
- `loop`: the training steps, SIGTERM, resuming, over a backend (the process group is its).
- `checkpoints`: complete-only checkpoints (staged, then renamed; one marker per host, complete
  once every host's part is there, as S3 merges them), pruned locally and in S3.
- `stop_save`: whether a stop saves a checkpoint: only when it can be written and uploaded in time.
- `outputs`: the fine-tuned pipeline, its metadata, the loss curve and the samples.

`sdflow_image.training.train` is the entrypoint (flags, early checks, exit status). Nothing here is
imported before the early checks, so a bad flag fails before torch loads.
"""
