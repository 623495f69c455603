"""run_plan.plan_run (`sdflow plan`): what Validate run would decide for a document and a name, writing nothing."""

from __future__ import annotations

from typing import Any

import pytest

from sdflow_common.run_plan import plan_run
from tests.unit.helpers import DATA_BUCKET, STATE_MACHINE_ARN, AwsWorld
from tests.unit.parquet_files import parquet_bytes

MODEL_URI = f"s3://{DATA_BUCKET}/models/tiny-sd/"


@pytest.fixture
def world(mocked_aws: AwsWorld) -> AwsWorld:
    mocked_aws.put_json("models/tiny-sd/model_index.json", {"_class_name": "StableDiffusionPipeline"})
    for key in ("datasets/a.parquet", "datasets/b.parquet"):
        mocked_aws.s3.put_object(Bucket=DATA_BUCKET, Key=key, Body=parquet_bytes())
    return mocked_aws


def document(**changes: Any) -> dict[str, Any]:
    uris = [f"s3://{DATA_BUCKET}/datasets/a.parquet", f"s3://{DATA_BUCKET}/datasets/b.parquet"]
    return {"dataset": {"parquet_uris": uris}, "base_model_uri": MODEL_URI, **changes}


def plan(raw: dict[str, Any], name: str = "plan-0123456789abcdef") -> dict[str, Any]:
    return plan_run(raw, name, data_bucket=DATA_BUCKET, max_shards=50, state_machine_arn=STATE_MACHINE_ARN)


def written(world: AwsWorld) -> list[str]:
    return [item["Key"] for item in world.s3.list_objects_v2(Bucket=DATA_BUCKET, Prefix="runs/").get("Contents", [])]


def test_plan_run_valid_document_says_choices_requests_and_memory_and_writes_nothing(world: AwsWorld) -> None:
    found = plan(document())

    assert found["would_start"] is True
    assert (found["family"], found["method"], found["backend"]) == ("sd", "full", "colossalai")
    assert found["plugin"] == "gemini"
    assert found["shards"] == 2
    labels = [item["label"] for item in found["requests"]]
    assert labels[:4] == ["download job", "dedup job", "training job", "evaluation job"]
    dedup = found["requests"][1]
    assert dedup["name"].startswith("sdf-dd-plan-")
    assert (dedup["operation"], dedup["instance_type"], dedup["instance_count"]) == (
        "CreateProcessingJob",
        "ml.m5.2xlarge",
        1,
    )
    training = found["requests"][2]
    assert training["name"].startswith("sdf-tr-plan-")
    assert training["name"].endswith("-r0-a0")
    assert (training["instance_type"], training["instance_count"]) == ("ml.g5.12xlarge", 1)
    memory = {fit["field"]: fit for fit in found["memory"]}
    assert "A10G" in memory["training.instance_type"]["gpu"]
    assert memory["training.instance_type"]["fits"] is True
    assert 0 < memory["training.instance_type"]["need_gib"] < memory["training.instance_type"]["usable_gib"]
    assert written(world) == []


def test_plan_run_document_sagemaker_would_refuse_lists_every_refusal_with_its_field(world: AwsWorld) -> None:
    found = plan(
        document(dataset={"parquet_uris": [f"s3://{DATA_BUCKET}/datasets/a.parquet"], "url_column": "u" * 300})
    )

    assert found["would_start"] is False
    assert {problem["field"] for problem in found["problems"]} == {"dataset.url_column"}
    assert written(world) == []


def test_plan_run_name_longer_than_step_functions_takes_is_refused_naming_it(world: AwsWorld) -> None:
    found = plan(document(), name="n" * 81)

    assert found["would_start"] is False
    assert found["problems"][0]["field"] == "(execution name)"
