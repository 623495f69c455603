"""Batches of one image size, and the samples waiting for theirs as part of the resume position.

A reader (sdflow_image.training.data) hands every transformed sample to `PendingSamples`, which keeps
the samples of each size (each aspect-ratio bucket, `aspect_buckets`; one size otherwise) in draw
order and gives back a batch when a size has `batch_size` of them. Without buckets there is one size,
so a batch is simply the next `batch_size` samples, as before.

With buckets, samples of the other buckets are still waiting when a batch leaves: they were drawn
(the reader's cursor is past them) but trained on in no batch yet. The position saved after a batch
therefore lists each of them (`PendingRef`: tar path, byte offset of the sample, epoch and draw
number). A resumed reader re-reads each with one ranged GET, redoes its seeded transform (the crop
and flip are drawn from the epoch and draw number alone) and puts it back in its bucket, in the
order drawn: the resumed run's batches are the uninterrupted run's, sample for sample. The list is
at most (buckets - 1) x (batch_size - 1) entries: a few kilobytes in the checkpoint.

Partly filled buckets are carried over the end of an epoch, never dropped: the walk simply goes on
drawing the next epoch's samples into them, so a rare bucket's samples train once it fills (and,
in a tiny dataset, a batch may hold one image of two epochs). The order is the draw order either
way, so it is as deterministic as the square batches."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sdflow_image.training.data_source import ShardReader, Source, TarSample


class PendingStateError(ValueError):
    """A saved pending sample cannot be read back as it was (the shard changed or the reference is
    malformed); the message names the sample."""


@dataclass(frozen=True)
class PendingRef:
    shard: str  # tar path relative to the dataset root
    offset: int  # byte offset of the sample's first tar header
    epoch: int
    number: int  # the draw number in its epoch

    def to_json(self) -> list[Any]:
        return [self.shard, self.offset, self.epoch, self.number]

    @classmethod
    def from_json(cls, raw: Any) -> PendingRef:
        shard, offset, epoch, number = raw
        if not isinstance(shard, str) or not shard:
            raise ValueError(f"pending sample {raw!r} names no tar path")
        return cls(shard, int(offset), int(epoch), int(number))


def parse_pending(raw: Any) -> list[list[Any]]:
    """A saved position's pending list, checked (ValueError/TypeError when malformed)."""
    return [PendingRef.from_json(item).to_json() for item in raw]


@dataclass
class _Waiting:
    item: dict[str, Any]
    key: str
    ref: PendingRef


@dataclass
class PendingSamples:
    """Samples per size (the last two dimensions of `pixel_values`) until one size fills a batch."""

    batch_size: int
    sizes: dict[tuple[int, ...], list[_Waiting]] = field(default_factory=dict)

    def add(self, item: dict[str, Any], key: str, ref: PendingRef) -> tuple[list[dict[str, Any]], list[str]] | None:
        """Keep one sample; when its size has a batch, (items, keys) of that batch, in draw order."""
        size = tuple(item["pixel_values"].shape[-2:])
        waiting = self.sizes.setdefault(size, [])
        waiting.append(_Waiting(item, key, ref))
        if len(waiting) < self.batch_size:
            return None
        del self.sizes[size]
        return [w.item for w in waiting], [w.key for w in waiting]

    def refs(self) -> list[list[Any]]:
        """Every waiting sample's reference, in draw order (the order a resume puts them back in)."""
        waiting = [w.ref for ws in self.sizes.values() for w in ws]
        return [ref.to_json() for ref in sorted(waiting, key=lambda r: (r.epoch, r.number))]

    def restore(
        self,
        source: Source,
        refs: list[list[Any]],
        make_item: Callable[[TarSample, int, int], dict[str, Any] | None],
    ) -> None:
        """Put the samples of a saved position back (`make_item(sample, epoch, number)` is the
        reader's seeded transform), each read again at its offset."""
        for raw in refs:
            ref = PendingRef.from_json(raw)
            reader = ShardReader(source, ref.shard, ref.offset)
            try:
                sample = reader.next_sample()
            finally:
                reader.close()
            item = make_item(sample, ref.epoch, ref.number) if sample is not None else None
            if item is None:
                raise PendingStateError(
                    f"the saved data position's pending sample at byte {ref.offset} of {source.describe(ref.shard)} "
                    "no longer reads as a training sample: the shard changed since the checkpoint. Restore the "
                    "shard, or train from a fresh start"
                )
            if self.add(item, f"{ref.shard}#{sample.key}" if sample else "", ref) is not None:
                raise PendingStateError(
                    f"the saved data position holds {self.batch_size} or more pending samples of one size: it was "
                    f"saved with another batch size than this run's {self.batch_size}"
                )
