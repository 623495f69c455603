"""The dedup job's second and third passes, one partition in memory per process at a time.

Grouping (per kind and hash partition): every spill file of the partition is loaded, sorted with
np.lexsort by (hash, split rank, shard position, key rank), so each group of equal hashes is
contiguous with its keeper first: the keeper is the minimum of (holdout 0 / train 1, position in
shards.json, key). Every other training record of the group is a drop; held-out ones never are. The
drops (shard, key rank, reason) are spilled again, partitioned by shard position modulo P.

Resolving (per shard partition): a sample dropped as a URL copy and as an image copy counts once,
as `url` (the contract's precedence: url first, image only for the rest). Each shard with drops gets
its sorted keys, read back from the reader's `keys/<position>.json`, as `dropped/<shard_id>.json`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from sdflow_image.dedup.spill import KINDS, RECORD, TRAIN, keys_path

DROP = np.dtype([("shard", "<u4"), ("key", "<u4"), ("reason", "u1")])  # reason: index in KINDS


def drops_path(work: Path, shard_partition: int, kind: str, hash_partition: int) -> Path:
    return work / "drops" / f"{shard_partition:05d}" / f"{kind}-{hash_partition:05d}.bin"


def load_partition(work: Path, kind: str, partition: int) -> np.ndarray:
    folder = work / "spill" / kind / f"{partition:05d}"
    files = sorted(folder.glob("*.bin")) if folder.is_dir() else []
    arrays = [np.fromfile(path, dtype=RECORD) for path in files]
    return np.concatenate(arrays) if arrays else np.empty(0, dtype=RECORD)


def non_keepers(records: np.ndarray) -> np.ndarray:
    """The training records that are not their hash group's keeper."""
    order = np.lexsort((records["key"], records["shard"], records["split"], records["h1"], records["h0"]))
    ordered = records[order]
    del order
    first = np.ones(len(ordered), dtype=bool)
    first[1:] = (ordered["h0"][1:] != ordered["h0"][:-1]) | (ordered["h1"][1:] != ordered["h1"][:-1])
    return ordered[~first & (ordered["split"] == TRAIN)]


def group_partition(work: Path, kind: str, partition: int, partitions: int) -> int:
    """Group one partition of one kind; spill its drops by shard partition; return how many."""
    dropped = non_keepers(load_partition(work, kind, partition))
    out = np.empty(len(dropped), dtype=DROP)
    out["shard"], out["key"], out["reason"] = dropped["shard"], dropped["key"], KINDS.index(kind)
    target = out["shard"] % partitions
    for q in np.unique(target):
        path = drops_path(work, int(q), kind, partition)
        path.parent.mkdir(parents=True, exist_ok=True)
        out[target == q].tofile(path)
    return len(out)


def shard_drops(work: Path, shard_partition: int) -> dict[int, tuple[list[int], list[int]]]:
    """shard position -> (its dropped key ranks, their reasons), each sample once with its first reason."""
    folder = work / "drops" / f"{shard_partition:05d}"
    arrays = [np.fromfile(path, dtype=DROP) for path in sorted(folder.glob("*.bin"))] if folder.is_dir() else []
    if not arrays:
        return {}
    drops = np.concatenate(arrays)
    drops = drops[np.lexsort((drops["reason"], drops["key"], drops["shard"]))]
    first = np.ones(len(drops), dtype=bool)
    first[1:] = (drops["shard"][1:] != drops["shard"][:-1]) | (drops["key"][1:] != drops["key"][:-1])
    drops = drops[first]
    shards, starts = np.unique(drops["shard"], return_index=True)
    ends = [*starts[1:], len(drops)]
    return {
        int(shard): (drops["key"][a:b].tolist(), drops["reason"][a:b].tolist())
        for shard, a, b in zip(shards, starts, ends, strict=True)
    }


def resolve(
    work: Path, shard_partition: int, shard_ids: dict[int, str], put: Callable[[str, bytes], None]
) -> dict[str, dict[str, int]]:
    """Write dropped/<shard_id>.json (through `put`) for this partition's shards with drops; return
    shard_id -> {"url_duplicates", "image_duplicates"} for them."""
    counts: dict[str, dict[str, int]] = {}
    for position, (ranks, reasons) in shard_drops(work, shard_partition).items():
        keys = json.loads(keys_path(work, position).read_text())
        shard_id = shard_ids[position]
        dropped = sorted({keys[rank] for rank in ranks})
        body = {"shard_id": shard_id, "keys": dropped}
        put(f"dropped/{shard_id}.json", (json.dumps(body) + "\n").encode())
        counts[shard_id] = {f"{kind}_duplicates": reasons.count(i) for i, kind in enumerate(KINDS)}
    return counts
