"""Streaming image-caption data for training: the webdataset shards the dataset index lists.

The dataset channel holds `index.json` (docs/contracts.md) and the tar shards img2dataset
wrote; tar paths in the index are relative to the channel root. The channel is a SageMaker
manifest over the data bucket's `runs/` folder (a resumed run reuses shards from earlier runs'
folders), so index.json sits at `<run>/dataset/index.json` below the root: the training job
names it in the `dataset_index` hyperparameter. `index.json` at the root (the default) is the
layout of a plain S3Prefix channel over one run's dataset/ folder. Samples stream from the
tars (nothing is unpacked), go through a shuffle buffer, are resized and center-cropped to
the training resolution, normalised to [-1, 1], and their captions tokenized.

Work is split so that no two consumers (rank x DataLoader worker) read the same sample:
by whole shards when there are enough of them, otherwise by sample index within the
stream, so a dataset of one shard still trains on many ranks. The stream repeats forever
(the trainer stops at max_train_steps), reshuffling shard order every pass.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
CAPTION_KEYS = ("txt", "caption", "text")
DEFAULT_INDEX = "index.json"  # at the channel root: the layout of an S3Prefix channel over dataset/


class DatasetIndexError(ValueError):
    """The dataset channel or its index.json is missing, malformed or empty."""


class EmptyStreamError(RuntimeError):
    """A rank's share of the data yielded no batch (fewer usable samples than ranks x workers)."""


@dataclass(frozen=True)
class DatasetIndex:
    shards: list[Path]  # absolute tar paths
    total_samples: int
    image_size: int | None


def _inside(root: Path, relative: str, what: str) -> Path:
    """`root / relative`, refusing a path that is absolute or climbs out of the channel."""
    candidate = Path(relative)
    if not relative or candidate.is_absolute() or ".." in candidate.parts:
        raise DatasetIndexError(f"{what} {relative!r} must be a path relative to the dataset channel, without '..'")
    return root / candidate


def load_index(dataset_dir: str | Path, index_path: str = DEFAULT_INDEX) -> DatasetIndex:
    """Read and check the index at `index_path` below the channel; every listed tar must exist there."""
    root = Path(dataset_dir)
    if not root.is_dir():
        raise DatasetIndexError(f"dataset channel {root} does not exist: the training job needs a 'dataset' channel")
    index_file = _inside(root, index_path, "dataset_index")
    if not index_file.is_file():
        raise DatasetIndexError(
            f"{index_file} is missing: the 'dataset' channel must be the run's dataset/manifest.json (written by "
            f"build_index) and the hyperparameter dataset_index (now {index_path!r}) index.json's path below the "
            "channel root, e.g. '<run>/dataset/index.json'"
        )
    try:
        index = json.loads(index_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DatasetIndexError(f"{index_file} is not valid JSON: {exc}") from exc
    if not isinstance(index, dict) or not isinstance(index.get("shards"), list):
        raise DatasetIndexError(f"{index_file} has no 'shards' list")
    tars: list[Path] = []
    for shard in index["shards"]:
        files = shard.get("tar_files") if isinstance(shard, dict) else None
        if not isinstance(files, list):
            raise DatasetIndexError(f"{index_file}: shard entry {shard!r} has no 'tar_files' list")
        tars.extend(_inside(root, str(rel), f"{index_file}: tar file") for rel in files)
    if not tars:
        raise DatasetIndexError(f"{index_file} lists no tar files: every shard failed to download, nothing to train on")
    missing = [str(t) for t in tars if not t.is_file()]
    if missing:
        raise DatasetIndexError(
            f"{len(missing)} tar file(s) listed in {index_file} are missing, e.g. {missing[0]}: the channel's "
            "manifest must list every tar file the index names (build_index writes both)"
        )
    total = index.get("total_samples")
    if isinstance(total, int) and total <= 0:
        raise DatasetIndexError(f"{index_file} says total_samples={total}: nothing to train on")
    size = index.get("image_size")
    return DatasetIndex(
        shards=tars,
        total_samples=int(total) if isinstance(total, int) else -1,
        image_size=int(size) if isinstance(size, int) else None,
    )


def resize_center_crop(
    image: Image.Image, resolution: int, center_crop: bool = True, rng: random.Random | None = None
) -> Image.Image:
    """Shorter side to `resolution`, then a centered (or random) square crop."""
    image = image.convert("RGB")
    width, height = image.size
    scale = resolution / min(width, height)
    new_size = (max(resolution, round(width * scale)), max(resolution, round(height * scale)))
    if new_size != image.size:
        image = image.resize(new_size, Image.Resampling.BILINEAR)
    width, height = image.size
    if center_crop:
        left, top = (width - resolution) // 2, (height - resolution) // 2
    else:
        rng = rng or random.Random()
        left, top = rng.randint(0, width - resolution), rng.randint(0, height - resolution)
    return image.crop((left, top, left + resolution, top + resolution))


def image_to_tensor(image: Image.Image) -> torch.Tensor:
    """HWC uint8 → CHW float in [-1, 1], the range the VAE was trained on."""
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def _first_key(sample: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if key in sample:
            return sample[key]
    return None


def split_work(
    shards: list[Path], rank: int, world_size: int, worker: int, num_workers: int
) -> tuple[list[Path], int, int]:
    """This consumer's shards and its sample-level stride: keep stream item i when i % modulo == slot.

    Shards are divided between ranks (then workers) when there are at least as many as
    consumers at that level; otherwise that level divides samples instead."""
    modulo, slot = 1, 0
    if len(shards) >= world_size:
        mine = shards[rank::world_size]
    else:
        mine = list(shards)
        modulo, slot = world_size, rank
    if len(mine) >= num_workers:
        mine = mine[worker::num_workers]
    else:
        slot = slot * num_workers + worker
        modulo *= num_workers
    return mine, modulo, slot


class ImageCaptionStream(IterableDataset):
    """Endless stream of {"pixel_values": CHW tensor, "input_ids": LongTensor} for one rank."""

    def __init__(
        self,
        shards: list[Path],
        tokenize: Callable[[str], torch.Tensor],
        resolution: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle_buffer: int = 1000,
        seed: int = 0,
        center_crop: bool = True,
        random_flip: bool = False,
        repeat: bool = True,
    ) -> None:
        super().__init__()
        self.shards = [str(s) for s in shards]
        self.tokenize = tokenize
        self.resolution = resolution
        self.rank = rank
        self.world_size = world_size
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.center_crop = center_crop
        self.random_flip = random_flip
        self.repeat = repeat

    def _transform(self, sample: dict[str, Any], rng: random.Random) -> dict[str, torch.Tensor] | None:
        image = _first_key(sample, IMAGE_KEYS)
        caption = _first_key(sample, CAPTION_KEYS)
        if image is None or caption is None:
            return None  # img2dataset leaves no such samples, but a hand-made tar might
        image = resize_center_crop(image, self.resolution, self.center_crop, rng)
        if self.random_flip and rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if isinstance(caption, bytes):
            caption = caption.decode("utf-8", errors="replace")
        return {"pixel_values": image_to_tensor(image), "input_ids": self.tokenize(str(caption))}

    def _one_pass(self, shards: list[str], modulo: int, slot: int, rng: random.Random) -> Iterator[dict[str, Any]]:
        import webdataset as wds

        rng.shuffle(shards)
        stages: list[Any] = [
            wds.SimpleShardList(shards),
            wds.tarfile_to_samples(handler=wds.warn_and_continue),
        ]
        if modulo > 1:
            # Before decoding, so skipped samples cost only the tar read.
            stages.append(_EveryNth(modulo, slot))
        if self.shuffle_buffer > 1:
            stages.append(wds.shuffle(self.shuffle_buffer, initial=min(self.shuffle_buffer, 100), rng=rng))
        stages += [wds.decode("pil", handler=wds.warn_and_continue)]
        yield from wds.DataPipeline(*stages)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        shards, modulo, slot = split_work(
            [Path(s) for s in self.shards], self.rank, self.world_size, worker, num_workers
        )
        if not shards:
            return
        consumer = self.rank * num_workers + worker
        epoch = 0
        while True:
            rng = random.Random(f"{self.seed}:{consumer}:{epoch}")
            produced = 0
            for sample in self._one_pass([str(s) for s in shards], modulo, slot, rng):
                item = self._transform(sample, rng)
                if item is not None:
                    produced += 1
                    yield item
            if produced == 0:
                # A worker with no share ends its stream; the trainer fails only when a
                # whole rank gets nothing (see EmptyStreamError), since other workers may still feed it.
                return
            epoch += 1
            if not self.repeat:
                return


class _EveryNth:
    """Keep stream items whose position i satisfies i % modulo == slot (picklable for workers)."""

    def __init__(self, modulo: int, slot: int) -> None:
        self.modulo, self.slot = modulo, slot

    def __call__(self, src: Iterator[Any]) -> Iterator[Any]:
        for i, item in enumerate(src):
            if i % self.modulo == self.slot:
                yield item


class CaptionTokenizer:
    """Caption → fixed-length token ids (padded/truncated to the tokenizer's max length)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, caption: str) -> torch.Tensor:
        ids = self.tokenizer(
            caption,
            padding="max_length",
            truncation=True,
            max_length=self.tokenizer.model_max_length,
            return_tensors="pt",
        ).input_ids
        return ids[0]


def _collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {
        "pixel_values": torch.stack([i["pixel_values"] for i in items]),
        "input_ids": torch.stack([i["input_ids"] for i in items]),
    }


def make_dataloader(
    dataset_dir: str | Path,
    tokenizer: Any,
    *,
    resolution: int,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 0,
    shuffle_buffer: int = 1000,
    seed: int = 0,
    center_crop: bool = True,
    random_flip: bool = False,
    index_path: str = DEFAULT_INDEX,
) -> tuple[DataLoader, DatasetIndex]:
    """A DataLoader of this rank's batches over the shards the index at `dataset_dir/index_path` lists."""
    index = load_index(dataset_dir, index_path)
    stream = ImageCaptionStream(
        index.shards,
        CaptionTokenizer(tokenizer),
        resolution,
        rank=rank,
        world_size=world_size,
        shuffle_buffer=shuffle_buffer,
        seed=seed,
        center_crop=center_crop,
        random_flip=random_flip,
    )
    loader = DataLoader(
        stream,
        batch_size=batch_size,
        num_workers=num_workers,
        collate_fn=_collate,
        drop_last=True,
        persistent_workers=num_workers > 0,
        pin_memory=torch.cuda.is_available(),
        prefetch_factor=4 if num_workers > 0 else None,
    )
    return loader, index
