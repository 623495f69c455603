"""Streaming image-caption batches for training, with an exact resume position.

Shards stream from `dataset_dir` (s3://<bucket>/runs/ in a training job; see data_source). Work is
split so that no two readers see the same sample: the shards are divided between ranks, then between
a rank's DataLoader workers; where a level has fewer shards than readers, the readers of that level
all read the same shards and keep every n-th sample instead (so one shard still trains on many ranks).

Shuffling is exact across a resume. Each reader keeps `interleave_shards` shards open and takes its
next sample from one of them chosen by a hash of (seed, reader, epoch, draw number): no RNG state and
no shuffle buffer whose contents a checkpoint would have to hold. Each epoch the reader's shards are
opened in a new seeded order. Random crops and flips are seeded per sample the same way. A reader's
whole position is therefore a few integers (`Cursor`): the epoch, the next shard to open, and each
open shard's byte offset of its next sample (reopened with a ranged GET); with `aspect_buckets`, also
the samples waiting in the other buckets (training/bucketed.py). The shuffle is coarser than
a large buffer would give: samples of one shard stay in file order, interleaved with the other open
shards'. img2dataset writes a shard in its parquet file's row order, which for LAION is not sorted
by content; raise `interleave_shards` for more mixing (each open shard holds one S3 connection).

`ShardLoader.state_dict()` is the position after the last batch handed to the caller: each worker's
cursor as of its last handed-out batch (prefetched batches are not counted), and which worker's batch
comes next. `make_dataloader(..., state=...)` resumes there, batch for batch as if never stopped. A
state saved with another world size, worker count, seed, interleave width or index is refused with
DataStateError: the split of the shards would differ, so no position could avoid repeats and skips.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from sdflow_image.training.bucketed import PendingRef, PendingSamples, parse_pending
from sdflow_image.training.buckets import Bucket, buckets_fingerprint, buckets_for, nearest_bucket, resize_cover_crop
from sdflow_image.training.data_source import (
    FLAGS,
    KEYS_KEY,
    DatasetIndex,
    DatasetIndexError,
    ShardReader,
    Source,
    TarSample,
    load_dropped,
    load_index,
    source_for,
)

__all__ = [
    "FLAGS",
    "DataStateError",
    "DatasetIndexError",
    "EmptyStreamError",
    "ShardLoader",
    "load_index",
    "make_dataloader",
]

log = logging.getLogger("sdflow.data")

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
CAPTION_KEYS = ("txt", "caption", "text")
STATE_VERSION = 1
POSITION_KEY = "_position"


class EmptyStreamError(RuntimeError):
    """A rank's share of the data yields no batch (fewer usable samples than ranks x workers)."""


class DataStateError(ValueError):
    """A saved data position does not fit this run's data split; the message names the field."""


# ---------------------------------------------------------------------------------------------
# Splitting the shards
# ---------------------------------------------------------------------------------------------


def split_work(
    shards: list[str], rank: int, world_size: int, worker: int, num_workers: int
) -> tuple[list[str], int, int]:
    """This reader's shards and its sample stride: keep draw k when k % modulo == slot.

    Shards are divided between ranks (then workers) when there are at least as many as readers at
    that level; otherwise that level divides samples instead."""
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


def fingerprint(names: list[str]) -> str:
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


def _draw(*parts: object) -> int:
    """A uniform 64-bit number from its inputs alone: the same draw on resume, with no state to save."""
    text = ":".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big")


# ---------------------------------------------------------------------------------------------
# One reader's position and its interleaved walk over its shards
# ---------------------------------------------------------------------------------------------


@dataclass
class Cursor:
    epoch: int = 0
    next_shard: int = 0  # position in this epoch's shard order of the next shard to open
    open: list[list[int]] = field(default_factory=list)  # [order position, byte offset] per open shard
    draws: int = 0  # samples drawn this epoch (kept by this reader or not)
    pending: list[list[Any]] = field(default_factory=list)  # samples waiting in their bucket (bucketed.py)

    @classmethod
    def from_json(cls, raw: Any) -> Cursor:
        try:
            cursor = cls(
                epoch=int(raw["epoch"]),
                next_shard=int(raw["next_shard"]),
                open=[[int(p), int(o)] for p, o in raw["open"]],
                draws=int(raw["draws"]),
                pending=parse_pending(raw.get("pending", [])),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise DataStateError(
                f"data position {raw!r} is malformed ({exc}): it must come from state_dict()"
            ) from None
        return cursor


class InterleavedShards:
    """Endless draws over `shards`, `width` open at a time; identical for every reader given the same shards."""

    def __init__(self, source: Source, shards: list[str], *, seed: int, width: int, cursor: Cursor) -> None:
        self.source, self.shards, self.seed, self.width = source, shards, seed, width
        self.group = fingerprint(shards)
        self.cursor = cursor
        self.epoch_draws: int | None = None  # draws of the last epoch that ended, once one has
        self.last_shard = ""  # the shard the last drawn sample came from
        self.last_offset = 0  # and the byte offset it starts at
        self._order = self._epoch_order(cursor.epoch)
        if any(p >= len(shards) for p, _ in cursor.open) or cursor.next_shard > len(shards):
            raise DataStateError(f"data position {asdict(cursor)} points past this reader's {len(shards)} shards")
        self._readers = [ShardReader(source, shards[self._order[p]], offset) for p, offset in cursor.open]

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.shards)))
        random.Random(f"{self.seed}:{self.group}:{epoch}").shuffle(order)
        return order

    def _fill(self) -> None:
        cursor = self.cursor
        while len(cursor.open) < self.width and cursor.next_shard < len(self.shards):
            cursor.open.append([cursor.next_shard, 0])
            self._readers.append(ShardReader(self.source, self.shards[self._order[cursor.next_shard]]))
            cursor.next_shard += 1

    def _drop(self, slot: int) -> None:
        self._readers.pop(slot).close()
        self.cursor.open.pop(slot)

    def next(self) -> tuple[TarSample, int, int] | None:
        """(sample, epoch, draw number), or None when a whole epoch drew nothing (empty shards)."""
        cursor = self.cursor
        while True:
            self._fill()
            if not cursor.open:
                if cursor.draws == 0:
                    return None
                self.epoch_draws = cursor.draws
                cursor.epoch, cursor.next_shard, cursor.draws = cursor.epoch + 1, 0, 0
                self._order = self._epoch_order(cursor.epoch)
                continue
            slot = _draw(self.seed, self.group, cursor.epoch, cursor.draws) % len(cursor.open)
            offset = cursor.open[slot][1]
            sample = self._readers[slot].next_sample()
            if sample is None:
                self._drop(slot)
                continue
            self.last_shard, self.last_offset = self.shards[self._order[cursor.open[slot][0]]], offset
            drawn = cursor.draws
            cursor.draws += 1
            if sample.next_offset is None:
                self._drop(slot)
            else:
                cursor.open[slot][1] = sample.next_offset
            return sample, cursor.epoch, drawn

    def close(self) -> None:
        for reader in self._readers:
            reader.close()


# ---------------------------------------------------------------------------------------------
# Samples to tensors
# ---------------------------------------------------------------------------------------------


def resize_center_crop(
    image: Image.Image, resolution: int, center_crop: bool = True, rng: random.Random | None = None
) -> Image.Image:
    """Shorter side to `resolution`, then a centered (or random) square crop."""
    return resize_crop(image, resolution, center_crop, rng)[0]


def resize_crop(
    image: Image.Image, resolution: int, center_crop: bool = True, rng: random.Random | None = None
) -> tuple[Image.Image, tuple[int, int]]:
    """`resize_center_crop`, and the crop's (top, left) corner in the resized image (SDXL's
    `crop_top_left` conditioning, as train_text_to_image_sdxl.py measures it)."""
    return resize_cover_crop(image, (resolution, resolution), center_crop, rng)


def original_size(files: dict[str, bytes], image: Image.Image) -> tuple[int, int]:
    """(height, width) of the image as it was on the web: img2dataset's `original_height` and
    `original_width` in the sample's json (it resizes before it stores), else the stored image's."""
    raw = files.get("json")
    if raw is not None:
        try:
            meta = json.loads(raw)
            height, width = int(meta["original_height"]), int(meta["original_width"])
            if height > 0 and width > 0:
                return height, width
        except (ValueError, KeyError, TypeError):
            pass  # a sample without them (a hand-made shard, an older img2dataset): the image's own
    return image.height, image.width


def image_to_tensor(image: Image.Image) -> torch.Tensor:
    """HWC uint8 → CHW float in [-1, 1], the range the VAE was trained on."""
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def _first(files: dict[str, bytes], keys: tuple[str, ...]) -> bytes | None:
    return next((files[k] for k in keys if k in files), None)


class CaptionTokenizer:
    """Caption → fixed-length token ids (padded/truncated to the tokenizer's max length)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, caption: str) -> torch.Tensor:
        ids = self.tokenizer(
            caption, padding="max_length", truncation=True, max_length=self.tokenizer.model_max_length,
            return_tensors="pt",
        ).input_ids  # fmt: skip
        return ids[0]


# ---------------------------------------------------------------------------------------------
# The dataset (one rank; each DataLoader worker is one reader) and the loader around it
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamConfig:
    resolution: int
    batch_size: int
    rank: int
    world_size: int
    num_workers: int
    interleave_shards: int
    seed: int
    center_crop: bool = True
    random_flip: bool = False
    buckets: tuple[Bucket, ...] = ()  # aspect_buckets: the sizes a batch may have (buckets.py); () square


class ShardStream(IterableDataset):
    """Collated batches of one rank, each tagged with its reader's position after it (POSITION_KEY)."""

    def __init__(
        self,
        source: Source,
        shards: list[str],
        tokenize: Callable[[str], Any],
        config: StreamConfig,
        cursors: dict[int, Cursor],
        first_reader: int = 0,
        dropped_files: dict[str, str] | None = None,  # tar -> its dropped file: the dedup job's duplicates
    ) -> None:
        super().__init__()
        self.source, self.shards, self.tokenize, self.config = source, shards, tokenize, config
        self.cursors, self.dropped_files = cursors, dropped_files or {}
        self.first_reader = first_reader

    def _transform(self, sample: TarSample, rng: random.Random) -> dict[str, torch.Tensor] | None:
        image_bytes, caption = _first(sample.files, IMAGE_KEYS), _first(sample.files, CAPTION_KEYS)
        if image_bytes is None or caption is None:
            return None  # img2dataset writes no such samples, but a hand-made tar might
        try:
            image: Image.Image = Image.open(io.BytesIO(image_bytes))
            size = original_size(sample.files, image)
            resolution, buckets = self.config.resolution, self.config.buckets
            target = nearest_bucket(buckets, image.width, image.height) if buckets else (resolution, resolution)
            image, corner = resize_cover_crop(image, target, self.config.center_crop, rng)
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            # A web image that will not decode: skipped (and logged), as webdataset's warn_and_continue does.
            log.warning("sample %s: image does not decode (%s); skipped", sample.key, exc)
            return None
        if self.config.random_flip and rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        text = caption.decode("utf-8", errors="replace")
        ids = self.tokenize(text)
        return {
            "pixel_values": image_to_tensor(image),
            **(ids if isinstance(ids, dict) else {"input_ids": ids}),  # one tokenizer, or a family's several
            "original_size": torch.tensor(size),
            "crop_top_left": torch.tensor(corner),
        }

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        config = self.config
        reader = (worker + self.first_reader) % max(1, config.num_workers)
        mine, modulo, slot = split_work(self.shards, config.rank, config.world_size, reader, max(1, config.num_workers))
        if not mine:
            return
        # A copy: the walk advances its cursor ahead of what the caller has been handed.
        saved = self.cursors.get(reader)
        cursor = Cursor.from_json(asdict(saved)) if saved is not None else Cursor()
        walk = InterleavedShards(self.source, mine, seed=config.seed, width=config.interleave_shards, cursor=cursor)
        try:
            yield from self._batches(walk, reader, modulo, slot, load_dropped(self.source, self.dropped_files, mine))
        finally:
            walk.close()

    def _batches(
        self, walk: InterleavedShards, reader: int, modulo: int, slot: int, dropped: dict[str, frozenset[str]]
    ) -> Iterator[dict[str, Any]]:
        def make_item(sample: TarSample, epoch: int, number: int) -> dict[str, torch.Tensor] | None:
            return self._transform(sample, random.Random(f"{self.config.seed}:{walk.group}:{epoch}:{number}:{slot}"))

        # Samples wait per image size until one size fills a batch: one size unless aspect_buckets.
        pending = PendingSamples(self.config.batch_size)
        pending.restore(self.source, walk.cursor.pending, make_item)
        while True:
            drawn = walk.next()
            if drawn is None:
                return
            if walk.epoch_draws is not None and walk.epoch_draws <= slot:
                return  # a whole epoch has fewer samples than this reader's slot: its share is empty
            sample, epoch, number = drawn
            if number % modulo != slot or sample.key in dropped.get(walk.last_shard, ()):
                continue  # another reader's draw, or a duplicate: still a draw, so a resume lands alike
            item = make_item(sample, epoch, number)
            if item is None:
                continue
            ref = PendingRef(walk.last_shard, walk.last_offset, epoch, number)
            full = pending.add(item, f"{walk.last_shard}#{sample.key}", ref)
            if full is not None:
                items, keys = full
                position = {"reader": reader, "cursor": {**asdict(walk.cursor), "pending": pending.refs()}}
                yield {
                    **{key: torch.stack([i[key] for i in items]) for key in items[0]},
                    POSITION_KEY: json.dumps(position),
                    KEYS_KEY: json.dumps(keys),
                }


def ignore_stop_signals(_worker_id: int) -> None:
    """DataLoader workers leave SIGTERM and SIGINT to the training process. torchrun's agent stops
    a job with `os.killpg` on each worker's process group, which holds its DataLoader workers too:
    killed by the signal, they would take the trainer down mid-step ("DataLoader worker ... is
    killed by signal: Terminated") before it saves its checkpoint. Ignoring it, they keep serving
    until the trainer has saved and shuts them down (they also exit when it dies: torch's watchdog)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class ShardLoader:
    """Iterable of batches ({"pixel_values", "input_ids"[, "input_ids_2", ...], "original_size",
    "crop_top_left"}) with `state_dict()`: the position after the last
    batch handed out. Iterating again (a new `iter()`) continues from that position."""

    def __init__(self, stream: ShardStream, index: DatasetIndex, identity: dict[str, Any]) -> None:
        self.stream, self.index, self.identity = stream, index, identity
        self.num_workers = stream.config.num_workers

    def _dataloader(self) -> DataLoader:
        workers = self.num_workers
        return DataLoader(
            self.stream,
            batch_size=None,  # the stream batches itself: each batch comes whole from one reader
            num_workers=workers,
            pin_memory=torch.cuda.is_available(),
            prefetch_factor=2 if workers > 0 else None,
            worker_init_fn=ignore_stop_signals if workers > 0 else None,
        )

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        readers = max(1, self.num_workers)
        for batch in self._dataloader():
            position = json.loads(batch.pop(POSITION_KEY))
            reader = int(position["reader"])
            self.stream.cursors[reader] = Cursor.from_json(position["cursor"])
            # DataLoader hands out the workers' batches in turn, from worker 0 after a restart: the
            # worker that starts a resumed loader must be the reader whose turn was next.
            self.stream.first_reader = (reader + 1) % readers
            yield batch
        raise EmptyStreamError(
            f"rank {self.stream.config.rank}'s share of the {len(self.index.shards)} tar file(s) yields no batch "
            f"of {self.stream.config.batch_size}: too few usable samples for {self.stream.config.world_size} "
            f"rank(s) x {readers} reader(s); use fewer instances or dataloader_num_workers, or more data"
        )

    def __len__(self) -> int:
        raise TypeError("a ShardLoader is endless: the trainer stops at max_train_steps")

    def state_dict(self) -> dict[str, Any]:
        return {
            **self.identity,
            "next_reader": self.stream.first_reader,
            "cursors": {str(r): asdict(c) for r, c in sorted(self.stream.cursors.items())},
        }


def _check_state(state: dict[str, Any], identity: dict[str, Any]) -> tuple[dict[int, Cursor], int]:
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise DataStateError(f"data position version {state.get('version') if isinstance(state, dict) else state!r} "
                             f"is not {STATE_VERSION}: it must come from this image's state_dict()")  # fmt: skip
    for key, value in identity.items():
        if state.get(key) != value:
            raise DataStateError(
                f"the checkpoint's data position was saved with {key}={state.get(key)!r}, this run has {value!r}: "
                "the shards would be split differently, so it cannot resume without repeating or skipping "
                f"samples. Resume with the same {key}, or train from a fresh start"
            )
    readers = max(1, int(identity["num_workers"]))
    try:
        cursors = {int(r): Cursor.from_json(c) for r, c in dict(state["cursors"]).items()}
        first = int(state["next_reader"])
    except (KeyError, TypeError, ValueError) as exc:
        raise DataStateError(f"data position is malformed ({exc}): it must come from state_dict()") from None
    if any(not 0 <= r < readers for r in cursors) or not 0 <= first < readers:
        raise DataStateError(f"data position names readers outside 0..{readers - 1}: {sorted(cursors)}")
    return cursors, first


def make_dataloader(
    args: Any,
    tokenizer: Any,
    *,
    rank: int,
    world_size: int,
    state: dict[str, Any] | None = None,
    tokenize: Callable[[str], dict[str, torch.Tensor]] | None = None,
    resolution_multiple: int = 8,
) -> ShardLoader:
    """This rank's endless batches over the shards index.json lists, resumed at `state` when given.
    Captions go through `tokenize` (a family's several tokenizers: sdflow_image.families) when
    given, else `tokenizer`. With `args.aspect_buckets` each batch is of one of the buckets of the
    resolution and the family's `resolution_multiple` (buckets.buckets_for).

    Reads from `args`: dataset_dir, dataset_index, resolution, train_batch_size, dataloader_num_workers,
    interleave_shards, seed, center_crop, random_flip, aspect_buckets."""
    index = load_index(args.dataset_dir, args.dataset_index)
    config = StreamConfig(
        resolution=args.resolution,
        batch_size=args.train_batch_size,
        rank=rank,
        world_size=world_size,
        num_workers=args.dataloader_num_workers,
        interleave_shards=args.interleave_shards,
        seed=args.seed,
        center_crop=args.center_crop,
        random_flip=args.random_flip,
        buckets=buckets_for(args.resolution, resolution_multiple) if getattr(args, "aspect_buckets", False) else (),
    )
    identity = {
        "version": STATE_VERSION,
        "rank": rank,
        "world_size": world_size,
        "num_workers": config.num_workers,
        "interleave_shards": config.interleave_shards,
        "seed": config.seed,
        "shards": fingerprint(index.identity()),
        # A position with samples pending in some buckets means nothing with other buckets or none (a
        # state saved before buckets existed has no such key: None, square batches, as it was).
        "buckets": buckets_fingerprint(config.buckets) if config.buckets else None,
    }
    cursors, first = _check_state(state, identity) if state is not None else ({}, 0)
    source = source_for(args.dataset_dir)
    captions = tokenize or CaptionTokenizer(tokenizer)
    stream = ShardStream(source, index.shards, captions, config, cursors, first, index.dropped_files)
    return ShardLoader(stream, index, identity)
