"""Check every parquet object of a run before any job starts: it exists, it is a parquet file, it has
rows, it has the document's URL column (holding strings) and caption column, and every column a filter
of `dataset.filters` reads, holding numbers (text for the caption length filters).

A download job fails on each of these at once and would fail again on a retry, so catching them
here turns thousands of failed jobs into one clear error naming the field to change. A few bad
files within `download.tolerated_failure_percent` do not stop the run (the document says that
share of shards may fail): they come back as warnings, which the run's notification shows."""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from botocore.exceptions import ClientError

from sdflow_common import aws
from sdflow_common.dataset_filters import CAPTION_FILTERS
from sdflow_common.errors import DatasetNotFound
from sdflow_common.parquet_schema import NotParquet, ParquetSchema, SchemaTooLarge, read_schema
from sdflow_common.run_document import Dataset, invalid, parse_s3_uri

# Enough parallel reads to check a few thousand objects within a Lambda's time, few enough to
# stay far below S3's per-prefix request rate.
READ_WORKERS = 16
SHOWN = 3  # objects named per problem; the message counts the rest


@dataclass
class Findings:
    """Which objects have which problem (URIs in the order they were given)."""

    total: int = 0
    missing: list[str] = field(default_factory=list)
    not_parquet: list[tuple[str, str]] = field(default_factory=list)
    empty: list[str] = field(default_factory=list)
    no_url: list[tuple[str, list[str]]] = field(default_factory=list)
    url_not_text: list[tuple[str, str]] = field(default_factory=list)
    no_caption: list[tuple[str, list[str]]] = field(default_factory=list)
    # By (filter name, the field naming its column, the column): the objects without the column (with their
    # columns), and those where it holds another type than the filter compares (with that type).
    filter_missing: dict[tuple[str, str, str], list[tuple[str, list[str]]]] = field(default_factory=dict)
    filter_type: dict[tuple[str, str, str], list[tuple[str, str]]] = field(default_factory=dict)
    # num_rows of every parquet footer read, by URI (an object with an unchecked, too large schema has none).
    rows: dict[str, int] = field(default_factory=dict)

    def bad(self) -> set[str]:
        """The objects a download job would fail on."""
        bad = {uri for uri, _ in self.not_parquet} | set(self.empty)
        bad |= {uri for uri, _ in self.no_url} | {uri for uri, _ in self.url_not_text}
        bad |= {uri for uri, _ in self.no_caption}
        bad |= {uri for hits in self.filter_missing.values() for uri, _ in hits}
        bad |= {uri for hits in self.filter_type.values() for uri, _ in hits}
        return bad

    def unusable(self) -> int:
        """How many objects a download job would fail on."""
        return len(self.bad())

    def usable_rows(self) -> int:
        """The rows of the objects the run downloads (the held-out split is sized from them)."""
        bad = self.bad()
        return sum(rows for uri, rows in self.rows.items() if uri not in bad)


@dataclass(frozen=True)
class ParquetCheck:
    """What check_parquet_objects found: the problems the run tolerates, and the rows it will download."""

    warnings: list[dict[str, str]]
    rows: int


def missing_or_unreadable(exc: ClientError) -> bool:
    # Without s3:ListBucket, S3 answers 403 for a missing key; either way the object cannot be used.
    code = str(exc.response.get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound", "403", "AccessDenied", "Forbidden")


def _schema(uri: str) -> ParquetSchema | str | None:
    """The schema; the reason it is not parquet; None when the object is missing."""
    bucket, key = parse_s3_uri(uri)
    try:
        return read_schema(aws.client("s3"), bucket, key)
    except ClientError as exc:
        if missing_or_unreadable(exc):
            return None
        raise
    except NotParquet as exc:
        return str(exc)
    except SchemaTooLarge:
        # Only a file with tens of thousands of columns gets here; the download job checks it.
        return ParquetSchema()


def inspect(uris: list[str], dataset: Dataset) -> Findings:
    aws.client("s3")  # create the cached client before the threads share it (clients are thread-safe)
    found = Findings(total=len(uris))
    with ThreadPoolExecutor(max_workers=READ_WORKERS) as pool:
        for uri, schema in zip(uris, pool.map(_schema, uris), strict=True):
            if schema is None:
                found.missing.append(uri)
            elif isinstance(schema, str):
                found.not_parquet.append((uri, schema))
            elif schema.columns:  # an unchecked (too large) schema has none and passes
                _check_columns(found, uri, schema, dataset)
                found.rows[uri] = schema.num_rows
    return found


def _check_columns(found: Findings, uri: str, schema: ParquetSchema, dataset: Dataset) -> None:
    names = list(schema.columns)
    url = schema.columns.get(dataset.url_column)
    if url is None:
        found.no_url.append((uri, names))
    elif not url.is_string:
        found.url_not_text.append((uri, url.type_name))
    if dataset.caption_column not in schema.columns:
        found.no_caption.append((uri, names))
    if schema.num_rows == 0:
        found.empty.append(uri)
    _check_filter_columns(found, uri, schema, dataset)


def _check_filter_columns(found: Findings, uri: str, schema: ParquetSchema, dataset: Dataset) -> None:
    """Each filter's columns: present (a missing caption column is no_caption's), numbers or, for the caption
    length filters, text: the download job fails on anything else (sdflow_image.download.filters)."""
    filters = dataset.filters
    if filters is None:
        return
    for name in filters.bounds():
        columns = zip(filters.columns_of(name, dataset.caption_column), filters.column_fields(name), strict=True)
        for column, column_field in columns:
            key = (name, column_field, column)
            present = schema.columns.get(column)
            if present is None:
                if name not in CAPTION_FILTERS:
                    found.filter_missing.setdefault(key, []).append((uri, list(schema.columns)))
            elif not (present.is_string if name in CAPTION_FILTERS else present.is_number):
                found.filter_type.setdefault(key, []).append((uri, present.type_name))


def _shown(uris: Iterable[str], count: int) -> str:
    listed = list(uris)[:SHOWN]
    more = count - len(listed)
    return ", ".join(listed) + (f" and {more} more" if more > 0 else "")


def _of(count: int, total: int) -> str:
    return "the object" if total == 1 else f"{count} of {total} objects"


def _verb(count: int, singular: str, plural: str) -> str:
    return singular if count == 1 else plural


def _did_you_mean(wanted: str, columns: list[str]) -> str:
    same_but_case = [name for name in columns if name.lower() == wanted.lower()]
    close = same_but_case or difflib.get_close_matches(wanted, columns, n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'? " if close else ""


def _likeness(wanted: str, name: str) -> float:
    return difflib.SequenceMatcher(None, wanted.lower(), name.lower()).ratio()


def nearest_first(wanted: str, columns: list[str]) -> list[str]:
    """The columns, those whose name is most like `wanted` (case aside) first; ties keep the file's order."""
    return sorted(columns, key=lambda name: -_likeness(wanted, name))


def _nearest_guess(wanted: str, columns: list[str]) -> str:
    """The "did you mean …? " advice for the likest column when it is like enough (difflib's usual 0.6), case aside."""
    likest = nearest_first(wanted, columns)[:1]
    return f"did you mean '{likest[0]}'? " if likest and _likeness(wanted, likest[0]) >= 0.6 else ""


def _listed(columns: list[str]) -> str:
    return ", ".join(columns[:20]) + (" …" if len(columns) > 20 else "")


def _filter_problems(found: Findings) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    total = found.total
    for (name, column_field, column), hits in found.filter_missing.items():
        uri, columns = hits[0]
        out.append(
            {
                "field": f"dataset.filters.{name}",
                "message": f"reads column '{column}' ({column_field}), which is not in {_of(len(hits), total)} "
                f"({_shown((u for u, _ in hits), len(hits))}); {uri} has the columns (nearest first): "
                f"{_listed(nearest_first(column, columns))}. {_nearest_guess(column, columns)}Set {column_field} "
                f"to the column's name, or remove dataset.filters.{name}",
            }
        )
    for (name, column_field, column), typed in found.filter_type.items():
        uri, type_name = typed[0]
        wanted = "text" if name in CAPTION_FILTERS else "numbers"
        out.append(
            {
                "field": f"dataset.filters.{name}",
                "message": f"reads column '{column}' ({column_field}), which holds {type_name}, not {wanted}, in "
                f"{_of(len(typed), total)} ({_shown((u for u, _ in typed), len(typed))}); name a column of "
                f"{wanted} in {column_field}, or remove dataset.filters.{name}",
            }
        )
    return out


def _column_problem(field_name: str, wanted: str, hits: list[tuple[str, list[str]]], total: int) -> dict[str, str]:
    uri, columns = hits[0]
    present = ", ".join(columns[:20]) + (" …" if len(columns) > 20 else "")
    return {
        "field": field_name,
        "message": f"column '{wanted}' is not in {_of(len(hits), total)} "
        f"({_shown((u for u, _ in hits), len(hits))}); {uri} has the columns: {present}. "
        f"{_did_you_mean(wanted, columns)}Set {field_name} to the column's name",
    }


def problems(found: Findings, dataset: Dataset, source_field: str) -> list[dict[str, str]]:
    """What the document must change, one entry per kind of problem."""
    out: list[dict[str, str]] = []
    total = found.total
    if found.not_parquet:
        uri, reason = found.not_parquet[0]
        count = len(found.not_parquet)
        out.append(
            {
                "field": source_field,
                "message": f"{_of(count, total)} {_verb(count, 'is not a parquet file', 'are not parquet files')} "
                "the download job can read "
                f"({_shown((u for u, _ in found.not_parquet), count)}); {uri}: {reason}. "
                "List only parquet files (img2dataset's LAION format)",
            }
        )
    if found.no_url:
        out.append(_column_problem("dataset.url_column", dataset.url_column, found.no_url, total))
    if found.url_not_text:
        uri, type_name = found.url_not_text[0]
        out.append(
            {
                "field": "dataset.url_column",
                "message": f"column '{dataset.url_column}' holds {type_name}, not URL strings, in "
                f"{_of(len(found.url_not_text), total)} ({uri}); name the column that holds the image URLs",
            }
        )
    if found.no_caption:
        out.append(_column_problem("dataset.caption_column", dataset.caption_column, found.no_caption, total))
    out += _filter_problems(found)
    if found.empty:
        count = len(found.empty)
        out.append(
            {
                "field": source_field,
                "message": f"{_of(count, total)} {_verb(count, 'has', 'have')} no rows ({_shown(found.empty, count)}); "
                "there is nothing to download from them: remove them",
            }
        )
    return out


def check_parquet_objects(
    uris: list[str], dataset: Dataset, source_field: str, tolerated_percent: float
) -> ParquetCheck:
    """DatasetNotFound when objects are missing; InvalidRunDocument when more objects cannot be
    downloaded than the run tolerates (or all of them). Returns the problems it tolerated and the sum of
    the usable objects' rows (num_rows of the footers it read anyway)."""
    found = inspect(uris, dataset)
    if found.missing:
        count = len(found.missing)
        problem = {
            "field": source_field,
            "message": f"{count} of {len(uris)} objects do not exist or are not readable: "
            f"{_shown(found.missing, count)}; upload them or remove them from the list",
        }
        raise DatasetNotFound(json.dumps([problem]))
    found_problems = problems(found, dataset, source_field)
    unusable = found.unusable()
    share = 100.0 * unusable / found.total if found.total else 0.0
    if unusable == found.total and found_problems:
        raise invalid(found_problems)
    if share > tolerated_percent:
        tolerance = {
            "field": "download.tolerated_failure_percent",
            "message": f"{unusable} of {found.total} objects ({share:.1f}%) cannot be downloaded, more than the "
            f"{tolerated_percent:g}% this run tolerates; fix or remove them (or raise the percentage)",
        }
        raise invalid([*found_problems, tolerance])
    return ParquetCheck(warnings=found_problems, rows=found.usable_rows())
