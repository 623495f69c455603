"""The pipeline under the strict local cloud: quotas, the Map's bounded result, limits at the API.

SageMaker jobs are no-ops held for a moment (sdflow.local.sagemaker.noop), so what is under test
is the orchestration: every other piece is real and strict (IAM per role, quotas, rate limits)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdflow.local.cloud import LocalCloud
from sdflow.local.sagemaker.noop import NoOpSageMaker
from tests.constants import hold_for
from tests.e2e.clouds import CloudSpec
from tests.helpers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SHARDS = 12
PROCESSING_QUOTA = 4
# Jobs held long enough (in real time) that the quota, not their speed, caps how many run at once.
CLOUD = CloudSpec(
    dataset="quota", shards=SHARDS, job_seconds=hold_for(0.5), quotas={"processing job": PROCESSING_QUOTA}
)


def _document(cloud: LocalCloud, **download: Any) -> dict[str, Any]:
    return {
        "dataset": {"prefix": f"s3://{cloud.bucket}/datasets/quota/"},
        "base_model_uri": f"s3://{cloud.bucket}/models/tiny/",
        "download": download,
        "training": {"instance_type": "ml.m5.xlarge"},
        "endpoint": {"name": "sdflow-strict", "instance_type": "ml.m5.large"},
    }


def _run(cloud: LocalCloud, name: str, document: Any) -> dict[str, Any]:
    sfn = cloud.client("stepfunctions")
    arn = sfn.start_execution(stateMachineArn=cloud.state_machine_arn, name=name, input=json.dumps(document))[
        "executionArn"
    ]

    def ended() -> dict[str, Any] | None:
        described = sfn.describe_execution(executionArn=arn)
        return described if described["status"] != "RUNNING" else None

    return dict(wait_for(ended, timeout_s=240.0, what=f"execution {name} to end", interval_s=0.5))


def test_pipeline_concurrency_above_processing_quota_capped_and_every_shard_downloaded(
    cloud: LocalCloud, sagemaker: NoOpSageMaker
) -> None:
    described = _run(cloud, "quota-capped", _document(cloud, max_concurrency=50))
    assert described["status"] == "SUCCEEDED", described.get("cause")
    assert 1 < sagemaker.peak_running <= PROCESSING_QUOTA
    index = json.loads(described["output"])["dataset"]
    assert index["shards_ok"] == SHARDS
    assert index["shards_failed"] == 0


def test_pipeline_map_results_written_to_s3_not_carried_in_state(cloud: LocalCloud) -> None:
    described = _run(cloud, "results-in-s3", _document(cloud, max_concurrency=4))
    assert described["status"] == "SUCCEEDED", described.get("cause")
    s3 = cloud.client("s3")
    listed = s3.list_objects_v2(Bucket=cloud.bucket, Prefix="runs/results-in-s3/download-results/")
    keys = [obj["Key"] for obj in listed.get("Contents", [])]
    manifest_key = next(key for key in keys if key.endswith("/manifest.json"))
    manifest = json.loads(s3.get_object(Bucket=cloud.bucket, Key=manifest_key)["Body"].read())
    succeeded = [f for f in manifest["ResultFiles"].get("SUCCEEDED", [])]
    assert succeeded, manifest
    entries = json.loads(s3.get_object(Bucket=cloud.bucket, Key=succeeded[0]["Key"])["Body"].read())
    assert len(entries) == SHARDS
    # The Map's own result (discarded by ResultPath null) never holds the children's outputs.
    history = cloud.client("stepfunctions").get_execution_history(
        executionArn=described["executionArn"], reverseOrder=True, maxResults=1000
    )["events"]
    map_exited = next(e for e in history if e["type"] == "MapStateExited")
    assert len(map_exited["stateExitedEventDetails"]["output"]) < 4096


def test_start_execution_input_over_256_kib_refused_at_the_api(cloud: LocalCloud) -> None:
    document = _document(cloud, max_concurrency=4)
    document["padding"] = "x" * 262_144
    with pytest.raises(ClientError) as refused:
        cloud.client("stepfunctions").start_execution(
            stateMachineArn=cloud.state_machine_arn, name="too-big", input=json.dumps(document)
        )
    assert refused.value.response["Error"]["Code"] == "ValidationException"
    assert "262144" in refused.value.response["Error"]["Message"]
