"""Per-sample hashes of a finished shard, for the global deduplication (docs/contracts.md, "The dedup job").

For each sample of a finished tar (training `NNNNN.tar` and held-out `holdout/NNNNN.tar` alike):
- `url_hash` = sha256(url.strip() as UTF-8)[:16], the url img2dataset recorded in the sample's `.json`
  (null when the sample has none: its key is no URL, and keys repeat across shards);
- `image_hash` = sha256(f"{w}x{h}:RGB" + the decoded RGB pixel bytes)[:16]: exact pixel identity. A
  perceptual hash would merge near-identical distinct images (one pixel apart), which must both stay.
  Null when the image does not decode (the training reader skips such a sample anyway).

Where they go. The download job hashes each finished shard right after its held-out split and
uploads `NNNNN_hashes.parquet` with it (after its tars, before its stats file, which stays the shard's
last object: shard_upload). A retried job counts a shard complete only when that file is listed too,
so every skipped shard has its hashes in S3 already; before `_SUCCESS` the job merges the per-tar files
of all its shards into `hashes.parquet` (a few dozen small GETs). Per-tar files rather than hashing the
skipped tars again from S3: a tar is hundreds of MB, its hashes about 50 bytes per sample.

Columns of both files: `key` (string, the webdataset key), `split` ("train" | "holdout"), `url_hash`,
`image_hash` (fixed_size_binary(16)). No torch here: the download job imports it."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sdflow_image.training.data_source import iter_samples

HASHES_FILE = "hashes.parquet"  # the shard folder's merged file (_SUCCESS "hashes_file")
HASHES_SUFFIX = "_hashes.parquet"  # one per finished tar pair: NNNNN_hashes.parquet
HASH_BYTES = 16
SPLITS = ("train", "holdout")
# The image extensions the training reader takes (sdflow_image.training.data.IMAGE_KEYS, which imports torch).
IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")


class HashError(RuntimeError):
    """A finished shard could not be hashed; the message names the tar."""


def schema() -> Any:
    import pyarrow as pa

    digest = pa.binary(HASH_BYTES)
    return pa.schema([("key", pa.string()), ("split", pa.string()), ("url_hash", digest), ("image_hash", digest)])


def url_hash(url: str) -> bytes:
    return hashlib.sha256(url.strip().encode("utf-8")).digest()[:HASH_BYTES]


def pixels_hash(width: int, height: int, rgb: bytes) -> bytes:
    return hashlib.sha256(f"{width}x{height}:RGB".encode() + rgb).digest()[:HASH_BYTES]


def image_hash(data: bytes) -> bytes | None:
    """The hash of the decoded RGB pixels, or None when the bytes do not decode."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            rgb = image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError):
        return None
    return pixels_hash(rgb.width, rgb.height, rgb.tobytes())


def _url(files: dict[str, bytes]) -> str | None:
    try:
        meta = json.loads(files["json"]) if "json" in files else None
    except ValueError:
        return None
    url = meta.get("url") if isinstance(meta, dict) else None
    return url if isinstance(url, str) and url.strip() else None


def tar_rows(path: Path, split: str) -> Iterator[dict[str, Any]]:
    """One row per sample of the tar, in file order (streamed: one sample in memory at a time)."""
    if path.stat().st_size == 0:
        return  # img2dataset leaves an empty file for a shard without one success
    with path.open("rb") as stream:
        for sample in iter_samples(stream, 0, str(path)):
            url = _url(sample.files)
            image = next((sample.files[k] for k in IMAGE_KEYS if k in sample.files), None)
            yield {
                "key": sample.key,
                "split": split,
                "url_hash": url_hash(url) if url is not None else None,
                "image_hash": image_hash(image) if image is not None else None,
            }


def write_shard_hashes(train_tar: Path, holdout_tar: Path | None, out: Path) -> int:
    """Hash a finished shard's training tar and held-out tar (if any) into `out`; return its rows.
    Written whole or not at all (a `.partial` renamed), so a file there is a finished one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    try:
        for tar, split in ((train_tar, "train"), (holdout_tar, "holdout")):
            if tar is not None:
                rows.extend(tar_rows(tar, split))
    except Exception as exc:  # tarfile.TarError, OSError: named for the failure file, not swallowed
        raise HashError(f"could not hash {train_tar.name}: {type(exc).__name__}: {exc}") from exc
    partial = out.with_name(out.name + ".partial")
    pq.write_table(pa.Table.from_pylist(rows, schema=schema()), partial)
    partial.replace(out)
    return len(rows)


def merge(read: Callable[[str], bytes], names: list[str]) -> tuple[bytes, int]:
    """The per-tar hash files `names` (read by `read`) as one parquet file's bytes, and its rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = [pq.read_table(io.BytesIO(read(name))).cast(schema()) for name in names]
    table = pa.concat_tables(tables) if tables else schema().empty_table()
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue(), table.num_rows
