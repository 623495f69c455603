"""Real parquet files (written by pyarrow, as img2dataset's inputs are) for the intake checks."""

from __future__ import annotations

import io
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tests.unit.helpers import DATA_BUCKET, AwsWorld


def parquet_bytes(
    rows: int = 4,
    url_column: str = "URL",
    caption_column: str = "TEXT",
    url_type: Any = None,
    extra: dict[str, Any] | None = None,
    **write_options: Any,
) -> bytes:
    """A LAION-style file: URL and caption columns plus WIDTH/HEIGHT and the `extra` columns (name → pyarrow
    array of `rows` values), `rows` rows."""
    url_type = pa.string() if url_type is None else url_type
    urls = [i if pa.types.is_integer(url_type) else f"http://127.0.0.1:9/{i}.jpg" for i in range(rows)]
    table = pa.table(
        {
            url_column: pa.array(urls, url_type),
            caption_column: pa.array([f"caption {i}" for i in range(rows)], pa.string()),
            "WIDTH": pa.array([64] * rows, pa.int64()),
            "HEIGHT": pa.array([64] * rows, pa.int64()),
            **(extra or {}),
        }
    )
    buffer = io.BytesIO()
    pq.write_table(table, buffer, **write_options)
    return buffer.getvalue()


def put_object(world: AwsWorld, key: str, body: bytes) -> str:
    """Put `body` at `key` of the stack's bucket; its s3:// URI."""
    world.s3.put_object(Bucket=DATA_BUCKET, Key=key, Body=body)
    return f"s3://{DATA_BUCKET}/{key}"
