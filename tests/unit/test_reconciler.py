"""reconciler: old claims whose resource is terminal get resolved as if the event had arrived."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

# The X-Ray SDK opens its UDP emitter's socket on first import (Tracer() triggers it); import it
# here, at collection, before the unit fixtures block sockets.
import aws_xray_sdk.core  # noqa: F401
import pytest
from botocore.exceptions import ClientError

from sdflow_common import aws, sagemaker_jobs
from sdflow_common.errors import ReconcileIncomplete
from sdflow_common.run_document import DownloadOptions, RunDocument
from sdflow_common.token_store import TokenStore
from tests.conftest import load_function_module
from tests.unit.conftest import (
    ACCOUNT,
    DATA_BUCKET,
    REGION,
    SAGEMAKER_ROLE_ARN,
    TOKEN_TABLE,
    TRAINING_IMAGE_URI,
    AwsWorld,
    FakeLambdaContext,
    load_event,
)

EXECUTION_ARN = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:sdflow-pipeline-test:run-under-test"
RUN_ID = "run-under-test"
AN_HOUR_AGO = 3600


@dataclass
class Resolutions:
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def by_token(self) -> dict[str, tuple[str, dict[str, Any]]]:
        return {params["taskToken"]: (operation, params) for operation, params in self.calls}


@pytest.fixture
def sfn(mocked_aws: AwsWorld, monkeypatch: pytest.MonkeyPatch) -> Resolutions:
    recorder = Resolutions()
    client = aws.client("stepfunctions")
    monkeypatch.setattr(client, "send_task_success", lambda **kw: recorder.calls.append(("success", kw)) or {})
    monkeypatch.setattr(client, "send_task_failure", lambda **kw: recorder.calls.append(("failure", kw)) or {})
    return recorder


def claims_made(seconds_ago: int) -> TokenStore:
    """A store whose claims carry a creation time in the past."""
    return TokenStore(TOKEN_TABLE, 14 * 24 * 3600, clock=lambda: time.time() - seconds_ago)


def reconcile() -> dict[str, int]:
    handler = load_function_module("reconciler").lambda_handler
    return handler(load_event("scheduled_reconciler.json"), FakeLambdaContext())  # type: ignore[no-any-return]


def create_training_job(world: AwsWorld, name: str) -> None:
    run = RunDocument.model_validate(
        {"dataset": {"prefix": f"s3://{DATA_BUCKET}/d/"}, "base_model_uri": f"s3://{DATA_BUCKET}/models/m/"}
    )
    world.sagemaker.create_training_job(
        **sagemaker_jobs.training_job_request(
            job_name=name,
            run_id=RUN_ID,
            bucket=DATA_BUCKET,
            dataset_prefix_uri=f"s3://{DATA_BUCKET}/runs/{RUN_ID}/dataset/",
            run=run,
            image_uri=TRAINING_IMAGE_URI,
            role_arn=SAGEMAKER_ROLE_ARN,
        )
    )


def create_processing_job(world: AwsWorld, name: str) -> None:
    world.sagemaker.create_processing_job(
        **sagemaker_jobs.processing_job_request(
            job_name=name,
            run_id=RUN_ID,
            shard_id="00000",
            parquet_uri=f"s3://{DATA_BUCKET}/d/part-0.parquet",
            output_uri=f"s3://{DATA_BUCKET}/runs/{RUN_ID}/dataset/shards/00000/",
            options=DownloadOptions(),
            url_column="URL",
            caption_column="TEXT",
            image_uri=TRAINING_IMAGE_URI,
            role_arn=SAGEMAKER_ROLE_ARN,
        )
    )


def test_reconciler_resolves_training_job_whose_event_was_missed(mocked_aws: AwsWorld, sfn: Resolutions) -> None:
    create_training_job(mocked_aws, "sdf-tr-missed-a0")  # moto completes jobs at once
    claims_made(AN_HOUR_AGO).claim("sdf-tr-missed-a0", "token-missed", EXECUTION_ARN, "training")
    counts = reconcile()
    operation, params = sfn.by_token()["token-missed"]
    assert operation == "success"
    output = json.loads(params["output"])
    assert output["job_name"] == "sdf-tr-missed-a0"
    assert output["model_data_url"].endswith("sdf-tr-missed-a0/output/model.tar.gz")
    assert counts == {"checked": 1, "resolved": 1, "pending": 0, "vanished": 0, "errors": 0}
    assert TokenStore(TOKEN_TABLE, 60).get("sdf-tr-missed-a0") is None


def test_reconciler_leaves_running_job_and_young_claims_alone(
    mocked_aws: AwsWorld, sfn: Resolutions, monkeypatch: pytest.MonkeyPatch
) -> None:
    create_processing_job(mocked_aws, "sdf-dl-running-00000-a0")
    create_processing_job(mocked_aws, "sdf-dl-young-00000-a0")
    claims_made(AN_HOUR_AGO).claim("sdf-dl-running-00000-a0", "token-running", EXECUTION_ARN, "download")
    claims_made(60).claim("sdf-dl-young-00000-a0", "token-young", EXECUTION_ARN, "download")
    original = aws.client("sagemaker").describe_processing_job
    monkeypatch.setattr(
        aws.client("sagemaker"),
        "describe_processing_job",
        lambda **kw: {**original(**kw), "ProcessingJobStatus": "InProgress"},
    )
    counts = reconcile()
    assert sfn.calls == []
    assert counts == {"checked": 1, "resolved": 0, "pending": 1, "vanished": 0, "errors": 0}
    assert TokenStore(TOKEN_TABLE, 60).get("sdf-dl-running-00000-a0") is not None


def test_reconciler_fails_task_whose_job_vanished(mocked_aws: AwsWorld, sfn: Resolutions) -> None:
    claims_made(AN_HOUR_AGO).claim("sdf-dl-ghost-00000-a0", "token-ghost", EXECUTION_ARN, "download")
    counts = reconcile()
    operation, params = sfn.by_token()["token-ghost"]
    assert (operation, params["error"]) == ("failure", "DownloadJobFailed")
    assert "vanished" in params["cause"]
    assert counts["vanished"] == 1
    assert TokenStore(TOKEN_TABLE, 60).get("sdf-dl-ghost-00000-a0") is None


def test_reconciler_resolves_endpoint_through_describe(mocked_aws: AwsWorld, sfn: Resolutions) -> None:
    sm = mocked_aws.sagemaker
    sm.create_model(
        ModelName="sdflow-dep-a0",
        PrimaryContainer={"Image": TRAINING_IMAGE_URI, "ModelDataUrl": "s3://b/m.tar.gz"},
        ExecutionRoleArn=SAGEMAKER_ROLE_ARN,
    )
    sm.create_endpoint_config(
        EndpointConfigName="sdflow-dep-a0",
        ProductionVariants=[
            {"VariantName": "AllTraffic", "ModelName": "sdflow-dep-a0", "InitialInstanceCount": 1,
             "InstanceType": "ml.m5.large"}
        ],
    )  # fmt: skip
    sm.create_endpoint(EndpointName="sdflow", EndpointConfigName="sdflow-dep-a0")
    context = {"endpoint_config_name": "sdflow-dep-a0", "model_name": "sdflow-dep-a0", "action": "create"}
    claims_made(AN_HOUR_AGO).claim("sdflow", "token-endpoint", EXECUTION_ARN, "endpoint", context)
    reconcile()
    operation, params = sfn.by_token()["token-endpoint"]
    assert operation == "success"
    assert json.loads(params["output"])["endpoint_config_name"] == "sdflow-dep-a0"


def test_reconciler_one_broken_claim_does_not_block_the_others(
    mocked_aws: AwsWorld, sfn: Resolutions, monkeypatch: pytest.MonkeyPatch
) -> None:
    create_training_job(mocked_aws, "sdf-tr-ok-a0")
    older = claims_made(AN_HOUR_AGO)
    older.claim("sdf-tr-ok-a0", "token-ok", EXECUTION_ARN, "training")
    older.claim("sdf-dl-broken-00000-a0", "token-broken", EXECUTION_ARN, "download")

    def access_denied(**_kwargs: Any) -> None:
        raise ClientError({"Error": {"Code": "AccessDeniedException", "Message": "no"}}, "DescribeProcessingJob")

    monkeypatch.setattr(aws.client("sagemaker"), "describe_processing_job", access_denied)
    with pytest.raises(ReconcileIncomplete, match="sdf-dl-broken-00000-a0"):
        reconcile()
    assert sfn.by_token()["token-ok"][0] == "success"
    assert "token-broken" not in sfn.by_token()
