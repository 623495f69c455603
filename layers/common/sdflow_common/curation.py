"""What was kept and why: the data card of a run (docs/contracts.md "The dataset index", `curation`).

Every shard's download job counts, in its `_SUCCESS`, the parquet rows it read, the rows each filter of
`dataset.filters` dropped (a row under its first failing filter), the rows left to download, and what
failed to download or resize; the dedup job's `summary.json` counts, per shard, the training samples
dropped as URL or image duplicates. Build dataset index puts them together here: per shard
(`shard_counts`), summed over the run (`sum_counts`), and written as lines (`data_lines`, the notification
and `sdflow status`), a CustomerMetadataValue (`metadata_text`) and a sentence (`description_text`).

A count nobody made stays None, never 0: a shard reused from a run made before the filters (an older
`_SUCCESS` without `rows_read`) has unknown rows read, and a run that did not deduplicate has unknown
duplicates. A total over shards is unknown as soon as one shard's count is."""

from __future__ import annotations

import json
from typing import Any

from botocore.exceptions import ClientError

from sdflow_common import aws
from sdflow_common.errors import SdflowError
from sdflow_common.run_document import parse_s3_uri

# The filters in the order the download job tries them (a row counts under its first failing filter):
# the field names of `dataset.filters` (docs/contracts.md "Dataset filters").
FILTER_ORDER = (
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
COUNT_FIELDS = (
    "rows_read",
    "filter_drops",
    "rows_to_download",
    "failed_to_download",
    "failed_to_resize",
    "holdout",
    "url_duplicates",
    "image_duplicates",
    "kept",
)
SUMMARY_VERSION = 1


class DedupSummaryMissing(SdflowError):
    """The dedup job completed, but its summary.json is missing or unreadable."""


def run_filters(run: Any) -> dict[str, Any]:
    """The run document's `dataset.filters` that are set (its `columns` included); {} when it sets none."""
    filters = getattr(run.dataset, "filters", None)
    return filters.model_dump(mode="json", exclude_none=True) if filters is not None else {}


def _count(value: Any) -> int | None:
    """A count as the job wrote it; None for absent, null or not a whole number ≥ 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or value != int(value):
        return None
    return int(value)


def _filter_drops(value: Any) -> dict[str, int] | None:
    if not isinstance(value, dict):
        return None
    drops = {str(name): _count(n) for name, n in value.items()}
    if any(n is None for n in drops.values()):
        return None
    return {name: int(n or 0) for name, n in sorted(drops.items(), key=lambda item: _filter_rank(item[0]))}


def _filter_rank(name: str) -> tuple[int, str]:
    return (FILTER_ORDER.index(name) if name in FILTER_ORDER else len(FILTER_ORDER), name)


def read_summary(uri: str) -> dict[str, Any]:
    """The dedup job's summary.json (docs/contracts.md "The dedup job"); DedupSummaryMissing when the job,
    which writes it last, left none (or one that is not a summary)."""
    bucket, key = parse_s3_uri(uri)
    try:
        body = aws.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code not in ("NoSuchKey", "404"):
            raise  # throttling or permissions: the task's Retry sees it
        raise DedupSummaryMissing(
            f"the dedup job completed without writing its summary {uri} ($.dedup.summary_uri); it writes "
            "the summary last, so it stopped early: see the dedup job's log, then redrive the run"
        ) from None
    try:
        summary = json.loads(body)
        if not isinstance(summary, dict) or not isinstance(summary.get("shards"), dict):
            raise ValueError("no `shards` object")
    except ValueError as exc:
        raise DedupSummaryMissing(
            f"the dedup job's summary {uri} is not a summary ({exc}); see the dedup job's log, then redrive the run"
        ) from None
    return summary


def shard_counts(success: dict[str, Any], dedup: dict[str, Any] | None, shard_id: str) -> dict[str, Any]:
    """One shard's counts from its `_SUCCESS` and, when the run deduplicated, the dedup summary (None: it
    did not). `kept` is the training samples less the duplicates dropped: what trains."""
    samples = _count(success.get("samples")) or 0
    url_dup: int | None = None
    image_dup: int | None = None
    if dedup is not None:
        entry = dedup.get("shards", {}).get(shard_id)
        unhashed = shard_id in (dedup.get("unhashed_shards") or [])
        if isinstance(entry, dict):
            url_dup, image_dup = _count(entry.get("url_duplicates")), _count(entry.get("image_duplicates"))
        elif not unhashed and success.get("hashes_file"):
            url_dup, image_dup = 0, 0  # hashed, and the summary lists no drop for it
    removed = (url_dup or 0) + (image_dup or 0)
    return {
        "rows_read": _count(success.get("rows_read")),
        "filter_drops": _filter_drops(success.get("filter_drops")),
        "rows_to_download": _count(success.get("rows_to_download")),
        "failed_to_download": _count(success.get("failed_to_download")),
        "failed_to_resize": _count(success.get("failed_to_resize")),
        # A shard downloaded before the held-out split has no held-out field: it holds none.
        "holdout": _count(success.get("holdout_samples", 0)),
        "url_duplicates": url_dup,
        "image_duplicates": image_dup,
        "kept": max(0, samples - removed),
    }


def dropped_file(dedup: dict[str, Any] | None, summary_uri: str | None, shard_id: str) -> str | None:
    """`s3://…/dedup/dropped/<id>.json` of a shard with drops (the summary names it relative to its folder)."""
    if dedup is None or summary_uri is None:
        return None
    entry = dedup.get("shards", {}).get(shard_id)
    name = entry.get("dropped_file") if isinstance(entry, dict) else None
    if not isinstance(name, str) or not name:
        return None
    return f"{summary_uri.rsplit('/', 1)[0]}/{name}"


def _add(total: Any, value: Any) -> Any:
    if total is None or value is None:
        return None
    if isinstance(total, dict):
        return {name: total.get(name, 0) + value.get(name, 0) for name in sorted({*total, *value}, key=_filter_rank)}
    return total + value


def sum_counts(counts: list[dict[str, Any]]) -> dict[str, Any]:
    """The shards' counts summed field by field; a field unknown for one shard is unknown in the total."""
    total: dict[str, Any] = {"filter_drops": {}} | {name: 0 for name in COUNT_FIELDS if name != "filter_drops"}
    for shard in counts:
        total = {name: _add(total[name], shard.get(name)) for name in COUNT_FIELDS}
    return total


def state_block(curation: dict[str, Any]) -> dict[str, Any]:
    """`$.dataset.curation`: the run's totals without the filters' settings (the run document has them)."""
    return {name: curation.get(name) for name in (*COUNT_FIELDS, "deduplicated", "unhashed_shards")}


def nothing_kept_reason(done: int, total: int, counts: dict[str, Any] | None) -> str:
    """Why the shards that downloaded hold no training sample (Build dataset index refuses the run): the
    filters, the duplicates, or the URLs. `counts` is index.json's `curation`."""
    counts = counts or {}
    read, drops = counts.get("rows_read"), counts.get("filter_drops")
    prefix = f"{done} of {total} shards downloaded but hold 0 samples to train on: "
    if isinstance(read, int) and read > 0 and isinstance(drops, dict) and sum(drops.values()) >= read:
        each = ", ".join(f"{name} dropped {n:,}" for name, n in drops.items() if n)
        return (
            f"{prefix}dataset.filters dropped every one of the {read:,} rows read ({each}); "
            f"loosen or remove those filters in dataset.filters ({', '.join(n for n, v in drops.items() if v)})"
        )
    duplicates = (counts.get("url_duplicates") or 0) + (counts.get("image_duplicates") or 0)
    if duplicates:
        return (
            f"{prefix}the {duplicates:,} downloaded training samples were all duplicates of others (url or "
            "image, kept in the held-out split or an earlier shard); add data, or set deduplication.enabled false"
        )
    held = counts.get("holdout") or 0
    if held:
        return (
            f"{prefix}the {held:,} samples that downloaded were all held out for the evaluation; add data, or "
            "lower evaluation.holdout_samples"
        )
    filtered = (
        f" (dataset.filters dropped {sum(drops.values()):,} rows first)" if isinstance(drops, dict) and drops else ""
    )
    return f"{prefix}no image URL could be fetched{filtered}; check dataset.url_column and that the URLs are reachable"


# ---------------------------------------------------------------- shown


def _n(value: int) -> str:
    return f"{value:,}"


def _percent(value: int, base: int | None) -> str:
    return f" ({100.0 * value / base:.1f}%)" if base else ""


def _failed(curation: dict[str, Any]) -> int | None:
    download, resize = curation.get("failed_to_download"), curation.get("failed_to_resize")
    return None if download is None and resize is None else (download or 0) + (resize or 0)


def _duplicates_text(curation: dict[str, Any], base: int | None) -> str:
    url, image = curation.get("url_duplicates"), curation.get("image_duplicates")
    if url is None or image is None:
        if not curation.get("deduplicated"):
            return "duplicates not checked (deduplication off)"
        return f"duplicates unknown ({curation.get('unhashed_shards') or 0} shards without hashes)"
    return f"{_n(url + image)} duplicates{_percent(url + image, base)}: {_n(url)} url, {_n(image)} image"


def _filter_label(name: str, filters: dict[str, Any] | None) -> str:
    bound = (filters or {}).get(name)
    return f"{name}={bound:g}" if isinstance(bound, int | float) and not isinstance(bound, bool) else name


def data_lines(curation: dict[str, Any] | None, filters: dict[str, Any] | None = None) -> list[str]:
    """The funnel in words, one stage a line: rows read, dropped by each filter (with its setting when
    `filters` is given), failed, held out, duplicates, kept; each with its share of the rows read (when
    known). [] without counts."""
    if not isinstance(curation, dict) or not isinstance(curation.get("kept"), int):
        return []
    read = curation.get("rows_read")
    lines = [f"{_n(read)} rows read" if isinstance(read, int) else "rows read unknown (shards from before the counts)"]
    drops = curation.get("filter_drops")
    if isinstance(drops, dict) and drops:
        filtered = sum(drops.values())
        each = ", ".join(f"{_n(n)} by {_filter_label(name, filters)}" for name, n in drops.items())
        lines.append(f"{_n(filtered)} filtered{_percent(filtered, read)}: {each}")
    elif isinstance(read, int):
        lines.append("0 filtered (no filter set)" if drops == {} else "filtered unknown")
    failed = _failed(curation)
    if failed is not None:
        resize = curation.get("failed_to_resize") or 0
        if resize:
            each = f"{_n(failed - resize)} to download, {_n(resize)} to resize"
            lines.append(f"{_n(failed)} failed{_percent(failed, read)}: {each}")
        else:
            lines.append(f"{_n(failed)} failed to download{_percent(failed, read)}")
    holdout = curation.get("holdout")
    if holdout:
        lines.append(f"{_n(holdout)} held out for evaluation{_percent(holdout, read)}")
    lines.append(_duplicates_text(curation, read))
    lines.append(f"{_n(curation['kept'])} kept for training{_percent(curation['kept'], read)}")
    return lines


def _metadata_count(value: Any) -> str:
    return str(value) if isinstance(value, int) else "unknown"


def metadata_text(curation: dict[str, Any] | None) -> str:
    """`read=1000 filtered=120 failed=30 holdout=50 url_dup=8 image_dup=4 kept=788 min_width=80 ...`: letters,
    digits, spaces and `_=` only (CustomerMetadataValue's pattern); the per-filter drops last, so the
    256-character cut (model_registry.metadata_value) takes them first. "" without counts."""
    if not isinstance(curation, dict) or not isinstance(curation.get("kept"), int):
        return ""
    drops = curation.get("filter_drops")
    deduplicated = curation.get("deduplicated")
    values = {
        "read": _metadata_count(curation.get("rows_read")),
        "filtered": _metadata_count(sum(drops.values()) if isinstance(drops, dict) else None),
        "failed": _metadata_count(_failed(curation)),
        "holdout": _metadata_count(curation.get("holdout")),
        "url_dup": _metadata_count(curation.get("url_duplicates")) if deduplicated else "unchecked",
        "image_dup": _metadata_count(curation.get("image_duplicates")) if deduplicated else "unchecked",
        "kept": str(curation["kept"]),
    }
    parts = [f"{name}={value}" for name, value in values.items()]
    parts.extend(f"{name}={n}" for name, n in (drops or {}).items())
    return " ".join(parts)


def description_text(curation: dict[str, Any] | None, filters: dict[str, Any] | None = None) -> str:
    """One sentence for the model package's description: the funnel, with each filter's setting."""
    lines = data_lines(curation, filters)
    return "Data: " + "; ".join(lines) + "." if lines else ""
