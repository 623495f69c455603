"""One training step of a family through its interface (sdflow_image.families), on a tiny model's parts: shared by
the resolution-multiple tests of both job stacks (tests/image, tests/image_accelerate)."""

from __future__ import annotations

from typing import Any


def one_step_loss(family: str, parts: Any, size: int, **extra: Any) -> Any:
    """One training step's loss on a batch of two `size`-pixel images; `extra` adds batch fields a family reads
    (SDXL's original_size and crop_top_left), each a list of two rows."""
    import torch

    from sdflow_image import families

    fam = families.get(family)
    tokenize = fam.caption_ids(parts)
    rows = [tokenize(caption) for caption in ("a red square", "a green circle")]
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    batch["pixel_values"] = torch.linspace(-1, 1, 2 * 3 * size * size).reshape(2, 3, size, size)
    batch |= {key: torch.tensor(value) for key, value in extra.items()}
    generator = torch.Generator().manual_seed(0)
    encoded = fam.encode_batch(batch, parts, torch.device("cpu"), generator, 0.0)
    return fam.compute_loss(parts.denoiser, parts, encoded, generator)
