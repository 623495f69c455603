"""Aspect-ratio buckets: SDXL's list and its equivalents, the bucket an image trains in, batches of
one bucket, and a resume that repeats the uninterrupted run's batches with samples still waiting."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from data_fixtures import KeyTokenizer, keys_of, write_aspect_shards
from PIL import Image

from sdflow_image.training.buckets import (
    SDXL_BUCKETS,
    BucketError,
    buckets_for,
    nearest_bucket,
    resize_cover_crop,
)
from sdflow_image.training.data import DataStateError, ShardLoader, make_dataloader, resize_crop

pytestmark = pytest.mark.image

RESOLUTION = 64  # buckets_for(64, 8): 32x128 ... 64x64 ... 128x32
# (width, height) of the stored images, cycling: 2:1, 1:2, square, 5:1 (wider than the widest bucket, 4:1).
SIZES = [(64, 32), (32, 64), (48, 48), (100, 20)]
BUCKET_OF = {(64, 32): (48, 96), (32, 64): (96, 48), (48, 48): (64, 64), (100, 20): (32, 128)}


def _args(root: Path, index: str, **overrides: Any) -> SimpleNamespace:
    values = {
        "dataset_dir": str(root), "dataset_index": index, "resolution": RESOLUTION, "train_batch_size": 3,
        "dataloader_num_workers": 0, "interleave_shards": 2, "seed": 0, "center_crop": True, "random_flip": False,
        "aspect_buckets": True,
    }  # fmt: skip
    return SimpleNamespace(**(values | overrides))


@pytest.fixture
def aspect_dataset(tmp_path: Path) -> tuple[Path, str]:
    root = tmp_path / "runs"
    shards = [[SIZES[(s * 7 + i) % len(SIZES)] for i in range(7)] for s in range(3)]
    return root, write_aspect_shards(root, shards)


def _size_of(key: str) -> tuple[int, int]:
    shard, sample = int(key[1:6]), int(key[6:])
    return SIZES[(shard * 7 + sample) % len(SIZES)]


def _take(loader: ShardLoader, batches: int) -> list[tuple[list[str], list[float]]]:
    iterator = iter(loader)
    try:
        taken = [next(iterator) for _ in range(batches)]
    finally:
        iterator.close()  # type: ignore[attr-defined]
    return [(keys_of(b), b["pixel_values"].flatten().tolist()) for b in taken]


# ------------------------------------------------------------------ the lists


def test_sdxl_buckets_are_the_papers_forty_around_one_megapixel() -> None:
    assert len(SDXL_BUCKETS) == 40 == len(set(SDXL_BUCKETS))
    assert (SDXL_BUCKETS[0], SDXL_BUCKETS[20], SDXL_BUCKETS[-1]) == ((512, 2048), (1024, 1024), (2048, 512))
    assert all(h % 64 == 0 and w % 64 == 0 and min(h, w) >= 512 and max(h, w) <= 2048 for h, w in SDXL_BUCKETS)
    assert all(0.9 <= h * w / 1024**2 <= 1.0 for h, w in SDXL_BUCKETS)  # at most the square's pixels
    # Portrait (height < width in the table's order) to landscape: aspect h/w rises along the list.
    ratios = [h / w for h, w in SDXL_BUCKETS]
    assert ratios == sorted(ratios)
    assert (ratios[0], ratios[-1]) == (0.25, 4.0)


@pytest.mark.parametrize("multiple", [8, 16])
def test_buckets_for_sdxl_resolution_is_sdxl_list_for_every_family(multiple: int) -> None:
    assert buckets_for(1024, multiple) == SDXL_BUCKETS


def test_buckets_for_smaller_resolution_scales_and_rounds_half_up_to_multiple() -> None:
    buckets = buckets_for(128, 16)  # SDXL's sides / 8, to multiples of 16
    # 512x2048 → 64x256; 512x1984 → 64x248 → rounds up to 64x256 and is kept once; 576x1792 → 72 → 80 x 224;
    # 960x1024 → 120 → 128 x 128, the square, first met at 960x1024's place.
    assert buckets[:3] == ((64, 256), (64, 240), (80, 224))
    assert (64, 248) not in buckets
    assert buckets.count((128, 128)) == 1
    assert all(h % 16 == 0 and w % 16 == 0 and max(h, w) / min(h, w) <= 4 for h, w in buckets)
    assert len(buckets) == len(set(buckets)) == 23


def test_buckets_for_resolution_off_the_multiple_is_refused_naming_it() -> None:
    with pytest.raises(BucketError, match=r"resolution=72 must be a positive multiple of .* 16"):
        buckets_for(72, 16)


# ------------------------------------------------------------------ choosing and cropping


@pytest.mark.parametrize(
    ("width", "height", "bucket"),
    [
        (1024, 1024, (1024, 1024)),
        (2048, 512, (512, 2048)),  # 4:1 wide: the widest bucket
        (5000, 500, (512, 2048)),  # wider than any bucket: still the widest
        (1000, 700, (832, 1216)),  # 1.43: log-nearest is 1216/832 = 1.46, not 1152/832 = 1.38
        (700, 1000, (1216, 832)),
    ],
)
def test_nearest_bucket_is_nearest_in_log_aspect(width: int, height: int, bucket: tuple[int, int]) -> None:
    assert nearest_bucket(SDXL_BUCKETS, width, height) == bucket


def test_resize_cover_crop_covers_bucket_and_reports_crop_corner() -> None:
    image = Image.new("RGB", (400, 200))
    cropped, corner = resize_cover_crop(image, (64, 96))  # scale max(96/400, 64/200) = 0.32 → 128x64
    assert cropped.size == (96, 64)
    assert corner == (0, 16)  # (top, left): centered in 128 wide
    for seed in range(20):
        _, (top, left) = resize_cover_crop(image, (64, 96), center_crop=False, rng=random.Random(seed))
        assert top == 0
        assert 0 <= left <= 32


def test_resize_crop_square_is_cover_crop_of_square_bucket() -> None:
    image = Image.effect_noise((90, 60), 40).convert("RGB")
    square, corner = resize_crop(image, 32, center_crop=False, rng=random.Random(3))
    covered, corner2 = resize_cover_crop(image, (32, 32), center_crop=False, rng=random.Random(3))
    assert corner == corner2
    assert square.tobytes() == covered.tobytes()


# ------------------------------------------------------------------ batches of one bucket


def test_bucketed_loader_batches_hold_one_bucket_each(aspect_dataset: tuple[Path, str]) -> None:
    root, index = aspect_dataset
    loader = make_dataloader(_args(root, index), KeyTokenizer(), rank=0, world_size=1)
    iterator = iter(loader)
    shapes = set()
    for _ in range(12):
        batch = next(iterator)
        shape = tuple(batch["pixel_values"].shape[-2:])
        shapes.add(shape)
        assert {BUCKET_OF[_size_of(k)] for k in keys_of(batch)} == {shape}
    iterator.close()  # type: ignore[attr-defined]
    assert shapes == set(BUCKET_OF.values())


def test_bucketed_loader_sdxl_conditioning_is_original_size_and_crop_corner(aspect_dataset: tuple[Path, str]) -> None:
    root, index = aspect_dataset
    iterator = iter(make_dataloader(_args(root, index), KeyTokenizer(), rank=0, world_size=1))
    wide = next(b for b in iterator if tuple(b["pixel_values"].shape[-2:]) == (32, 128))
    iterator.close()  # type: ignore[attr-defined]
    # 100x20 stored (web original 300x60) covering 32 tall x 128 wide: scale 1.6 → 160x32, centered: left 16.
    assert wide["original_size"].tolist() == [[60, 300]] * 3
    assert wide["crop_top_left"].tolist() == [[0, 16]] * 3
    iterator = iter(make_dataloader(_args(root, index), KeyTokenizer(), rank=0, world_size=1))
    tall = next(b for b in iterator if tuple(b["pixel_values"].shape[-2:]) == (96, 48))
    iterator.close()  # type: ignore[attr-defined]
    # 32x64 stored covering 48 wide x 96 tall: scale 1.5, an exact fit, so no crop; original 96 wide, 192 tall.
    assert tall["original_size"].tolist() == [[192, 96]] * 3
    assert tall["crop_top_left"].tolist() == [[0, 0]] * 3


def test_sdxl_time_ids_carry_bucket_target_size(family_base: Any, aspect_dataset: tuple[Path, str]) -> None:
    """SDXL's add_time_ids: original (h, w), crop (top, left), then the batch's bucket, not the square."""
    from sdflow_image.families import get

    family = get("sdxl")
    parts = family.load_parts(str(family_base("sdxl")))
    root, index = aspect_dataset
    args = _args(root, index, center_crop=False)
    iterator = iter(make_dataloader(args, KeyTokenizer(), rank=0, world_size=1))
    batch = next(b for b in iterator if tuple(b["pixel_values"].shape[-2:]) == (32, 128))
    iterator.close()  # type: ignore[attr-defined]
    ids = [torch.zeros((3, t.model_max_length), dtype=torch.long) for t in (parts.tokenizer, parts.tokenizer_2)]
    batch = {**batch, "input_ids": ids[0], "input_ids_2": ids[1]}
    encoded = family.encode_batch(batch, parts, torch.device("cpu"), torch.Generator().manual_seed(0), 0.0)
    rows = encoded.extra["time_ids"].tolist()
    for row, size, corner in zip(rows, batch["original_size"].tolist(), batch["crop_top_left"].tolist(), strict=True):
        assert row == [*size, *corner, 32, 128]
    assert {tuple(c) for c in batch["crop_top_left"].tolist()} != {(0, 0)}  # random crops along the width
    factor = 2 ** (len(parts.vae.config.block_out_channels) - 1)  # the tiny VAE's downsampling
    assert encoded.latents.shape[-2:] == (32 // factor, 128 // factor)  # non-square latents


# ------------------------------------------------------------------ resume


@pytest.mark.parametrize(("workers", "center_crop"), [(0, False), (2, False), (0, True)])
def test_bucketed_loader_resume_with_pending_samples_repeats_uninterrupted_batches(
    aspect_dataset: tuple[Path, str], workers: int, center_crop: bool
) -> None:
    root, index = aspect_dataset
    args = _args(root, index, dataloader_num_workers=workers, center_crop=center_crop, random_flip=True)
    total = 20  # 60 samples: almost three epochs of 21, buckets carried over each epoch's end
    straight = _take(make_dataloader(args, KeyTokenizer(), rank=0, world_size=1), total)
    pending_seen = 0
    for stop in (1, 4, 7, 13):
        loader = make_dataloader(args, KeyTokenizer(), rank=0, world_size=1)
        before = _take(loader, stop)
        state = json.loads(json.dumps(loader.state_dict()))  # what a checkpoint holds
        pending_seen += sum(len(c["pending"]) for c in state["cursors"].values())
        resumed = make_dataloader(args, KeyTokenizer(), rank=0, world_size=1, state=state)
        assert before + _take(resumed, total - stop) == straight, f"resumed after batch {stop}"
    assert pending_seen > 0, "no stop had samples waiting in other buckets: the test proves nothing"


def test_bucketed_state_refused_without_buckets(aspect_dataset: tuple[Path, str]) -> None:
    root, index = aspect_dataset
    loader = make_dataloader(_args(root, index), KeyTokenizer(), rank=0, world_size=1)
    _take(loader, 2)
    with pytest.raises(DataStateError, match="buckets="):
        make_dataloader(_args(root, index, aspect_buckets=False), KeyTokenizer(), rank=0, world_size=1,
                        state=loader.state_dict())  # fmt: skip


def test_nearest_bucket_tie_in_log_aspect_goes_to_first_listed() -> None:
    # 2:1 is as far from 1:1 as from 4:1 on the log scale: the list's order decides, the same on every run.
    assert nearest_bucket(((64, 64), (32, 128)), 128, 64) == (64, 64)
    assert nearest_bucket(((32, 128), (64, 64)), 128, 64) == (32, 128)


def test_training_job_buckets_past_sd3_position_grid_refused_naming_resolution(family_base: Any) -> None:
    """The tiny SD 3 embeds positions for 32 patches of 1 latent pixel (4 image pixels) a side: 128 px. At
    resolution 128 the 4:1 buckets are 256 px long: refused before anything loads; at 64 they fit."""
    from sdflow_image.training import train

    base = str(family_base("sd3"))
    args = train.parse_args(["--resolution", "128", "--aspect_buckets", "true"], hyperparameters={})
    args.model_family, args.pretrained_model_name_or_path = "sd3", base
    with pytest.raises(train.HyperparameterError, match=r"longest bucket is 256 px.*resolution to at most 64"):
        train.check_family(args)
    args.resolution = 64
    train.check_family(args)
    args.resolution, args.aspect_buckets = 128, False
    train.check_family(args)  # square 128 px crops fit the grid
