"""The dedup job's first pass: read every shard's `_SUCCESS` and `hashes.parquet` once and spill
fixed-width records to P partition files per kind on the local disk.

A record is (hash as two uint64, split rank, shard position, key rank): 25 bytes (RECORD). The
shard position is the shard's place in shards.json, the key rank the sample's place among its
shard's keys sorted (so ordering by key rank orders by key); the sorted keys themselves go to
`keys/<position>.json`, read back only for shards that have drops. The partition of a record is its
hash's first uint64 modulo P: sha256 bits are uniform, so partitions are even in size, and every
copy of one hash lands in the same partition.

Each reader process handles the shards at positions i, i+N, i+2N, ... and owns its own spill files
(`spill/<kind>/<partition>/<reader>.bin`, appended): no locks. It buffers at most FLUSH_ROWS records
before it appends them, so its memory is one shard's table plus FLUSH_ROWS x 25 bytes."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sdflow_image.download.hashes import HASH_BYTES, SPLITS
from sdflow_image.s3_uri import S3Prefix

RECORD = np.dtype([("h0", "<u8"), ("h1", "<u8"), ("split", "u1"), ("shard", "<u4"), ("key", "<u4")])
KINDS = ("url", "image")  # the hash columns are <kind>_hash; the order is the drop reasons' precedence
SPLIT_RANK = {"holdout": 0, "train": 1}  # the keeper rule's first term: a held-out copy wins
TRAIN = SPLIT_RANK["train"]
FLUSH_ROWS = 1_000_000
FETCH_THREADS = 8  # GETs in flight per reader (boto3's default pool holds 10 connections)
SUCCESS_FILE = "_SUCCESS"


class DedupError(RuntimeError):
    """The dedup job cannot finish; the message names the input and the fix."""


class BadHashes(DedupError):
    """A shard's hashes file is unreadable or not the download job's format."""


@dataclass(frozen=True)
class ShardRef:
    position: int  # in shards.json: the keeper rule's second term
    shard_id: str
    output_uri: str


@dataclass(frozen=True)
class ShardRead:
    position: int
    state: str  # "hashed" | "unhashed" (_SUCCESS without hashes) | "absent" (no _SUCCESS)
    rows: int = 0


def spill_path(work: Path, kind: str, partition: int, reader: int) -> Path:
    return work / "spill" / kind / f"{partition:05d}" / f"{reader:04d}.bin"


def keys_path(work: Path, position: int) -> Path:
    return work / "keys" / f"{position:07d}.json"


def _read_object(client: Any, uri: str, name: str) -> bytes | None:
    """The object's bytes, or None when it does not exist."""
    from botocore.exceptions import ClientError

    where = S3Prefix.parse(uri)
    try:
        response = client.get_object(Bucket=where.bucket, Key=where.key(name))
    except ClientError as exc:
        if str(exc.response.get("Error", {}).get("Code", "")) in ("NoSuchKey", "404"):
            return None
        raise DedupError(f"could not read {where.uri}{name}: {exc}. The job's role needs s3:GetObject") from exc
    return bytes(response["Body"].read())


def _hash_columns(table: Any, kind: str, where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(h0, h1, valid) of the `<kind>_hash` column as numpy, straight from its Arrow buffer."""
    import pyarrow as pa

    column = table.column(f"{kind}_hash").combine_chunks()
    if column.type != pa.binary(HASH_BYTES):
        raise BadHashes(f"{where}: {kind}_hash is {column.type}, not fixed_size_binary({HASH_BYTES})")
    rows = len(column)
    data = column.buffers()[1]
    if data is None or rows == 0:  # no values buffer: every row null (or none at all)
        words = np.zeros((rows, 2), "<u8")
    else:
        raw = np.frombuffer(data, dtype=np.uint8, count=rows * HASH_BYTES, offset=column.offset * HASH_BYTES)
        words = raw.reshape(rows, HASH_BYTES).view("<u8")
    valid = np.asarray(column.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    return words[:, 0], words[:, 1], valid


def shard_records(raw: bytes, position: int, where: str) -> tuple[list[str], dict[str, np.ndarray]]:
    """The shard's keys sorted, and its records per kind (null hashes left out)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(io.BytesIO(raw))
        missing = {"key", "split", "url_hash", "image_hash"} - set(table.column_names)
        if missing:
            raise BadHashes(f"{where} lacks column(s) {sorted(missing)}: it must be the download job's hashes file")
        table = table.take(pc.sort_indices(table, sort_keys=[("key", "ascending")]))
        keys = [str(k) for k in table.column("key").to_pylist()]
        splits = table.column("split").to_pylist()
    except pa.ArrowException as exc:
        raise BadHashes(f"{where} is not a readable parquet file ({exc}); rerun the shard's download job") from exc
    unknown = set(splits) - set(SPLITS)
    if unknown:
        raise BadHashes(f"{where}: split holds {sorted(map(str, unknown))}; expected only {list(SPLITS)}")
    rank = np.array([SPLIT_RANK[s] for s in splits], dtype="u1")
    records = {}
    for kind in KINDS:
        h0, h1, valid = _hash_columns(table, kind, where)
        out = np.empty(int(valid.sum()), dtype=RECORD)
        out["h0"], out["h1"], out["split"] = h0[valid], h1[valid], rank[valid]
        out["shard"], out["key"] = position, np.flatnonzero(valid)
        records[kind] = out
    return keys, records


class Spiller:
    """One reader's buffered appends to its P spill files per kind."""

    def __init__(self, work: Path, reader: int, partitions: int) -> None:
        self.work, self.reader, self.partitions = work, reader, partitions
        self.pending: dict[str, list[np.ndarray]] = {kind: [] for kind in KINDS}
        self.rows = 0

    def add(self, records: dict[str, np.ndarray]) -> None:
        for kind, array in records.items():
            self.pending[kind].append(array)
            self.rows += len(array)
        if self.rows >= FLUSH_ROWS:
            self.flush()

    def flush(self) -> None:
        for kind, arrays in self.pending.items():
            if not arrays:
                continue
            records = np.concatenate(arrays)
            part = records["h0"] % np.uint64(self.partitions)
            order = np.argsort(part, kind="stable")
            records, part = records[order], part[order]
            bounds = np.searchsorted(part, np.arange(self.partitions + 1, dtype=np.uint64))
            for p in range(self.partitions):
                if bounds[p] == bounds[p + 1]:
                    continue
                path = spill_path(self.work, kind, p, self.reader)
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("ab") as handle:
                    records[bounds[p] : bounds[p + 1]].tofile(handle)
            self.pending[kind] = []
        self.rows = 0


def fetch_shard(s3: Any, shard: ShardRef) -> tuple[str, bytes | None]:
    """(state, the hashes file's bytes when hashed): the shard's `_SUCCESS`, then the file it names."""
    raw = _read_object(s3, shard.output_uri, SUCCESS_FILE)
    if raw is None:
        return "absent", None
    try:
        success = json.loads(raw)
    except ValueError as exc:
        raise DedupError(f"{shard.output_uri}{SUCCESS_FILE} is not JSON ({exc}); rerun the shard's download") from exc
    name = success.get("hashes_file") if isinstance(success, dict) else None
    if not name:
        return "unhashed", None  # made before hashes existed
    body = _read_object(s3, shard.output_uri, str(name))
    if body is None:
        raise BadHashes(f"{shard.output_uri}{name} is named by _SUCCESS but missing; rerun the shard's download job")
    return str(name), body


def _fetched(s3: Any, shards: list[ShardRef]) -> Iterator[tuple[ShardRef, str, bytes | None]]:
    """The shards' objects in order, FETCH_THREADS GETs in flight: S3 answers each in tens of ms, and one
    at a time would leave the reader waiting. At most FETCH_THREADS shards' files are held at once."""
    with ThreadPoolExecutor(FETCH_THREADS) as pool:
        for start in range(0, len(shards), FETCH_THREADS):
            chunk = shards[start : start + FETCH_THREADS]
            for shard, (state, body) in zip(chunk, pool.map(lambda s: fetch_shard(s3, s), chunk), strict=True):
                yield shard, state, body


def read_shards(
    shards: list[ShardRef], work: Path, reader: int, partitions: int, client: Callable[[], Any]
) -> list[ShardRead]:
    """Reader `reader`'s pass over its shards: what each holds, its records spilled, its keys saved."""
    spiller = Spiller(work, reader, partitions)
    found = []
    for shard, state, body in _fetched(client(), shards):
        if body is None:
            found.append(ShardRead(shard.position, state))
            continue
        keys, records = shard_records(body, shard.position, f"{shard.output_uri}{state}")
        path = keys_path(work, shard.position)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(keys))
        spiller.add(records)
        found.append(ShardRead(shard.position, "hashed", len(keys)))
    spiller.flush()
    return found
