"""start_download / start_training / deploy_endpoint: claim first, one resource per attempt."""

from __future__ import annotations

import copy
from typing import Any

# The X-Ray SDK opens its UDP emitter's socket on first import (Tracer() triggers it); import it
# here, at collection, before the unit fixtures block sockets.
import aws_xray_sdk.core  # noqa: F401
import pytest
from botocore.exceptions import ClientError

from sdflow_common import aws, names
from sdflow_common.errors import (
    DownloadJobFailed,
    EndpointBusy,
    EndpointDeployFailed,
    SageMakerQuotaExceeded,
    SageMakerThrottled,
    TrainingJobFailed,
)
from sdflow_common.token_store import TokenStore
from tests.conftest import load_function_module
from tests.unit.conftest import (
    ACCOUNT,
    REGION,
    TOKEN_TABLE,
    TRAINING_IMAGE_URI,
    AwsWorld,
    FakeLambdaContext,
    load_event,
)


@pytest.fixture
def context() -> FakeLambdaContext:
    return FakeLambdaContext()


@pytest.fixture
def store(mocked_aws: AwsWorld) -> TokenStore:
    return TokenStore(TOKEN_TABLE, 3600)


def sagemaker_client() -> Any:
    """The cached client the functions use, so tests can patch single operations on it."""
    return aws.client("sagemaker")


def throttle(*_args: Any, **_kwargs: Any) -> None:
    raise ClientError({"Error": {"Code": "ThrottlingException", "Message": "Rate exceeded"}}, "Create")


def download_job_names(world: AwsWorld) -> list[str]:
    return sorted(job["ProcessingJobName"] for job in world.sagemaker.list_processing_jobs()["ProcessingJobSummaries"])


# ---------------------------------------------------------------------------- download


def test_start_download_creates_named_job_and_claims_token(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    event = load_event("start_download_task.json")
    result = load_function_module("start_download").lambda_handler(event, context)
    expected = names.download_job_name(event["execution_arn"], event["run_id"], "00001", 0)
    assert result == {"resource_name": expected, "created": True}
    assert download_job_names(mocked_aws) == [expected]
    job = mocked_aws.sagemaker.describe_processing_job(ProcessingJobName=expected)
    assert job["AppSpecification"]["ContainerEntrypoint"] == ["download"]
    assert job["ProcessingOutputConfig"]["Outputs"][0]["S3Output"]["S3Uri"] == event["shard"]["output_uri"]
    record = store.get(expected)
    assert record is not None
    assert record.task_token == event["token"]
    assert record.kind == "download"
    assert record.context["shard_id"] == "00001"


def test_start_download_reinvoked_same_attempt_creates_one_job(
    mocked_aws: AwsWorld, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler = load_function_module("start_download").lambda_handler
    event = load_event("start_download_task.json")
    handler(event, context)
    calls: list[str] = []
    original = sagemaker_client().create_processing_job
    monkeypatch.setattr(
        sagemaker_client(),
        "create_processing_job",
        lambda **kw: calls.append(kw["ProcessingJobName"]) or original(**kw),
    )
    second = handler(copy.deepcopy(event), context)
    assert second["created"] is False
    assert calls == []
    assert len(download_job_names(mocked_aws)) == 1


def test_start_download_retry_attempt_creates_distinct_job(mocked_aws: AwsWorld, context: FakeLambdaContext) -> None:
    handler = load_function_module("start_download").lambda_handler
    first = load_event("start_download_task.json")
    retry = {**copy.deepcopy(first), "attempt": 1, "token": first["token"] + "-retry"}
    name_0 = handler(first, context)["resource_name"]
    name_1 = handler(retry, context)["resource_name"]
    assert name_0 != name_1
    assert name_1.endswith("-a1")
    assert download_job_names(mocked_aws) == sorted([name_0, name_1])


def test_start_download_throttled_raises_and_releases_claim(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sagemaker_client(), "create_processing_job", throttle)
    event = load_event("start_download_task.json")
    with pytest.raises(SageMakerThrottled, match="Rate exceeded"):
        load_function_module("start_download").lambda_handler(event, context)
    assert store.get(names.download_job_name(event["execution_arn"], event["run_id"], "00001", 0)) is None
    assert download_job_names(mocked_aws) == []


def test_start_download_refused_request_raises_download_job_failed(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(**_kwargs: Any) -> None:
        raise ClientError(
            {"Error": {"Code": "ValidationException", "Message": "Role cannot be assumed"}}, "CreateProcessingJob"
        )

    monkeypatch.setattr(sagemaker_client(), "create_processing_job", refuse)
    event = load_event("start_download_task.json")
    with pytest.raises(DownloadJobFailed, match="Role cannot be assumed"):
        load_function_module("start_download").lambda_handler(event, context)
    assert store.get(names.download_job_name(event["execution_arn"], event["run_id"], "00001", 0)) is None


def test_start_download_missing_role_setting_names_variable(
    mocked_aws: AwsWorld, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SAGEMAKER_ROLE_ARN")
    with pytest.raises(RuntimeError, match="SAGEMAKER_ROLE_ARN"):
        load_function_module("start_download").lambda_handler(load_event("start_download_task.json"), context)


# ---------------------------------------------------------------------------- training


def test_start_training_creates_job_with_run_options(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    event = load_event("start_training_task.json")
    result = load_function_module("start_training").lambda_handler(event, context)
    expected = names.training_job_name(event["execution_arn"], event["config"]["run_id"], 0)
    assert result == {"resource_name": expected, "created": True}
    job = mocked_aws.sagemaker.describe_training_job(TrainingJobName=expected)
    assert job["AlgorithmSpecification"]["TrainingImage"] == TRAINING_IMAGE_URI
    assert job["ResourceConfig"]["InstanceCount"] == event["config"]["run"]["training"]["instance_count"]
    assert job["HyperParameters"]["max_train_steps"] == str(event["config"]["run"]["training"]["max_train_steps"])
    assert job["EnableManagedSpotTraining"] is True
    record = store.get(expected)
    assert record is not None
    assert record.kind == "training"
    assert record.context["output_path"].endswith(f"runs/{event['config']['run_id']}/training/")


def test_start_training_throttled_raises_and_releases_claim(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sagemaker_client(), "create_training_job", throttle)
    event = load_event("start_training_task.json")
    with pytest.raises(SageMakerThrottled):
        load_function_module("start_training").lambda_handler(event, context)
    assert store.get(names.training_job_name(event["execution_arn"], event["config"]["run_id"], 0)) is None


def over_quota(limit: int, used: int, delta: int) -> Any:
    """SageMaker's ResourceLimitExceeded, worded as SageMaker words it."""
    message = (
        f"The account-level service limit 'ml.g5.12xlarge for training job usage' is {limit} Instances, with "
        f"current utilization of {used} Instances and a request delta of {delta} Instances. Please use AWS "
        "Service Quotas to request an increase for this quota."
    )

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise ClientError({"Error": {"Code": "ResourceLimitExceeded", "Message": message}}, "Create")

    return refuse


def test_start_training_quota_in_use_raises_quota_exceeded_and_releases_claim(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sagemaker_client(), "create_training_job", over_quota(limit=2, used=2, delta=1))
    event = load_event("start_training_task.json")
    with pytest.raises(SageMakerQuotaExceeded, match="ResourceLimitExceeded") as raised:
        load_function_module("start_training").lambda_handler(event, context)
    assert not isinstance(raised.value, SageMakerThrottled), "a quota gets its own, longer Retry"
    assert store.get(names.training_job_name(event["execution_arn"], event["config"]["run_id"], 0)) is None


def test_start_training_request_above_quota_fails_at_once_with_advice(
    mocked_aws: AwsWorld, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sagemaker_client(), "create_training_job", over_quota(limit=0, used=0, delta=1))
    with pytest.raises(TrainingJobFailed, match="request an increase in the Service Quotas console"):
        load_function_module("start_training").lambda_handler(load_event("start_training_task.json"), context)


def test_start_download_quota_in_use_raises_quota_exceeded(
    mocked_aws: AwsWorld, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sagemaker_client(), "create_processing_job", over_quota(limit=4, used=4, delta=1))
    with pytest.raises(SageMakerQuotaExceeded):
        load_function_module("start_download").lambda_handler(load_event("start_download_task.json"), context)


def test_start_training_other_error_raises_training_job_failed(
    mocked_aws: AwsWorld, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(**_kwargs: Any) -> None:
        raise ClientError({"Error": {"Code": "ValidationException", "Message": "bad image"}}, "CreateTrainingJob")

    monkeypatch.setattr(sagemaker_client(), "create_training_job", refuse)
    with pytest.raises(TrainingJobFailed, match="bad image"):
        load_function_module("start_training").lambda_handler(load_event("start_training_task.json"), context)


# ---------------------------------------------------------------------------- deploy


def endpoint_name(event: dict[str, Any]) -> str:
    return str(event["config"]["run"]["endpoint"]["name"])


def seed_endpoint(world: AwsWorld, endpoint: str, config: str = "previous-config") -> None:
    """An endpoint from an earlier run, serving `config`."""
    world.sagemaker.create_model(
        ModelName=config,
        PrimaryContainer={"Image": TRAINING_IMAGE_URI, "ModelDataUrl": "s3://b/old/model.tar.gz"},
        ExecutionRoleArn=f"arn:aws:iam::{ACCOUNT}:role/old",
    )
    world.sagemaker.create_endpoint_config(
        EndpointConfigName=config,
        ProductionVariants=[
            {"VariantName": "AllTraffic", "ModelName": config, "InitialInstanceCount": 1, "InstanceType": "ml.m5.large"}
        ],
    )
    world.sagemaker.create_endpoint(EndpointName=endpoint, EndpointConfigName=config)


def test_deploy_endpoint_missing_endpoint_is_created(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    event = load_event("deploy_endpoint_task.json")
    result = load_function_module("deploy_endpoint").lambda_handler(event, context)
    endpoint = endpoint_name(event)
    deployment = names.deployment_name(endpoint, event["execution_arn"], 0)
    assert result["action"] == "create"
    assert result["endpoint_config_name"] == deployment
    described = mocked_aws.sagemaker.describe_endpoint(EndpointName=endpoint)
    assert described["EndpointConfigName"] == deployment
    model = mocked_aws.sagemaker.describe_model(ModelName=deployment)
    assert model["PrimaryContainer"]["ModelDataUrl"] == event["training"]["model_data_url"]
    record = store.get(endpoint)
    assert record is not None
    assert record.kind == "endpoint"
    assert record.context == {
        "endpoint_config_name": deployment,
        "model_name": deployment,
        "run_id": event["config"]["run_id"],
        "action": "create",
    }


def test_deploy_endpoint_existing_endpoint_is_updated_blue_green(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    event = load_event("deploy_endpoint_task.json")
    endpoint = endpoint_name(event)
    seed_endpoint(mocked_aws, endpoint)
    updates: list[dict[str, Any]] = []
    # moto has no UpdateEndpoint; record the request instead.
    monkeypatch.setattr(sagemaker_client(), "update_endpoint", lambda **kw: updates.append(kw) or {})
    result = load_function_module("deploy_endpoint").lambda_handler(event, context)
    deployment = names.deployment_name(endpoint, event["execution_arn"], 0)
    assert result["action"] == "update"
    assert len(updates) == 1
    assert updates[0]["EndpointName"] == endpoint
    assert updates[0]["EndpointConfigName"] == deployment
    policy = updates[0]["DeploymentConfig"]["BlueGreenUpdatePolicy"]
    assert policy["TrafficRoutingConfiguration"]["Type"] == "ALL_AT_ONCE"
    assert mocked_aws.sagemaker.describe_endpoint_config(EndpointConfigName=deployment)["ProductionVariants"]
    assert store.get(endpoint).context["action"] == "update"  # type: ignore[union-attr]


def test_deploy_endpoint_rollback_alarms_from_environment(
    mocked_aws: AwsWorld, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    event = load_event("deploy_endpoint_task.json")
    seed_endpoint(mocked_aws, endpoint_name(event))
    updates: list[dict[str, Any]] = []
    monkeypatch.setattr(sagemaker_client(), "update_endpoint", lambda **kw: updates.append(kw) or {})
    monkeypatch.setenv("ENDPOINT_ROLLBACK_ALARMS", "sdflow-5xx, sdflow-latency")
    load_function_module("deploy_endpoint").lambda_handler(event, context)
    alarms = updates[0]["DeploymentConfig"]["AutoRollbackConfiguration"]["Alarms"]
    assert alarms == [{"AlarmName": "sdflow-5xx"}, {"AlarmName": "sdflow-latency"}]


def test_deploy_endpoint_reinvoked_same_attempt_creates_once(
    mocked_aws: AwsWorld, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler = load_function_module("deploy_endpoint").lambda_handler
    event = load_event("deploy_endpoint_task.json")
    handler(event, context)
    creates: list[str] = []
    monkeypatch.setattr(sagemaker_client(), "create_endpoint", lambda **kw: creates.append(kw["EndpointName"]))
    second = handler(copy.deepcopy(event), context)
    assert second["created"] is False
    assert creates == []


@pytest.mark.parametrize("status", ["Creating", "Updating", "RollingBack", "SystemUpdating"])
def test_deploy_endpoint_changing_endpoint_raises_busy_and_releases_claim(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch, status: str
) -> None:
    event = load_event("deploy_endpoint_task.json")
    endpoint = endpoint_name(event)
    monkeypatch.setattr(
        sagemaker_client(),
        "describe_endpoint",
        lambda **_kw: {"EndpointName": endpoint, "EndpointStatus": status, "EndpointConfigName": "other"},
    )
    with pytest.raises(EndpointBusy, match=status):
        load_function_module("deploy_endpoint").lambda_handler(event, context)
    assert store.get(endpoint) is None


def test_deploy_endpoint_held_by_other_run_raises_busy(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    event = load_event("deploy_endpoint_task.json")
    endpoint = endpoint_name(event)
    other = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:sdflow-pipeline-test:other-run"
    store.claim(endpoint, "other-token", other, "endpoint", {"action": "update"})
    with pytest.raises(EndpointBusy, match="other-run"):
        load_function_module("deploy_endpoint").lambda_handler(event, context)
    assert store.get(endpoint).task_token == "other-token"  # type: ignore[union-attr]


def test_deploy_endpoint_failed_endpoint_raises_with_fix(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    event = load_event("deploy_endpoint_task.json")
    endpoint = endpoint_name(event)
    monkeypatch.setattr(
        sagemaker_client(),
        "describe_endpoint",
        lambda **_kw: {"EndpointName": endpoint, "EndpointStatus": "Failed", "FailureReason": "ping failed"},
    )
    with pytest.raises(EndpointDeployFailed, match="delete-endpoint"):
        load_function_module("deploy_endpoint").lambda_handler(event, context)
    assert store.get(endpoint) is None


def test_deploy_endpoint_throttled_update_raises_and_releases_claim(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    event = load_event("deploy_endpoint_task.json")
    seed_endpoint(mocked_aws, endpoint_name(event))
    monkeypatch.setattr(sagemaker_client(), "update_endpoint", throttle)
    with pytest.raises(SageMakerThrottled):
        load_function_module("deploy_endpoint").lambda_handler(event, context)
    assert store.get(endpoint_name(event)) is None


def test_deploy_endpoint_quota_in_use_raises_quota_exceeded_and_releases_claim(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    event = load_event("deploy_endpoint_task.json")
    monkeypatch.setattr(sagemaker_client(), "create_endpoint", over_quota(limit=2, used=2, delta=1))
    with pytest.raises(SageMakerQuotaExceeded):
        load_function_module("deploy_endpoint").lambda_handler(event, context)
    assert store.get(endpoint_name(event)) is None
