"""The download job's row filters (`--filters`): rows of the parquet dropped on its own columns before img2dataset
sees them, so a filtered-out row is never fetched, stored or trained on.

`--filters` takes one or more JSON objects, each `{name: {"columns": [...], "bound": number}}` (the run
document's `dataset.filters` with its columns resolved: sdflow_common.dataset_filters.DatasetFilters.job_arguments,
one object per bound, as a SageMaker ContainerArguments item holds at most 256 characters). The filters run in
FILTER_NAMES' order: a row several of them drop counts once, under the first; a row with no value (null, NaN)
in a filtered column is dropped by that filter. The parquet is read and the kept rows written in batches
(BATCH_ROWS), so a LAION file of millions of rows never sits in memory whole."""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdflow_image.flags import FlagError

LOG = logging.getLogger("sdflow.download.filters")

# The run document's order (sdflow_common.dataset_filters.FILTER_NAMES; tests/image/test_download_filters.py
# holds the two equal): a row's drop is counted under the first filter it fails in this order.
FILTER_NAMES = (
    "min_width",
    "min_height",
    "max_aspect_ratio",
    "max_punsafe",
    "max_pwatermark",
    "min_aesthetic",
    "min_similarity",
    "min_caption_length",
    "max_caption_length",
)
CAPTION_FILTERS = ("min_caption_length", "max_caption_length")
TWO_COLUMN_FILTERS = ("max_aspect_ratio",)  # width and height
BATCH_ROWS = 64 * 1024
FILTERED_NAME = "filtered.parquet"
FLAG_HELP = (
    'row filters, one or more JSON objects {"<filter>": {"columns": [<column>, ...], "bound": <number>}} '
    f"(filters: {', '.join(FILTER_NAMES)}); rows failing one are not downloaded"
)


class FilterError(RuntimeError):
    """A filter cannot be applied to the parquet; the message names the filter, the column and the file."""


class MissingColumn(FilterError):
    """A filter's column is not in the parquet. (download.py's MissingColumn is the URL and caption columns'; this
    module cannot import it, as download.py imports this one, and the failure file shows the class name alike.)"""


class ColumnType(FilterError):
    """A filter's column holds another type than the filter compares (numbers; text for caption lengths)."""


@dataclass(frozen=True)
class RowFilter:
    name: str
    columns: tuple[str, ...]
    bound: float


def _bound(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"gives {name} the bound {value!r}; it must be a finite number")
    return value


def _columns(name: str, value: Any) -> tuple[str, ...]:
    wanted = 2 if name in TWO_COLUMN_FILTERS else 1
    if not isinstance(value, list) or len(value) != wanted or not all(isinstance(c, str) and c for c in value):
        raise ValueError(f"gives {name} the columns {value!r}; it reads a list of {wanted} column name(s)")
    return tuple(value)


def parse_filter(text: str) -> list[RowFilter]:
    """One `--filters` value: a JSON object of one or more filters. ValueError says what is wrong."""
    try:
        decoded = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError('is not JSON; expected {"min_width": {"columns": ["WIDTH"], "bound": 256}}') from None
    if not isinstance(decoded, dict) or not decoded:
        raise ValueError('is not a JSON object of filters, e.g. {"min_width": {"columns": ["WIDTH"], "bound": 256}}')
    found = []
    for name, spec in decoded.items():
        if name not in FILTER_NAMES:
            raise ValueError(f"names the filter {name!r}; known filters: {', '.join(FILTER_NAMES)}")
        if not isinstance(spec, dict) or set(spec) != {"columns", "bound"}:
            raise ValueError(f'gives {name} {spec!r}; expected {{"columns": [...], "bound": <number>}}')
        found.append(RowFilter(name, _columns(name, spec["columns"]), _bound(name, spec["bound"])))
    return found


def resolve(values: Sequence[Sequence[RowFilter]] | None) -> list[RowFilter]:
    """The flag's values as one list in FILTER_NAMES' order; FlagError when a filter is given twice."""
    merged: dict[str, RowFilter] = {}
    for row_filter in (item for value in values or () for item in value):
        if row_filter.name in merged:
            raise FlagError(f"--filters gives {row_filter.name} twice; give each filter once")
        merged[row_filter.name] = row_filter
    return [merged[name] for name in FILTER_NAMES if name in merged]


def job_options(row_filters: Sequence[RowFilter]) -> dict[str, Any]:
    """What the filters add to the job's options (shard_upload: a retry reuses only shards made with the same);
    nothing without filters, so that unfiltered shards keep their options."""
    if not row_filters:
        return {}
    return {"filters": {f.name: {"columns": list(f.columns), "bound": f.bound} for f in row_filters}}


@dataclass(frozen=True)
class Filtered:
    """The parquet img2dataset reads and what the filters did."""

    parquet: Path
    rows_read: int
    filter_drops: dict[str, int] = field(default_factory=dict)

    @property
    def rows_to_download(self) -> int:
        return self.rows_read - sum(self.filter_drops.values())

    def counts(self) -> dict[str, Any]:
        """`_SUCCESS`'s fields (docs/contracts.md, "The download job")."""
        return {
            "rows_read": self.rows_read,
            "filter_drops": dict(self.filter_drops),
            "rows_to_download": self.rows_to_download,
        }


def _check_columns(schema: Any, row_filters: Sequence[RowFilter], parquet: Path) -> None:
    import pyarrow as pa

    names = schema.names
    for row_filter in row_filters:
        for column in row_filter.columns:
            if column not in names:
                raise MissingColumn(
                    f"column {column!r} (--filters {row_filter.name}) is not in {parquet.name}; columns present: "
                    f"{names}. Set the run's dataset.filters.columns (or dataset.caption_column) to match the file"
                )
            kind = schema.field(column).type
            text = pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)
            numeric = pa.types.is_integer(kind) or pa.types.is_floating(kind)
            if not (text if row_filter.name in CAPTION_FILTERS else numeric):
                wanted = "text" if row_filter.name in CAPTION_FILTERS else "numbers"
                raise ColumnType(
                    f"column {column!r} (--filters {row_filter.name}) in {parquet.name} holds {kind}, not {wanted}"
                )


def _passes(row_filter: RowFilter, batch: Any) -> Any:
    """Which rows of the batch the filter keeps (a BooleanArray; null where a value is missing)."""
    import pyarrow.compute as pc

    values = [batch.column(column) for column in row_filter.columns]
    name, bound = row_filter.name, row_filter.bound
    if name == "max_aspect_ratio":
        width, height = (pc.cast(column, "float64") for column in values)
        # skip_nulls=False: a missing side is a missing ratio (by default the other side alone would be both).
        shorter = pc.min_element_wise(width, height, skip_nulls=False)
        longer = pc.max_element_wise(width, height, skip_nulls=False)
        # A side of 0 (or less) has no ratio: the row is dropped, never divided by zero.
        return pc.and_(pc.greater(shorter, 0.0), pc.less_equal(pc.divide(longer, shorter), bound))
    if name in CAPTION_FILTERS:
        values = [pc.utf8_length(values[0])]  # characters (code points), not bytes
    compare = pc.greater_equal if name.startswith("min_") else pc.less_equal
    return compare(values[0], bound)


def apply_filters(parquet: Path, row_filters: Sequence[RowFilter], folder: Path, rows: int) -> Filtered:
    """Write the rows every filter keeps to `folder`/filtered.parquet (a fresh folder) and count the drops;
    without filters, the parquet as it is. MissingColumn or ColumnType when the file cannot be filtered."""
    if not row_filters:
        return Filtered(parquet, rows)
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    source = pq.ParquetFile(parquet)
    _check_columns(source.schema_arrow, row_filters, parquet)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    target = folder / FILTERED_NAME
    drops = dict.fromkeys((f.name for f in row_filters), 0)
    read = 0
    with pq.ParquetWriter(target, source.schema_arrow) as writer:
        for batch in source.iter_batches(batch_size=BATCH_ROWS):
            read += batch.num_rows
            alive = None
            for row_filter in row_filters:
                passes = pc.fill_null(_passes(row_filter, batch), False)
                failing = pc.invert(passes) if alive is None else pc.and_(alive, pc.invert(passes))
                drops[row_filter.name] += pc.sum(pc.cast(failing, "int64")).as_py() or 0
                alive = passes if alive is None else pc.and_(alive, passes)
            writer.write_batch(batch.filter(alive))
    filtered = Filtered(target, read, drops)
    LOG.info(
        "filters kept %d of %d rows of %s (dropped: %s)",
        filtered.rows_to_download,
        read,
        parquet.name,
        ", ".join(f"{name} {count}" for name, count in drops.items()),
    )
    return filtered
