"""build_index: the dataset index from each shard's _SUCCESS, and the run's failure tolerance."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sdflow_common.build_index import FAILED_SHARDS_IN_SUMMARY, BuildIndexRequest, build_index
from sdflow_common.dataset_manifest import OutsideRunsFolder
from sdflow_common.errors import NoUsableShards
from sdflow_common.validate_run import ValidateRunRequest, validate_run
from tests.constants import ACCOUNT, REGION
from tests.helpers import load_function_module
from tests.unit.helpers import DATA_BUCKET, AwsWorld, FakeLambdaContext
from tests.unit.index_world import (
    CONTRACT_SUMMARY_KEYS,
    EARLIER_RUN,
    RUN_ID,
    finish_shard,
    holdout_manifest_written,
    index_of,
    make_config,
    manifest_of,
)
from tests.unit.parquet_files import parquet_bytes


def test_build_index_all_shards_ok_writes_contract_index(mocked_aws: AwsWorld) -> None:
    config = make_config(mocked_aws, 3)
    finish_shard(mocked_aws, "00000", samples=10, tars=2)
    finish_shard(mocked_aws, "00001", samples=7, with_id=False)
    finish_shard(mocked_aws, "00002", samples=5)

    summary = build_index(BuildIndexRequest(config=config))

    assert set(summary) == CONTRACT_SUMMARY_KEYS
    assert summary == {
        "index_uri": f"s3://{DATA_BUCKET}/runs/{RUN_ID}/dataset/index.json",
        "manifest_uri": f"s3://{DATA_BUCKET}/runs/{RUN_ID}/dataset/manifest.json",
        "total_samples": 22,
        "shards_ok": 3,
        "shards_empty": 0,
        "shards_failed": 0,
        "failed_shards": [],
        "holdout_samples": 0,
        "holdout_manifest_uri": None,
        # Markers without the filters' fields (older download jobs): rows read unknown, never 0.
        "curation": {
            "rows_read": None,
            "filter_drops": None,
            "rows_to_download": None,
            "failed_to_download": None,
            "failed_to_resize": None,
            "holdout": 0,
            "url_duplicates": None,
            "image_duplicates": None,
            "kept": 22,
            "deduplicated": False,
            "unhashed_shards": 0,
        },
    }
    index = index_of(mocked_aws)
    assert index["version"] == 1
    assert index["run_id"] == RUN_ID
    assert index["total_samples"] == 22
    assert index["image_size"] == 64
    assert index["failed_shards"] == []
    # Relative to the manifest's prefix s3://<bucket>/runs/: where SageMaker puts them in the channel.
    assert index["shards"][0] == {
        "shard_id": "00000",
        "tar_files": [f"{RUN_ID}/dataset/shards/00000/00000.tar", f"{RUN_ID}/dataset/shards/00000/00001.tar"],
        "samples": 10,
        "counts": {
            "rows_read": None,
            "filter_drops": None,
            "rows_to_download": None,
            "failed_to_download": None,
            "failed_to_resize": None,
            "holdout": 0,
            "url_duplicates": None,
            "image_duplicates": None,
            "kept": 10,
        },
    }
    assert [s["shard_id"] for s in index["shards"]] == ["00000", "00001", "00002"]
    assert index["holdout"] == {"rate": 0.0, "samples": 0, "tar_files": []}
    assert not holdout_manifest_written(mocked_aws)
    assert manifest_of(mocked_aws) == [
        {"prefix": f"s3://{DATA_BUCKET}/runs/"},
        f"{RUN_ID}/dataset/index.json",
        f"{RUN_ID}/dataset/shards/00000/00000.tar",
        f"{RUN_ID}/dataset/shards/00000/00001.tar",
        f"{RUN_ID}/dataset/shards/00001/00000.tar",
        f"{RUN_ID}/dataset/shards/00002/00000.tar",
    ]


def test_build_index_reused_shards_of_earlier_run_are_in_index_and_manifest(mocked_aws: AwsWorld) -> None:
    """A resumed run's shards.json points cached shards at the earlier run's folder (resume.py)."""
    config = make_config(mocked_aws, 3)
    items = mocked_aws.get_json(config.shard_list_key)
    for item in items[:2]:
        item["cached"] = True
        item["output_uri"] = f"s3://{DATA_BUCKET}/runs/{EARLIER_RUN}/dataset/shards/{item['shard_id']}/"
    mocked_aws.put_json(config.shard_list_key, items)
    finish_shard(mocked_aws, "00000", samples=4, run_id=EARLIER_RUN)
    finish_shard(mocked_aws, "00001", samples=0, tars=0, run_id=EARLIER_RUN)  # reused, but holds nothing
    finish_shard(mocked_aws, "00002", samples=5)
    mocked_aws.put_json(f"runs/{RUN_ID}/dataset/shards/00000/_SUCCESS", {"samples": 99, "tar_files": ["x.tar"]})

    summary = build_index(BuildIndexRequest(config=config))

    assert (summary["shards_ok"], summary["total_samples"]) == (3, 9)
    assert summary["shards_empty"] == 1  # 00001 succeeded with no image: not downloaded
    assert [s["tar_files"] for s in index_of(mocked_aws)["shards"]] == [
        [f"{EARLIER_RUN}/dataset/shards/00000/00000.tar"],
        [f"{RUN_ID}/dataset/shards/00002/00000.tar"],
    ]
    assert manifest_of(mocked_aws) == [
        {"prefix": f"s3://{DATA_BUCKET}/runs/"},
        f"{RUN_ID}/dataset/index.json",
        f"{EARLIER_RUN}/dataset/shards/00000/00000.tar",
        f"{RUN_ID}/dataset/shards/00002/00000.tar",
    ]


def test_build_index_held_out_samples_go_to_holdout_block_and_manifest_only(mocked_aws: AwsWorld) -> None:
    config = make_config(mocked_aws, 3, holdout_rate=0.1)
    finish_shard(mocked_aws, "00000", samples=18, tars=2, held_out={"holdout/00000.tar": 1, "holdout/00001.tar": 0})
    finish_shard(mocked_aws, "00001", samples=9, held_out={"holdout/00000.tar": 2})
    finish_shard(mocked_aws, "00002", samples=0, tars=1, held_out={"holdout/00000.tar": 3})  # every image held out

    summary = build_index(BuildIndexRequest(config=config))

    holdout_uri = f"s3://{DATA_BUCKET}/runs/{RUN_ID}/dataset/holdout.json"
    assert (summary["total_samples"], summary["holdout_samples"]) == (27, 6)
    assert summary["holdout_manifest_uri"] == holdout_uri
    assert summary["shards_empty"] == 1  # 00002: nothing left to train on
    held_tars = [
        f"{RUN_ID}/dataset/shards/00000/holdout/00000.tar",
        f"{RUN_ID}/dataset/shards/00001/holdout/00000.tar",
        f"{RUN_ID}/dataset/shards/00002/holdout/00000.tar",
    ]
    index = index_of(mocked_aws)
    assert index["holdout"] == {"rate": 0.1, "samples": 6, "tar_files": held_tars}
    assert mocked_aws.get_json(f"runs/{RUN_ID}/dataset/holdout.json") == [
        {"prefix": f"s3://{DATA_BUCKET}/runs/"},
        *held_tars,
    ]
    # what training reads (shards[*].tar_files, the dataset manifest) holds no held-out tar
    training_tars = [name for shard in index["shards"] for name in shard["tar_files"]]
    assert not any("/holdout/" in name for name in training_tars + manifest_of(mocked_aws)[1:])
    assert [s["samples"] for s in index["shards"]] == [18, 9]


def test_build_index_old_markers_without_holdout_fields_count_zero_held_out(mocked_aws: AwsWorld) -> None:
    """A resumed run reuses shards downloaded before the split: their _SUCCESS has no held-out fields."""
    config = make_config(mocked_aws, 2, holdout_rate=0.1)
    items = mocked_aws.get_json(config.shard_list_key)
    items[0] |= {"cached": True, "output_uri": f"s3://{DATA_BUCKET}/runs/{EARLIER_RUN}/dataset/shards/00000/"}
    mocked_aws.put_json(config.shard_list_key, items)
    finish_shard(mocked_aws, "00000", samples=10, run_id=EARLIER_RUN)  # old marker
    finish_shard(mocked_aws, "00001", samples=8, held_out={"holdout/00000.tar": 2})

    summary = build_index(BuildIndexRequest(config=config))

    assert (summary["shards_ok"], summary["total_samples"], summary["holdout_samples"]) == (2, 18, 2)
    assert index_of(mocked_aws)["holdout"]["tar_files"] == [f"{RUN_ID}/dataset/shards/00001/holdout/00000.tar"]


def test_build_index_only_old_markers_write_no_holdout_manifest(mocked_aws: AwsWorld) -> None:
    config = make_config(mocked_aws, 1, holdout_rate=0.1)
    finish_shard(mocked_aws, "00000", samples=10)

    summary = build_index(BuildIndexRequest(config=config))

    assert (summary["holdout_samples"], summary["holdout_manifest_uri"]) == (0, None)
    assert index_of(mocked_aws)["holdout"] == {"rate": 0.1, "samples": 0, "tar_files": []}
    assert not holdout_manifest_written(mocked_aws)


@pytest.mark.parametrize(
    "fields", [{"holdout_samples": -1}, {"holdout_samples": None}, {"holdout_tar_files": "holdout/00000.tar"}]
)
def test_build_index_malformed_holdout_fields_count_shard_as_failed(
    mocked_aws: AwsWorld, fields: dict[str, Any]
) -> None:
    config = make_config(mocked_aws, 2, tolerated=50)
    finish_shard(mocked_aws, "00000")
    marker = {"samples": 5, "tar_files": ["00000.tar"], "holdout_samples": 1, "holdout_tar_files": []} | fields
    mocked_aws.put_json(f"runs/{RUN_ID}/dataset/shards/00001/_SUCCESS", marker)

    summary = build_index(BuildIndexRequest(config=config))

    assert summary["shards_failed"] == 1
    assert index_of(mocked_aws)["failed_shards"][0]["reason"].startswith("corrupt _SUCCESS")


def test_build_index_shard_outside_runs_folder_raises_naming_shard(mocked_aws: AwsWorld) -> None:
    config = make_config(mocked_aws, 1)
    items = mocked_aws.get_json(config.shard_list_key)
    items[0]["output_uri"] = f"s3://{DATA_BUCKET}/elsewhere/00000/"
    mocked_aws.put_json(config.shard_list_key, items)
    mocked_aws.put_json("elsewhere/00000/_SUCCESS", {"samples": 3, "tar_files": ["00000.tar"]})

    with pytest.raises(OutsideRunsFolder) as caught:
        build_index(BuildIndexRequest(config=config))

    message = str(caught.value)
    assert message.startswith(f"shard 00000: output_uri s3://{DATA_BUCKET}/elsewhere/00000/ is not below s3://")
    assert f"s3://{DATA_BUCKET}/runs/<execution>/dataset/shards/<shard id>/" in message


def test_build_index_failures_within_tolerance_train_on_the_rest(mocked_aws: AwsWorld) -> None:
    config = make_config(mocked_aws, 10, tolerated=10)
    for i in range(10):
        if i != 4:
            finish_shard(mocked_aws, f"{i:05d}")

    summary = build_index(BuildIndexRequest(config=config))

    assert summary["shards_ok"] == 9
    assert summary["shards_failed"] == 1
    assert summary["total_samples"] == 90
    assert summary["failed_shards"] == [
        {"shard_id": "00004", "parquet_uri": f"s3://{DATA_BUCKET}/datasets/part-00004.parquet"}
    ]
    index = index_of(mocked_aws)
    assert [f["shard_id"] for f in index["failed_shards"]] == ["00004"]
    assert "00004" not in {s["shard_id"] for s in index["shards"]}


def test_build_index_failures_beyond_tolerance_raise_with_counts_and_ids(mocked_aws: AwsWorld) -> None:
    config = make_config(mocked_aws, 10, tolerated=10)
    for i in range(10):
        if i not in (3, 7):
            finish_shard(mocked_aws, f"{i:05d}")

    with pytest.raises(NoUsableShards) as caught:
        build_index(BuildIndexRequest(config=config))

    message = str(caught.value)
    assert "2 of 10 shards failed (20.0%)" in message
    assert "tolerated_failure_percent=10" in message
    assert "00003, 00007" in message
    # The index is still written, so the failed shards can be inspected.
    assert [f["shard_id"] for f in index_of(mocked_aws)["failed_shards"]] == ["00003", "00007"]


def test_build_index_all_shards_failed_raise_even_at_full_tolerance(mocked_aws: AwsWorld) -> None:
    config = make_config(mocked_aws, 4, tolerated=100)
    with pytest.raises(NoUsableShards, match="all 4 shards failed"):
        build_index(BuildIndexRequest(config=config))


def test_build_index_zero_samples_raise(mocked_aws: AwsWorld) -> None:
    config = make_config(mocked_aws, 2)
    finish_shard(mocked_aws, "00000", samples=0, tars=0)
    finish_shard(mocked_aws, "00001", samples=0)
    with pytest.raises(NoUsableShards, match="0 samples"):
        build_index(BuildIndexRequest(config=config))


def test_build_index_corrupt_success_marker_counts_as_failed(mocked_aws: AwsWorld) -> None:
    config = make_config(mocked_aws, 2, tolerated=50)
    finish_shard(mocked_aws, "00000")
    mocked_aws.s3.put_object(Bucket=DATA_BUCKET, Key=f"runs/{RUN_ID}/dataset/shards/00001/_SUCCESS", Body=b"{nope")

    summary = build_index(BuildIndexRequest(config=config))

    assert summary["shards_failed"] == 1
    assert "corrupt" in index_of(mocked_aws)["failed_shards"][0]["reason"]


def test_build_index_unreadable_output_bucket_is_raised_not_counted(mocked_aws: AwsWorld) -> None:
    """Only a missing _SUCCESS means a failed shard; other S3 errors must reach the task's Retry."""
    config = make_config(mocked_aws, 1)
    items = [{"shard_id": "00000", "parquet_uri": "s3://x/a.parquet", "output_uri": "s3://no-such-bucket/s/00000/"}]
    mocked_aws.put_json(config.shard_list_key, items)
    with pytest.raises(Exception, match="NoSuchBucket"):
        build_index(BuildIndexRequest(config=config))


def test_build_index_thousand_shards_summary_stays_small(mocked_aws: AwsWorld) -> None:
    config = make_config(mocked_aws, 1000, tolerated=50)
    failed = {i for i in range(1000) if i % 3 == 0}  # 334 failed, 33.4%
    for i in range(1000):
        if i not in failed:
            finish_shard(mocked_aws, f"{i:05d}", samples=5)

    summary = build_index(BuildIndexRequest(config=config))

    assert summary["shards_ok"] == 666
    assert summary["shards_failed"] == 334
    assert summary["total_samples"] == 666 * 5
    assert len(summary["failed_shards"]) == FAILED_SHARDS_IN_SUMMARY
    assert len(json.dumps(summary).encode()) < 4096
    assert len(index_of(mocked_aws)["failed_shards"]) == 334


def test_build_index_thousand_failed_shards_error_message_stays_small(mocked_aws: AwsWorld) -> None:
    config = make_config(mocked_aws, 1000, tolerated=10)
    with pytest.raises(NoUsableShards) as caught:
        build_index(BuildIndexRequest(config=config))
    assert len(str(caught.value)) < 1024


def test_handler_indexes_what_validate_run_listed(mocked_aws: AwsWorld) -> None:
    """validate_run's `$.config` is build_index's input, unchanged (the state machine's data flow)."""
    mocked_aws.put_json("models/sd/model_index.json", {"_class_name": "StableDiffusionPipeline"})
    for i in range(3):
        mocked_aws.s3.put_object(Bucket=DATA_BUCKET, Key=f"datasets/laion/part-{i}.parquet", Body=parquet_bytes())
    config = validate_run(
        ValidateRunRequest(
            run={
                "dataset": {"prefix": f"s3://{DATA_BUCKET}/datasets/laion/"},
                "base_model_uri": f"s3://{DATA_BUCKET}/models/sd/",
            },
            execution_name=RUN_ID,
            execution_arn=f"arn:aws:states:{REGION}:{ACCOUNT}:execution:sm:{RUN_ID}",
            start_time="2025-06-02T09:15:43Z",
        ),
        data_bucket=DATA_BUCKET,
        max_shards=50,
    )
    for shard in ("00000", "00002"):
        finish_shard(mocked_aws, shard, samples=4)
    app = load_function_module("build_index")

    with pytest.raises(NoUsableShards, match="1 of 3"):  # default tolerance is 10%
        app.lambda_handler({"config": config}, FakeLambdaContext())

    finish_shard(mocked_aws, "00001", samples=4)
    summary = app.lambda_handler({"config": config}, FakeLambdaContext())
    assert summary["total_samples"] == 12
    assert summary["index_uri"] == f"{config['dataset_prefix_uri']}index.json"


# ---------------------------------------------------------------- what was kept and why (curation)
