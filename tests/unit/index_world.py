"""The index builder's world for the unit tests: a run's config and its shards' _SUCCESS markers, as
validate_run and the download job write them (shared by test_build_index*.py)."""

from __future__ import annotations

from typing import Any

from sdflow_common.run_document import parse_run_document
from sdflow_common.sagemaker_jobs import task_timeouts
from sdflow_common.validate_run import RunConfig, shard_items
from tests.constants import ACCOUNT, REGION
from tests.unit.helpers import DATA_BUCKET, AwsWorld

RUN_ID = "demo-0123456789abcdef"
EARLIER_RUN = "demo-fedcba9876543210"
CONTRACT_SUMMARY_KEYS = {
    "index_uri", "manifest_uri", "total_samples", "shards_ok", "shards_empty", "shards_failed", "failed_shards",
    "holdout_samples", "holdout_manifest_uri", "curation",
}  # fmt: skip


def make_config(world: AwsWorld, shard_count: int, tolerated: float = 10.0, holdout_rate: float = 0.0) -> RunConfig:
    """A run whose shards.json lists `shard_count` shards (as validate_run writes it)."""
    uris = [f"s3://{DATA_BUCKET}/datasets/part-{i:05d}.parquet" for i in range(shard_count)]
    document = parse_run_document(
        {
            "dataset": {"prefix": f"s3://{DATA_BUCKET}/datasets/"},
            "base_model_uri": f"s3://{DATA_BUCKET}/models/sd/",
            "download": {"tolerated_failure_percent": tolerated, "image_size": 64},
            "training": {"resolution": 64},
        }
    )
    shard_list_key = f"runs/{RUN_ID}/shards.json"
    world.put_json(shard_list_key, shard_items(uris, DATA_BUCKET, RUN_ID))
    return RunConfig(
        run_id=RUN_ID,
        execution_arn=f"arn:aws:states:{REGION}:{ACCOUNT}:execution:sm:{RUN_ID}",
        started_at="2025-06-02T09:15:43Z",
        bucket=DATA_BUCKET,
        shard_list_key=shard_list_key,
        shard_count=shard_count,
        dataset_prefix_uri=f"s3://{DATA_BUCKET}/runs/{RUN_ID}/dataset/",
        timeouts=task_timeouts(document),
        run=document,
        holdout_rate=holdout_rate,
    )


def finish_shard(
    world: AwsWorld,
    shard_id: str,
    samples: int = 10,
    tars: int = 1,
    with_id: bool = True,
    run_id: str = RUN_ID,
    held_out: dict[str, int] | None = None,
    counts: dict[str, Any] | None = None,
) -> None:
    """A shard's _SUCCESS; `held_out` (holdout tar -> samples) adds the split's fields, as the
    download job writes them since the held-out split (without it: a marker of an earlier version);
    `counts` adds the filters' and hashes' fields (rows_read, filter_drops, ..., hashes_file)."""
    success: dict[str, Any] = {
        "samples": samples,
        "failed": 2,
        "tar_files": [f"{i:05d}.tar" for i in range(tars)],
        "url_col": "URL",
        "caption_col": "TEXT",
        "image_size": 64,
        "duration_s": 1.5,
    }
    if with_id:
        success["shard_id"] = shard_id
    if held_out is not None:
        success |= {
            "holdout_rate": 0.1,
            "holdout_samples": sum(held_out.values()),
            "holdout_tar_files": [name for name, count in held_out.items() if count],
        }
    world.put_json(f"runs/{run_id}/dataset/shards/{shard_id}/_SUCCESS", success | (counts or {}))


def index_of(world: AwsWorld) -> dict[str, Any]:
    return world.get_json(f"runs/{RUN_ID}/dataset/index.json")


def manifest_of(world: AwsWorld) -> list[Any]:
    manifest: list[Any] = world.get_json(f"runs/{RUN_ID}/dataset/manifest.json")
    return manifest


def holdout_manifest_written(world: AwsWorld) -> bool:
    listing = world.s3.list_objects_v2(Bucket=DATA_BUCKET, Prefix=f"runs/{RUN_ID}/dataset/holdout.json")
    return bool(listing.get("KeyCount"))
