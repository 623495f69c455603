"""The "Build dataset index" task: collect each shard's `_SUCCESS`, write `dataset/index.json`,
and decide whether enough shards succeeded to train.

The Distributed Map lets every iteration fail on its own and keeps no results (its result would
grow with the number of shards), so this task is where the run's tolerated failure percentage is
applied: a shard counts as done exactly when its download job wrote `_SUCCESS`, which it does last.

It also writes `dataset/manifest.json`, the training job's `dataset` channel (sdflow_common.dataset_manifest):
a resumed run's reused shards stay in the earlier run's folder, and the manifest lists them next to
this run's own, so every tar path is relative to `s3://<bucket>/runs/`.

The held-out samples (the download job's `holdout/NNNNN.tar`, docs/contracts.md "The download job")
are recorded apart: index.json's `holdout` block, which the training reader never reads (it reads
`shards[*].tar_files` only), and `dataset/holdout.json`, the evaluation's manifest of them. A reused
shard of a run made before the split has no held-out fields in its `_SUCCESS`: it holds none.

What was kept and why (sdflow_common.curation): each shard's counts (rows read, dropped by each filter,
failed, held out, duplicates, kept) and the run's totals (`curation`); with `$.dedup` (the dedup job ran)
its summary.json's duplicates, and each shard's list of dropped keys (`dropped_file`, in the manifest
too, so the training reader skips them). A shard's `samples` and `total_samples` are the kept samples."""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError
from pydantic import BaseModel, ConfigDict, Field

from sdflow_common import aws, curation, dataset_manifest
from sdflow_common.dataset_manifest import OutsideRunsFolder
from sdflow_common.errors import NoUsableShards
from sdflow_common.run_config import RunConfig
from sdflow_common.run_document import parse_s3_uri

log = logging.getLogger(__name__)

SUCCESS_MARKER = "_SUCCESS"
INDEX_VERSION = 1
# Thousands of shards means thousands of GETs; 16 in flight finishes 10,000 in well under a minute.
READ_WORKERS = 16
# `$.dataset` must stay small whatever the shard count (Step Functions' 256 KB state limit).
FAILED_SHARDS_IN_SUMMARY = 20
FAILED_IDS_IN_MESSAGE = 10


class DedupResult(BaseModel):
    """`$.dedup`: the Find duplicates task's output (docs/contracts.md "The dedup job")."""

    model_config = ConfigDict(extra="ignore")

    summary_uri: str = Field(min_length=6, pattern=r"^s3://")


class BuildIndexRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    config: RunConfig
    # Absent (or null) when the run did not deduplicate (deduplication.enabled false, or a run from before).
    dedup: DedupResult | None = None


@dataclass(frozen=True)
class ShardResult:
    shard_id: str
    parquet_uri: str
    output_uri: str
    success: dict[str, Any] | None
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.success is not None


def _read_success(item: dict[str, str]) -> ShardResult:
    shard_id, parquet_uri, output_uri = item["shard_id"], item["parquet_uri"], item["output_uri"]
    bucket, key = parse_s3_uri(output_uri)
    marker_key = f"{key.rstrip('/')}/{SUCCESS_MARKER}"
    try:
        body = aws.client("s3").get_object(Bucket=bucket, Key=marker_key)["Body"].read()
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("NoSuchKey", "404"):
            return ShardResult(shard_id, parquet_uri, output_uri, None, "no _SUCCESS (download job failed)")
        raise  # throttling or permissions: the task's Retry should see it, not a silently failed shard
    try:
        success = json.loads(body)
        if not isinstance(success, dict):
            raise ValueError("not a JSON object")
        samples = int(success.get("samples", 0))
        tar_files = success.get("tar_files", [])
        if samples < 0 or not isinstance(tar_files, list):
            raise ValueError("samples must be ≥ 0 and tar_files a list")
        held_out = int(success.get("holdout_samples", 0))
        if held_out < 0 or not isinstance(success.get("holdout_tar_files", []), list):
            raise ValueError("holdout_samples must be ≥ 0 and holdout_tar_files a list")
    except (TypeError, ValueError) as exc:  # TypeError: int(None), a count that is null
        # A corrupt marker is the shard's own failure; the run tolerates it like any other.
        log.warning("shard %s: unreadable %s (%s); counted as failed", shard_id, marker_key, exc)
        return ShardResult(shard_id, parquet_uri, output_uri, None, f"corrupt _SUCCESS: {exc}")
    return ShardResult(shard_id, parquet_uri, output_uri, success)


def read_shard_results(items: list[dict[str, str]]) -> list[ShardResult]:
    aws.client("s3")  # create the cached client before the threads share it (clients are thread-safe)
    with ThreadPoolExecutor(max_workers=READ_WORKERS) as pool:
        return list(pool.map(_read_success, items))


def _relative_folder(result: ShardResult, bucket: str) -> str:
    """`<run>/dataset/shards/00003/`: the shard folder relative to the manifest's prefix (`runs/`), which
    is where SageMaker puts it in the dataset channel. A reused shard's folder is an earlier run's."""
    folder = result.output_uri if result.output_uri.endswith("/") else f"{result.output_uri}/"
    try:
        return dataset_manifest.channel_key(folder, bucket)
    except OutsideRunsFolder as exc:
        raise OutsideRunsFolder(
            f"shard {result.shard_id}: output_uri {exc}. Its shards.json entry must point at a shard folder "
            f"s3://{bucket}/runs/<execution>/dataset/shards/<shard id>/ (validate_run and resume write only such)"
        ) from None


def _holdout_block(config: RunConfig, results: list[ShardResult]) -> dict[str, Any]:
    """`{"rate", "samples", "tar_files"}`: every usable shard's held-out tars, relative to `runs/`.
    An old `_SUCCESS` (a reused shard downloaded before the split existed) counts 0."""
    samples = 0
    tar_files: list[str] = []
    for result in results:
        if result.success is None or not int(result.success.get("holdout_samples", 0)):
            continue
        folder = _relative_folder(result, config.bucket)
        samples += int(result.success["holdout_samples"])
        tar_files.extend(folder + str(name) for name in result.success.get("holdout_tar_files", []))
    return {"rate": config.holdout_rate, "samples": samples, "tar_files": tar_files}


def _shard_entry(
    config: RunConfig, result: ShardResult, dedup: dict[str, Any] | None, summary_uri: str | None
) -> dict[str, Any]:
    """The shard's index entry (its tars and counts); `samples` is what trains: the kept samples."""
    assert result.success is not None
    counts = curation.shard_counts(result.success, dedup, result.shard_id)
    folder = _relative_folder(result, config.bucket)
    entry: dict[str, Any] = {
        "shard_id": result.shard_id,
        "tar_files": [folder + str(name) for name in result.success.get("tar_files", [])],
        "samples": counts["kept"],
        "counts": counts,
    }
    dropped = curation.dropped_file(dedup, summary_uri, result.shard_id)
    if dropped:
        entry["dropped_file"] = dataset_manifest.channel_key(dropped, config.bucket)
    return entry


def build_index_document(
    config: RunConfig,
    results: list[ShardResult],
    dedup: dict[str, Any] | None = None,
    summary_uri: str | None = None,
) -> dict[str, Any]:
    """index.json; `dedup` is the dedup job's summary.json (None: the run did not deduplicate)."""
    entries = [_shard_entry(config, result, dedup, summary_uri) for result in results if result.success is not None]
    image_size = next(
        (int(r.success["image_size"]) for r in results if r.success and r.success.get("image_size")), None
    )
    # A shard with nothing left to train on (every URL failed, every row filtered, held out or a duplicate)
    # is counted in `curation` but not listed.
    shards = [entry for entry in entries if entry["samples"] > 0 and entry["tar_files"]]
    totals = curation.sum_counts([entry["counts"] for entry in entries])
    return {
        "version": INDEX_VERSION,
        "run_id": config.run_id,
        "total_samples": sum(shard["samples"] for shard in shards),
        "shards": shards,
        "failed_shards": [
            {"shard_id": r.shard_id, "parquet_uri": r.parquet_uri, "reason": r.reason} for r in results if not r.ok
        ],
        "image_size": image_size or config.run.download.image_size,
        "holdout": _holdout_block(config, results),
        "curation": totals
        | {
            "filters": curation.run_filters(config.run),
            "deduplicated": dedup is not None,
            # Derived from the shards' own counts, so the figure and the unknown duplicates it explains agree
            # (a shard without hashes that the summary does not list is unknown too).
            "unhashed_shards": sum(entry["counts"]["url_duplicates"] is None for entry in entries)
            if dedup is not None
            else 0,
        },
    }


def check_tolerance(
    results: list[ShardResult], tolerated_percent: float, total_samples: int, counts: dict[str, Any] | None = None
) -> None:
    """NoUsableShards when every shard failed, more than the run tolerates did, or nothing is left to
    train on (`counts`, index.json's `curation`, says whether the filters, duplicates or URLs did it)."""
    total = len(results)
    failed = [r.shard_id for r in results if not r.ok]
    failed_percent = 100.0 * len(failed) / total if total else 100.0
    first = ", ".join(failed[:FAILED_IDS_IN_MESSAGE]) + (" …" if len(failed) > FAILED_IDS_IN_MESSAGE else "")
    if len(failed) == total:
        raise NoUsableShards(
            f"all {total} shards failed to download (first: {first}); see each shard's processing job "
            "logs, check that the parquet files' URL column is right and the URLs are reachable"
        )
    if failed_percent > tolerated_percent:
        raise NoUsableShards(
            f"{len(failed)} of {total} shards failed ({failed_percent:.1f}%), more than "
            f"download.tolerated_failure_percent={tolerated_percent:g}; first failed shard ids: {first}. "
            "Rerun, or raise download.tolerated_failure_percent to train on the rest"
        )
    if total_samples == 0:
        raise NoUsableShards(curation.nothing_kept_reason(total - len(failed), total, counts))


def _put_manifest(config: RunConfig, uri: str, keys: list[str]) -> str:
    bucket, key = parse_s3_uri(uri)
    body = json.dumps(dataset_manifest.manifest_document(config.bucket, keys)).encode()
    aws.client("s3").put_object(Bucket=bucket, Key=key, Body=body, ContentType="application/json")
    return uri


def write_manifest(config: RunConfig, index: dict[str, Any]) -> str:
    """`runs/<run>/dataset/manifest.json`: index.json first, then every tar file of every usable shard."""
    keys = [dataset_manifest.index_in_channel(config.dataset_prefix_uri, config.bucket)]
    keys.extend(name for shard in index["shards"] for name in shard["tar_files"])
    # Each shard's dropped keys: the training reader skips them (docs/contracts.md "The dataset index").
    keys.extend(shard["dropped_file"] for shard in index["shards"] if shard.get("dropped_file"))
    return _put_manifest(config, dataset_manifest.manifest_uri(config.dataset_prefix_uri), keys)


def write_holdout_manifest(config: RunConfig, index: dict[str, Any]) -> str | None:
    """`runs/<run>/dataset/holdout.json`, the evaluation's ManifestFile input: every held-out tar.
    None, and nothing written, when the run holds no sample out."""
    if not index["holdout"]["samples"]:
        return None
    uri = dataset_manifest.holdout_manifest_uri(config.dataset_prefix_uri)
    return _put_manifest(config, uri, list(index["holdout"]["tar_files"]))


def build_index(request: BuildIndexRequest) -> dict[str, Any]:
    """Write `runs/<exec>/dataset/index.json`; return the `$.dataset` summary (docs/contracts.md)."""
    config = request.config
    s3 = aws.client("s3")
    items = json.loads(s3.get_object(Bucket=config.bucket, Key=config.shard_list_key)["Body"].read())
    results = read_shard_results(items)
    summary_uri = request.dedup.summary_uri if request.dedup else None
    dedup = curation.read_summary(summary_uri) if summary_uri else None
    index = build_index_document(config, results, dedup, summary_uri)
    index_bucket, index_key = parse_s3_uri(dataset_manifest.index_uri(config.dataset_prefix_uri))
    # Written before the tolerance check, so a failed run still leaves a record of which shards failed.
    s3.put_object(Bucket=index_bucket, Key=index_key, Body=json.dumps(index).encode(), ContentType="application/json")
    manifest_uri = write_manifest(config, index)
    holdout_manifest_uri = write_holdout_manifest(config, index)
    failed = index["failed_shards"]
    log.info(
        "run %s: %d shards ok, %d failed, %d samples, %d held out",
        config.run_id,
        len(results) - len(failed),
        len(failed),
        index["total_samples"],
        index["holdout"]["samples"],
    )
    check_tolerance(results, config.run.download.tolerated_failure_percent, index["total_samples"], index["curation"])
    return {
        "index_uri": f"s3://{index_bucket}/{index_key}",
        "manifest_uri": manifest_uri,
        "total_samples": index["total_samples"],
        "shards_ok": len(results) - len(failed),
        # Of shards_ok, those whose job succeeded with no image (every URL failed): not downloaded,
        # as `sdflow status` counts them (the index lists only shards with samples).
        "shards_empty": len(results) - len(failed) - len(index["shards"]),
        "shards_failed": len(failed),
        "failed_shards": [
            {"shard_id": f["shard_id"], "parquet_uri": f["parquet_uri"]} for f in failed[:FAILED_SHARDS_IN_SUMMARY]
        ],
        # The evaluation's held-out samples (its ManifestFile input); None when the run holds none out.
        "holdout_samples": index["holdout"]["samples"],
        "holdout_manifest_uri": holdout_manifest_uri,
        # The run's totals of what was kept and why (never per shard: the state stays small).
        "curation": curation.state_block(index["curation"]),
    }
