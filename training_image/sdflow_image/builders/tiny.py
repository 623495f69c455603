"""`build_tiny(family, out_dir)`: the tiny pipeline of any family, from the builder that knows it
(tiny_model's SD, tiny_families' SDXL and SD 3, tiny_families_next's second-stack families)."""

from __future__ import annotations

import os
from pathlib import Path

from sdflow_image.builders import tiny_families, tiny_model

NEXT_FAMILIES = ("sd35", "flux2", "qwenimage")  # diffusers 0.42.1's classes: the second stack only


def build_tiny(family: str, out_dir: str | Path, seed: int = 0, vae_steps: int = 0, with_t5: bool = True) -> Path:
    """The tiny pipeline of `family` (sd | sdxl | sd3; sd35 | flux2 | qwenimage on the second stack)
    saved to `out_dir`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if family == "sd":
        return tiny_model.build_tiny_pipeline(out_dir, seed=seed, vae_steps=vae_steps)
    if family in NEXT_FAMILIES:
        if not tiny_families.transformers_5():
            raise ValueError(f"family={family} needs the second stack (diffusers 0.42.1): run it with .venv-accelerate")
        from sdflow_image.builders.tiny_families_next import build_tiny_next

        return build_tiny_next(family, out_dir, seed=seed, with_t5=with_t5)
    if family not in ("sdxl", "sd3"):
        raise ValueError(f"family={family!r} is not one of sd, sdxl, sd3, {', '.join(NEXT_FAMILIES)}")
    return tiny_families.build_tiny_first(family, out_dir, seed=seed, vae_steps=vae_steps, with_t5=with_t5)
