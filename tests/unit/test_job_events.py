"""job_events: each SageMaker detail-type and terminal/non-terminal status resolves (or not) the token."""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field
from typing import Any

# The X-Ray SDK opens its UDP emitter's socket on first import (Tracer() triggers it); import it
# here, at collection, before the unit fixtures block sockets.
import aws_xray_sdk.core  # noqa: F401
import botocore.session
import pytest
from botocore.exceptions import ClientError
from botocore.validate import validate_parameters
from pydantic import ValidationError

from sdflow_common import aws
from sdflow_common.token_store import TokenStore
from tests.constants import ACCOUNT, REGION
from tests.helpers import load_function_module
from tests.unit.helpers import TRAINING_IMAGE_URI, AwsWorld, FakeLambdaContext, load_event

EXECUTION_ARN = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:sdflow-pipeline-test:run-under-test"
TOKEN = "AQCEAAAAKgAAAAMAAAAAAAAAAf4kTokenUnderTest=="
SFN_MODEL = botocore.session.get_session().get_service_model("stepfunctions")


@dataclass
class StepFunctionsCalls:
    """SendTaskSuccess/SendTaskFailure as the function made them, checked against the API model."""

    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    error_code: str | None = None

    def record(self, operation: str, params: dict[str, Any]) -> dict[str, Any]:
        validate_parameters(params, SFN_MODEL.operation_model(operation).input_shape)
        self.calls.append((operation, params))
        if self.error_code:
            raise ClientError({"Error": {"Code": self.error_code, "Message": "from the test"}}, operation)
        return {}

    def only(self) -> tuple[str, dict[str, Any]]:
        assert len(self.calls) == 1, self.calls
        return self.calls[0]


@pytest.fixture
def sfn(mocked_aws: AwsWorld, monkeypatch: pytest.MonkeyPatch) -> StepFunctionsCalls:
    recorder = StepFunctionsCalls()
    client = aws.client("stepfunctions")
    monkeypatch.setattr(client, "send_task_success", lambda **kw: recorder.record("SendTaskSuccess", kw))
    monkeypatch.setattr(client, "send_task_failure", lambda **kw: recorder.record("SendTaskFailure", kw))
    return recorder


@pytest.fixture
def handle(mocked_aws: AwsWorld) -> Any:
    handler = load_function_module("job_events").lambda_handler
    return lambda event: handler(event, FakeLambdaContext())


def claim_for(store: TokenStore, event: dict[str, Any], kind: str, **context: str) -> str:
    detail = event["detail"]
    name = detail.get("ProcessingJobName") or detail.get("TrainingJobName") or detail["EndpointName"]
    store.claim(name, TOKEN, EXECUTION_ARN, kind, context, timeout_seconds=3600)  # type: ignore[arg-type]
    return str(name)


# ---------------------------------------------------------------------------- processing jobs


def test_processing_completed_sends_success_summary_and_deletes_token(
    handle: Any, sfn: StepFunctionsCalls, store: TokenStore
) -> None:
    event = load_event("sagemaker_processing_completed.json")
    name = claim_for(store, event, "download", shard_id="00001")
    result = handle(event)
    operation, params = sfn.only()
    assert operation == "SendTaskSuccess"
    assert params["taskToken"] == TOKEN
    assert json.loads(params["output"]) == {"shard_id": "00001", "status": "ok", "job_name": name}
    assert result["outcome"] == "succeeded"
    assert store.get(name) is None


def test_processing_failed_sends_download_job_failed_with_reason(
    handle: Any, sfn: StepFunctionsCalls, store: TokenStore
) -> None:
    event = load_event("sagemaker_processing_failed.json")
    name = claim_for(store, event, "download", shard_id="00001")
    handle(event)
    operation, params = sfn.only()
    assert operation == "SendTaskFailure"
    assert params["error"] == "DownloadJobFailed"
    assert event["detail"]["FailureReason"] in params["cause"]
    assert event["detail"]["ExitMessage"] in params["cause"]
    assert store.get(name) is None


def test_processing_stopped_is_a_failure(handle: Any, sfn: StepFunctionsCalls, store: TokenStore) -> None:
    event = load_event("sagemaker_processing_inprogress.json")
    event["detail"]["ProcessingJobStatus"] = "Stopped"
    claim_for(store, event, "download", shard_id="00001")
    handle(event)
    operation, params = sfn.only()
    assert (operation, params["error"]) == ("SendTaskFailure", "DownloadJobFailed")
    assert "Stopped" in params["cause"]


def test_processing_in_progress_is_ignored_and_token_kept(
    handle: Any, sfn: StepFunctionsCalls, store: TokenStore
) -> None:
    event = load_event("sagemaker_processing_inprogress.json")
    name = claim_for(store, event, "download", shard_id="00001")
    assert handle(event)["outcome"] == "ignored"
    assert sfn.calls == []
    assert store.get(name) is not None


def dedup_event(status: str) -> dict[str, Any]:
    """The dedup job's state change: a processing job named sdf-dd-… (names.dedup_job_name)."""
    event = copy.deepcopy(load_event("sagemaker_processing_completed.json"))
    event["detail"].update(
        {"ProcessingJobName": "sdf-dd-run-under-test-0123456789-r0-a0", "ProcessingJobStatus": status}
    )
    return event


def test_dedup_job_completed_answers_find_duplicates_with_its_summary(
    handle: Any, sfn: StepFunctionsCalls, store: TokenStore
) -> None:
    summary = "s3://sdflow-data-test/runs/run-under-test/dataset/dedup/summary.json"
    name = claim_for(store, dedup_event("Completed"), "dedup", summary_uri=summary)

    result = handle(dedup_event("Completed"))

    operation, params = sfn.only()
    assert operation == "SendTaskSuccess"
    assert json.loads(params["output"]) == {"job_name": name, "summary_uri": summary}
    assert (result["outcome"], result["kind"]) == ("succeeded", "dedup")
    assert store.get(name) is None


@pytest.mark.parametrize("status", ["Failed", "Stopped"])
def test_dedup_job_failed_or_stopped_fails_find_duplicates_with_dedup_job_failed(
    handle: Any, sfn: StepFunctionsCalls, store: TokenStore, status: str
) -> None:
    name = claim_for(store, dedup_event(status), "dedup", summary_uri="s3://b/runs/r/dataset/dedup/summary.json")

    handle(dedup_event(status))

    operation, params = sfn.only()
    assert (operation, params["error"]) == ("SendTaskFailure", "DedupJobFailed")
    assert f"dedup job {name} ended {status}" in params["cause"]
    assert store.get(name) is None


# ---------------------------------------------------------------------------- training jobs


def test_training_completed_sends_model_and_metrics(handle: Any, sfn: StepFunctionsCalls, store: TokenStore) -> None:
    event = load_event("sagemaker_training_completed.json")
    name = claim_for(store, event, "training", output_path="s3://bucket/runs/x/training/")
    handle(event)
    operation, params = sfn.only()
    assert operation == "SendTaskSuccess"
    output = json.loads(params["output"])
    assert output == {
        "job_name": name,
        "model_data_url": event["detail"]["ModelArtifacts"]["S3ModelArtifacts"],
        "final_metrics": {"train:loss": 0.0812},
    }
    assert len(params["output"].encode()) < 4096
    assert store.get(name) is None


def test_training_completed_without_artifacts_uses_output_path(
    handle: Any, sfn: StepFunctionsCalls, store: TokenStore
) -> None:
    event = load_event("sagemaker_training_completed.json")
    del event["detail"]["ModelArtifacts"]
    name = claim_for(store, event, "training", output_path="s3://bucket/runs/x/training/")
    handle(event)
    assert json.loads(sfn.only()[1]["output"])["model_data_url"] == f"s3://bucket/runs/x/training/{name}/output/model/"


def test_training_completed_uncompressed_artifacts_reported_without_slash_become_prefix(
    handle: Any, sfn: StepFunctionsCalls, store: TokenStore
) -> None:
    event = load_event("sagemaker_training_completed.json")
    reported = event["detail"]["ModelArtifacts"]["S3ModelArtifacts"]
    assert reported.endswith("/output/model/")
    assert event["detail"]["OutputDataConfig"]["CompressionType"] == "NONE"
    event["detail"]["ModelArtifacts"]["S3ModelArtifacts"] = reported.rstrip("/")
    claim_for(store, event, "training", output_path="s3://bucket/runs/x/training/")
    handle(event)
    assert json.loads(sfn.only()[1]["output"])["model_data_url"] == reported


def test_training_completed_gzip_output_keeps_reported_model_tar_gz(
    handle: Any, sfn: StepFunctionsCalls, store: TokenStore
) -> None:
    event = load_event("sagemaker_training_completed.json")
    event["detail"]["OutputDataConfig"].pop("CompressionType")
    archive = event["detail"]["ModelArtifacts"]["S3ModelArtifacts"].replace("/output/model/", "/output/model.tar.gz")
    event["detail"]["ModelArtifacts"]["S3ModelArtifacts"] = archive
    claim_for(store, event, "training", output_path="s3://bucket/runs/x/training/")
    handle(event)
    assert json.loads(sfn.only()[1]["output"])["model_data_url"] == archive


def test_training_failed_sends_training_job_failed(handle: Any, sfn: StepFunctionsCalls, store: TokenStore) -> None:
    event = load_event("sagemaker_training_failed.json")
    claim_for(store, event, "training")
    handle(event)
    operation, params = sfn.only()
    assert (operation, params["error"]) == ("SendTaskFailure", "TrainingJobFailed")
    assert "CUDA out of memory" in params["cause"]


@pytest.mark.parametrize(
    "reason",
    [
        "CapacityError: Unable to provision requested ML compute capacity. Please retry using a different ML "
        "instance type.",
        "InsufficientCapacityError: We currently do not have sufficient ml.p4d.24xlarge capacity.",
    ],
)
def test_training_failed_for_capacity_sends_training_capacity_unavailable(
    handle: Any, sfn: StepFunctionsCalls, store: TokenStore, reason: str
) -> None:
    # SageMaker's RetryStrategy does not retry capacity; the state does, on this error name.
    event = load_event("sagemaker_training_failed.json")
    event["detail"]["FailureReason"] = reason
    claim_for(store, event, "training")
    handle(event)
    operation, params = sfn.only()
    assert (operation, params["error"]) == ("SendTaskFailure", "TrainingCapacityUnavailable")
    assert reason in params["cause"]


def test_training_stopped_with_capacity_words_stays_training_job_failed(
    handle: Any, sfn: StepFunctionsCalls, store: TokenStore
) -> None:
    event = load_event("sagemaker_training_failed.json")
    event["detail"]["TrainingJobStatus"] = "Stopped"
    event["detail"]["FailureReason"] = "CapacityError: Unable to provision requested ML compute capacity."
    claim_for(store, event, "training")
    handle(event)
    assert sfn.only()[1]["error"] == "TrainingJobFailed"


def test_training_failure_reason_is_truncated_to_step_functions_limit(
    handle: Any, sfn: StepFunctionsCalls, store: TokenStore
) -> None:
    event = load_event("sagemaker_training_failed.json")
    event["detail"]["FailureReason"] = "x" * 40_000
    claim_for(store, event, "training")
    handle(event)
    assert len(sfn.only()[1]["cause"]) <= 32_768


def test_training_in_progress_is_ignored(handle: Any, sfn: StepFunctionsCalls, store: TokenStore) -> None:
    event = load_event("sagemaker_training_inprogress.json")
    name = claim_for(store, event, "training")
    assert handle(event)["outcome"] == "ignored"
    assert sfn.calls == []
    assert store.get(name) is not None


# ---------------------------------------------------------------------------- endpoints


def seed_endpoint(world: AwsWorld, endpoint: str, config: str) -> None:
    world.sagemaker.create_model(
        ModelName=config,
        PrimaryContainer={"Image": TRAINING_IMAGE_URI, "ModelDataUrl": "s3://b/m.tar.gz"},
        ExecutionRoleArn=f"arn:aws:iam::{ACCOUNT}:role/sm",
    )
    world.sagemaker.create_endpoint_config(
        EndpointConfigName=config,
        ProductionVariants=[
            {"VariantName": "AllTraffic", "ModelName": config, "InitialInstanceCount": 1, "InstanceType": "ml.m5.large"}
        ],
    )
    world.sagemaker.create_endpoint(EndpointName=endpoint, EndpointConfigName=config)


def endpoint_event(name: str = "sagemaker_endpoint_inservice.json") -> dict[str, Any]:
    event = load_event(name)
    # The claim is made "now"; a real event about this deployment comes after it.
    event["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 5))
    return event


def test_endpoint_in_service_on_our_config_sends_success(
    handle: Any, sfn: StepFunctionsCalls, store: TokenStore, mocked_aws: AwsWorld
) -> None:
    event = endpoint_event()
    config = event["detail"]["EndpointConfigName"]
    seed_endpoint(mocked_aws, event["detail"]["EndpointName"], config)
    name = claim_for(store, event, "endpoint", endpoint_config_name=config, model_name=config, action="create")
    handle(event)
    operation, params = sfn.only()
    assert operation == "SendTaskSuccess"
    assert json.loads(params["output"]) == {
        "endpoint_name": name,
        "endpoint_config_name": config,
        "model_name": config,
        "action": "create",
    }
    assert store.get(name) is None


def test_endpoint_update_rolled_back_sends_endpoint_deploy_failed(
    handle: Any, sfn: StepFunctionsCalls, store: TokenStore, mocked_aws: AwsWorld
) -> None:
    event = endpoint_event()
    endpoint = event["detail"]["EndpointName"]
    # After a failed blue/green update SageMaker is back InService on the previous config.
    seed_endpoint(mocked_aws, endpoint, "previous-config")
    event["detail"]["EndpointConfigName"] = "previous-config"
    claim_for(store, event, "endpoint", endpoint_config_name="new-config", model_name="new-config", action="update")
    handle(event)
    operation, params = sfn.only()
    assert (operation, params["error"]) == ("SendTaskFailure", "EndpointDeployFailed")
    assert "rolled back" in params["cause"]
    assert "previous-config" in params["cause"]


def test_endpoint_failed_sends_failure_with_reason(
    handle: Any, sfn: StepFunctionsCalls, store: TokenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    event = endpoint_event("sagemaker_endpoint_failed.json")
    detail = event["detail"]
    described = {
        "EndpointName": detail["EndpointName"],
        "EndpointConfigName": detail["EndpointConfigName"],
        "EndpointStatus": "Failed",
        "FailureReason": detail["FailureReason"],
    }
    monkeypatch.setattr(aws.client("sagemaker"), "describe_endpoint", lambda **_kw: described)
    claim_for(store, event, "endpoint", endpoint_config_name=detail["EndpointConfigName"], action="create")
    handle(event)
    operation, params = sfn.only()
    assert (operation, params["error"]) == ("SendTaskFailure", "EndpointDeployFailed")
    assert "ping health check" in params["cause"]


def test_endpoint_vanished_sends_failure(handle: Any, sfn: StepFunctionsCalls, store: TokenStore) -> None:
    event = endpoint_event()
    claim_for(store, event, "endpoint", endpoint_config_name="c", action="create")
    handle(event)
    operation, params = sfn.only()
    assert (operation, params["error"]) == ("SendTaskFailure", "EndpointDeployFailed")
    assert "vanished" in params["cause"]


def test_endpoint_updating_event_is_ignored(handle: Any, sfn: StepFunctionsCalls, store: TokenStore) -> None:
    event = endpoint_event("sagemaker_endpoint_updating.json")
    name = claim_for(store, event, "endpoint", endpoint_config_name="c", action="update")
    assert handle(event)["outcome"] == "ignored"
    assert sfn.calls == []
    assert store.get(name) is not None


def test_endpoint_event_from_before_this_deployment_is_ignored(
    handle: Any, sfn: StepFunctionsCalls, store: TokenStore, mocked_aws: AwsWorld
) -> None:
    event = load_event("sagemaker_endpoint_inservice.json")  # time: 2025, long before the claim
    seed_endpoint(mocked_aws, event["detail"]["EndpointName"], "previous-config")
    name = claim_for(store, event, "endpoint", endpoint_config_name="new-config", action="update")
    assert handle(event)["outcome"] == "ignored"
    assert sfn.calls == []
    assert store.get(name) is not None


def test_endpoint_in_service_while_describe_says_updating_is_ignored(
    handle: Any, sfn: StepFunctionsCalls, store: TokenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    event = endpoint_event()
    detail = event["detail"]
    described = {"EndpointName": detail["EndpointName"], "EndpointStatus": "Updating", "EndpointConfigName": "old"}
    monkeypatch.setattr(aws.client("sagemaker"), "describe_endpoint", lambda **_kw: described)
    claim_for(store, event, "endpoint", endpoint_config_name=detail["EndpointConfigName"], action="update")
    assert handle(event)["outcome"] == "ignored"
    assert sfn.calls == []


# ---------------------------------------------------------------------------- duplicates, unknowns


def test_unknown_resource_is_logged_not_resolved(handle: Any, sfn: StepFunctionsCalls) -> None:
    assert handle(load_event("sagemaker_training_completed.json"))["outcome"] == "unknown"
    assert sfn.calls == []


def test_duplicate_event_resolves_token_once(handle: Any, sfn: StepFunctionsCalls, store: TokenStore) -> None:
    event = load_event("sagemaker_processing_completed.json")
    claim_for(store, event, "download", shard_id="00001")
    assert handle(event)["outcome"] == "succeeded"
    assert handle(copy.deepcopy(event))["outcome"] == "unknown"
    assert len(sfn.calls) == 1


@pytest.mark.parametrize("code", ["TaskDoesNotExist", "InvalidToken", "TaskTimedOut"])
@pytest.mark.parametrize("event_name", ["sagemaker_processing_completed.json", "sagemaker_processing_failed.json"])
def test_stale_token_is_logged_not_raised(
    handle: Any, sfn: StepFunctionsCalls, store: TokenStore, code: str, event_name: str
) -> None:
    sfn.error_code = code
    event = load_event(event_name)
    name = claim_for(store, event, "download", shard_id="00001")
    assert handle(event)["outcome"] == "stale_token"
    assert len(sfn.calls) == 1
    assert store.get(name) is None


def test_other_step_functions_error_is_raised_and_token_kept(
    handle: Any, sfn: StepFunctionsCalls, store: TokenStore
) -> None:
    sfn.error_code = "ThrottlingException"
    event = load_event("sagemaker_processing_completed.json")
    name = claim_for(store, event, "download", shard_id="00001")
    with pytest.raises(ClientError, match="ThrottlingException"):
        handle(event)
    # Kept, so EventBridge's retry of this invocation (or the reconciler) can resolve it.
    assert store.get(name) is not None


def test_unrelated_detail_type_is_rejected_by_the_parser(handle: Any) -> None:
    event = load_event("sagemaker_processing_completed.json")
    event["detail-type"] = "SageMaker Model State Change"
    with pytest.raises(ValidationError):
        handle(event)


def test_processing_reason_repeated_in_exit_message_is_said_once() -> None:
    from sdflow_common.job_events import ProcessingJobDetail

    detail = ProcessingJobDetail.model_validate(
        {
            "ProcessingJobName": "sdf-dl-x",
            "ProcessingJobStatus": "Failed",
            "FailureReason": "AlgorithmError: MissingColumn: parquet has no column 'URL'",
            "ExitMessage": "MissingColumn: parquet has no column 'URL'",
        }
    )
    assert detail.reason == "AlgorithmError: MissingColumn: parquet has no column 'URL'"
