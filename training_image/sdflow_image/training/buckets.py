"""Aspect-ratio buckets (`aspect_buckets`): the (height, width) sizes a training batch may have, the
bucket each image trains in, and the resize-and-crop that brings an image to its bucket.

Where the lists come from:

- `SDXL_BUCKETS` is SDXL's published list for its 1024² training (Podell et al., "SDXL: Improving
  Latent Diffusion Models for High-Resolution Image Synthesis", arXiv:2307.01952, Appendix I
  "Multi-Aspect Training", the table of the 40 (height, width) buckets it fine-tuned on): sides from
  512 to 2048 in steps of 64, each about 1024² pixels, aspect ratio (height / width) from 0.25 to 4.
  Written out below as the paper's table lists them.
- Every other list (`buckets_for`) is SDXL's scaled to the training resolution's area: each side
  times `resolution / 1024`, rounded half-up to the family's `resolution_multiple` (8 for the UNet
  families, 16 where a transformer patches 2x2 latents: `sdflow_image.families`), sizes that
  rounding made equal kept once (first in SDXL's order), any whose sides then differ more than 4x
  left out. At 1024 that is SDXL's list itself for every family (all its sides are multiples of 64).

An image trains in the bucket whose aspect ratio is nearest its own on a log scale (|log(w/h) -
log(w_b/h_b)|: 2:1 and 1:2 are equally far from 1:1), the first in the list on a tie. It is resized to
cover the bucket (the smaller scale that makes both sides at least the bucket's) and cropped to it,
centered or at a seeded random corner, as the square crop has always been (`data.resize_crop`).

This module imports neither torch nor numpy: train.py's early checks may use it."""

from __future__ import annotations

import hashlib
import json
import math
import random
from pathlib import Path

from PIL import Image

SDXL_RESOLUTION = 1024
MAX_ASPECT = 4.0
# (height, width), SDXL paper (arXiv:2307.01952) Appendix I, in the table's order (portrait first).
SDXL_BUCKETS: tuple[tuple[int, int], ...] = (
    (512, 2048), (512, 1984), (512, 1920), (512, 1856),
    (576, 1792), (576, 1728), (576, 1664),
    (640, 1600), (640, 1536),
    (704, 1472), (704, 1408), (704, 1344),
    (768, 1344), (768, 1280),
    (832, 1216), (832, 1152),
    (896, 1152), (896, 1088),
    (960, 1088), (960, 1024),
    (1024, 1024),
    (1024, 960),
    (1088, 960), (1088, 896),
    (1152, 896), (1152, 832),
    (1216, 832),
    (1280, 768), (1344, 768),
    (1408, 704), (1472, 704),
    (1536, 640), (1600, 640),
    (1664, 576), (1728, 576), (1792, 576),
    (1856, 512), (1920, 512), (1984, 512), (2048, 512),
)  # fmt: skip

Bucket = tuple[int, int]  # (height, width) in pixels


class BucketError(ValueError):
    """A resolution or multiple no bucket list can be made for; the message names the setting."""


def _round_to(value: float, multiple: int) -> int:
    # Half-up, not Python's round-half-to-even: the list must not depend on which neighbour is even.
    return max(multiple, math.floor(value / multiple + 0.5) * multiple)


def buckets_for(resolution: int, multiple: int) -> tuple[Bucket, ...]:
    """The buckets of a run training at `resolution` (its area) for a family whose sides are
    multiples of `multiple`: SDXL's list scaled and rounded (module docstring)."""
    if resolution <= 0 or multiple <= 0 or resolution % multiple:
        raise BucketError(
            f"resolution={resolution} must be a positive multiple of the family's resolution multiple {multiple}"
        )
    scale = resolution / SDXL_RESOLUTION
    out: list[Bucket] = []
    for height, width in SDXL_BUCKETS:
        bucket = (_round_to(height * scale, multiple), _round_to(width * scale, multiple))
        if bucket not in out and max(bucket) / min(bucket) <= MAX_ASPECT:
            out.append(bucket)
    return tuple(out)


def nearest_bucket(buckets: tuple[Bucket, ...], width: int, height: int) -> Bucket:
    """The bucket whose aspect ratio is nearest `width` x `height` (log scale; the first on a tie)."""
    if width <= 0 or height <= 0:
        raise BucketError(f"an image of {width}x{height} pixels has no aspect ratio")
    ratio = math.log(width / height)
    return min(buckets, key=lambda b: abs(math.log(b[1] / b[0]) - ratio))


def buckets_fingerprint(buckets: tuple[Bucket, ...]) -> str:
    """A short name for a bucket list: a saved data position is only valid with the same list."""
    text = ",".join(f"{h}x{w}" for h, w in buckets)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def resize_cover_crop(
    image: Image.Image, size: Bucket, center_crop: bool = True, rng: random.Random | None = None
) -> tuple[Image.Image, tuple[int, int]]:
    """RGB `image` resized to cover `size` (height, width) and cropped to it, centered or at a
    random corner drawn from `rng`; with the crop's (top, left) in the resized image (SDXL's
    `crop_top_left`, as train_text_to_image_sdxl.py measures it). A square `size` gives the shorter
    side that size and a square crop: today's default (`data.resize_crop`)."""
    target_h, target_w = size
    image = image.convert("RGB")
    width, height = image.size
    scale = max(target_w / width, target_h / height)
    new_size = (max(target_w, round(width * scale)), max(target_h, round(height * scale)))
    if new_size != image.size:
        image = image.resize(new_size, Image.Resampling.BILINEAR)
    width, height = image.size
    if center_crop:
        left, top = (width - target_w) // 2, (height - target_h) // 2
    else:
        rng = rng or random.Random()
        left, top = rng.randint(0, width - target_w), rng.randint(0, height - target_h)
    return image.crop((left, top, left + target_w, top + target_h)), (top, left)


def position_grid_refusal(base_dir: str | Path, resolution: int, buckets: tuple[Bucket, ...]) -> str | None:
    """Why `buckets` cannot train a base model whose transformer embeds positions on a square grid
    (SD 3's `pos_embed_max_size` patches a side: diffusers' PatchEmbed.cropped_pos_embed refuses a
    longer latent), or None: the longest bucket fits, or the model has no such grid."""
    base = Path(base_dir)
    try:
        transformer = json.loads((base / "transformer" / "config.json").read_text(encoding="utf-8"))
        vae = json.loads((base / "vae" / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # a UNet model, or one check_base_model has already named as incomplete
    grid = transformer.get("pos_embed_max_size") if isinstance(transformer, dict) else None
    if not isinstance(grid, int) or not isinstance(vae, dict):
        return None
    pixels = grid * int(transformer.get("patch_size", 2)) * 2 ** (len(vae.get("block_out_channels", [0] * 4)) - 1)
    longest = max(max(bucket) for bucket in buckets)
    if longest <= pixels:
        return None
    return (
        f"aspect_buckets=true at resolution={resolution}: the longest bucket is {longest} px, and this model's "
        f"transformer embeds positions for at most {pixels} px a side (pos_embed_max_size={grid}); set resolution "
        f"to at most {pixels // 2} (a bucket's long side is up to twice it) or aspect_buckets=false"
    )
