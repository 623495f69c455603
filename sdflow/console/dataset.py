"""The run's data as the console shows it: Build dataset index's `$.dataset` (the run page's dataset panel)
and each shard's counts (the children page's columns): rows read, filtered, failed, duplicates, kept
(sdflow_common.curation; docs/contracts.md "The dataset index").

A shard's counts come from its `_SUCCESS` while the run downloads; once Build dataset index wrote
index.json, from its entry there, which adds the duplicates the dedup job found. A count nobody made
(an older shard, a run that did not deduplicate) is null, shown as "—", never 0."""

from __future__ import annotations

import json
from typing import Any

from sdflow import history
from sdflow_common import curation

# What the dataset panel needs of `$.dataset` (failed_shards' URIs stay in the state's output tab).
DATASET_FIELDS = ("index_uri", "total_samples", "shards_ok", "shards_empty", "shards_failed", "holdout_samples")


def dataset_output(read: history.ExecutionHistory) -> dict[str, Any] | None:
    """`$.dataset` as the newest state that carries it left it (Build dataset index writes it)."""
    found = None
    for run in read.states.values():
        output = history.decode(run.output) if run.output else None
        dataset = output.get("dataset") if isinstance(output, dict) else None
        if isinstance(dataset, dict):
            found = dataset
    return found


def dataset_view(read: history.ExecutionHistory) -> dict[str, Any] | None:
    """The run page's dataset panel: shard totals and the run's curation block (null until indexed)."""
    dataset = dataset_output(read)
    if dataset is None:
        return None
    found = dataset.get("curation")
    view: dict[str, Any] = {name: dataset.get(name) for name in DATASET_FIELDS}
    view["curation"] = found if isinstance(found, dict) else None
    return view


def shards_empty(read: history.ExecutionHistory) -> int:
    """Build dataset index's count of shards whose job succeeded with no image (0 when not known)."""
    dataset = dataset_output(read) or {}
    empty = dataset.get("shards_empty")
    return empty if isinstance(empty, int) and empty > 0 else 0


def success_counts(record: dict[str, Any], shard_id: str | None) -> dict[str, Any]:
    """A shard's counts from its `_SUCCESS` alone: duplicates unknown until the index adds them."""
    return curation.shard_counts(record, None, shard_id or "")


def index_counts(s3: Any, bucket: str, run_name: str) -> tuple[dict[str, dict[str, Any]], bool]:
    """Each indexed shard's counts by shard id from `runs/<run>/dataset/index.json`, and whether the index
    exists (absent: the run has not reached Build dataset index)."""
    try:
        body = s3.get_object(Bucket=bucket, Key=f"runs/{run_name}/dataset/index.json")["Body"].read()
    except s3.exceptions.NoSuchKey:
        return {}, False
    try:
        index = json.loads(body)
    except ValueError:
        return {}, True
    shards = index.get("shards") if isinstance(index, dict) else None
    counts = {
        str(shard["shard_id"]): shard["counts"]
        for shard in shards or []
        if isinstance(shard, dict) and isinstance(shard.get("counts"), dict) and "shard_id" in shard
    }
    return counts, True
