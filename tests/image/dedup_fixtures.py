"""Helpers of the dedup tests and bench/bench_dedup.py: shard folders in S3 with a `_SUCCESS` and a
synthetic `hashes.parquet` each (the download job's format), with duplicates planted at known places.

Planted, with `dup_rate` r: each training sample outside shard 0 is, with probability r/2, a URL copy
(the URL and image of a random sample of an earlier shard: dropped as `url`) and with probability
r/2 an image copy (a URL of its own, the image of a random sample of an earlier shard: dropped as
`image`). Originals are never copies themselves, so each copy's keeper is its original (earlier
shard). Besides: a near-identical pair (two images one pixel apart, in shards 0 and 1: both stay,
their pixel hashes differ) and a held-out sample in the last shard whose image a training sample of
shard 0 has (that training sample is dropped as `image`: the held-out copy wins)."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sdflow_image.download.hashes import pixels_hash, schema, url_hash


@dataclass
class Planted:
    url: set[tuple[str, str]] = field(default_factory=set)  # (shard_id, key) dropped as URL copies
    image: set[tuple[str, str]] = field(default_factory=set)  # dropped as image copies
    stays: set[tuple[str, str]] = field(default_factory=set)  # must not be dropped (the near pair, the holdout)


def shard_id(position: int) -> str:
    return f"{position:05d}"


def key(position: int, row: int) -> str:
    return f"{position:05d}{row:04d}"


def _pixels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)


def plant(shards: int, rows: int, dup_rate: float, seed: int = 0) -> tuple[list[list[dict[str, Any]]], Planted]:
    """Each shard's rows (key, split, url_hash, image_hash) and what is planted in them."""
    rng = np.random.default_rng(seed)
    planted = Planted()
    tables: list[list[dict[str, Any]]] = []
    originals: list[tuple[bytes, bytes]] = []  # (url_hash, image_hash) of samples that are no copy
    for position in range(shards):
        table, mine = [], []
        draws, picks = rng.random(rows), rng.integers(0, 2**62, rows)
        for row in range(rows):
            sample = (shard_id(position), key(position, row))
            url, image = url_hash(f"https://example.com/{position}/{row}.jpg"), bytes(rng.bytes(16))
            if originals and draws[row] < dup_rate / 2:
                url, image = originals[int(picks[row]) % len(originals)]
                planted.url.add(sample)
            elif originals and draws[row] < dup_rate:
                image = originals[int(picks[row]) % len(originals)][1]
                planted.image.add(sample)
            else:
                mine.append((url, image))
            table.append({"key": sample[1], "split": "train", "url_hash": url, "image_hash": image})
        tables.append(table)
        originals.extend(mine)  # only earlier shards' samples are picked: the copy is never the keeper
    _plant_specials(tables, planted)
    return tables, planted


def _plant_specials(tables: list[list[dict[str, Any]]], planted: Planted) -> None:
    near = _pixels(1)
    other = near.copy()
    other[3, 4, 0] ^= 1  # one pixel, one bit: a perceptual hash would merge them
    last = len(tables) - 1
    specials = [
        (0, pixels_hash(8, 8, near.tobytes()), "train", "near-a"),
        (min(1, last), pixels_hash(8, 8, other.tobytes()), "train", "near-b"),
        (0, pixels_hash(8, 8, _pixels(2).tobytes()), "train", "held-copy"),
        (last, pixels_hash(8, 8, _pixels(2).tobytes()), "holdout", "held"),
    ]
    for position, image, split, name in specials:
        sample = (shard_id(position), f"{position:05d}x{name}")
        row = {"key": sample[1], "split": split, "url_hash": url_hash(f"https://example.com/{name}/{position}"),
               "image_hash": image}  # fmt: skip
        tables[position].append(row)
        (planted.image if name == "held-copy" else planted.stays).add(sample)


def parquet_bytes(rows: list[dict[str, Any]]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema()), buffer)
    return buffer.getvalue()


def shard_uri(bucket: str, run: str, position: int) -> str:
    return f"s3://{bucket}/runs/{run}/dataset/shards/{shard_id(position)}/"


def put_run(client: Any, bucket: str, run: str, tables: list[list[dict[str, Any]] | None], *,
            unhashed: tuple[int, ...] = (), manifest: bool = True) -> str:  # fmt: skip
    """Shard folders (a None table: no `_SUCCESS`, a download that never finished; `unhashed`: a
    `_SUCCESS` without hashes, an older cache) and shards.json (unless `manifest` is false); returns
    the manifest's URI."""
    items = []
    for position, rows in enumerate(tables):
        prefix = f"runs/{run}/dataset/shards/{shard_id(position)}/"
        items.append({"shard_id": shard_id(position), "parquet_uri": f"s3://{bucket}/in/{position}.parquet",
                      "output_uri": shard_uri(bucket, run, position)})  # fmt: skip
        if rows is None:
            continue
        success: dict[str, Any] = {"samples": sum(r["split"] == "train" for r in rows)}
        if position not in unhashed:
            client.put_object(Bucket=bucket, Key=prefix + "hashes.parquet", Body=parquet_bytes(rows))
            success |= {"hashes_file": "hashes.parquet", "hashed_samples": len(rows)}
        client.put_object(Bucket=bucket, Key=prefix + "_SUCCESS", Body=json.dumps(success).encode())
    if manifest:
        client.put_object(Bucket=bucket, Key=f"runs/{run}/shards.json", Body=json.dumps(items).encode())
    return f"s3://{bucket}/runs/{run}/shards.json"


def read_json(client: Any, uri: str) -> Any:
    bucket, _, key_ = uri.removeprefix("s3://").partition("/")
    return json.loads(client.get_object(Bucket=bucket, Key=key_)["Body"].read())


def found(client: Any, output_uri: str, summary: dict[str, Any]) -> tuple[set[tuple[str, str]], int]:
    """Every (shard_id, key) in the job's dropped files, and how many dropped files there are."""
    dropped = set()
    files = [entry["dropped_file"] for entry in summary["shards"].values() if entry["dropped_file"]]
    for name in files:
        body = read_json(client, output_uri + name)
        dropped |= {(body["shard_id"], k) for k in body["keys"]}
    return dropped, len(files)
