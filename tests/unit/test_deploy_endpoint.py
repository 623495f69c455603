"""deploy_endpoint: CreateModel from the approved package, then CreateEndpoint or a blue/green
UpdateEndpoint; the endpoint's claim, adoption of an earlier attempt's rollout, and the errors
the state retries."""

from __future__ import annotations

import copy
from typing import Any

# The X-Ray SDK opens its UDP emitter's socket on first import (Tracer() triggers it); import it
# here, at collection, before the unit fixtures block sockets.
import aws_xray_sdk.core  # noqa: F401
import pytest

from sdflow_common import names
from sdflow_common.errors import EndpointBusy, EndpointDeployFailed, SageMakerQuotaExceeded, SageMakerThrottled
from sdflow_common.token_store import TokenStore
from tests.constants import ACCOUNT, REGION
from tests.helpers import load_function_module
from tests.unit.helpers import TRAINING_IMAGE_URI, AwsWorld, FakeLambdaContext, load_event
from tests.unit.job_requests import over_quota, run_hash, sagemaker_client, tags_of, throttle


@pytest.fixture(autouse=True)
def running_execution(events_execution: str) -> str:
    return events_execution


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
    deployment = names.deployment_name(endpoint, run_hash(event), 0, 0)
    assert result["action"] == "create"
    assert result["endpoint_config_name"] == deployment
    described = mocked_aws.sagemaker.describe_endpoint(EndpointName=endpoint)
    assert described["EndpointConfigName"] == deployment
    model = mocked_aws.sagemaker.describe_model(ModelName=deployment)
    # The model comes from the approved package, not straight from the training artifact.
    assert model["PrimaryContainer"]["ModelPackageName"] == event["model"]["model_package_arn"]
    record = store.get(endpoint)
    assert record is not None
    assert record.kind == "endpoint"
    assert record.context == {
        "endpoint_config_name": deployment,
        "model_name": deployment,
        "run_id": event["config"]["run_id"],
        "action": "create",
    }
    for arn in (described["EndpointArn"], model["ModelArn"]):
        assert tags_of(mocked_aws, arn)["sdflow:run"] == run_hash(event)


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
    deployment = names.deployment_name(endpoint, run_hash(event), 0, 0)
    assert result["action"] == "update"
    assert len(updates) == 1
    assert updates[0]["EndpointName"] == endpoint
    assert updates[0]["EndpointConfigName"] == deployment
    policy = updates[0]["DeploymentConfig"]["BlueGreenUpdatePolicy"]
    assert policy["TrafficRoutingConfiguration"]["Type"] == "ALL_AT_ONCE"
    assert mocked_aws.sagemaker.describe_endpoint_config(EndpointConfigName=deployment)["ProductionVariants"]
    claimed = store.get(endpoint).context  # type: ignore[union-attr]
    # What a rollback restores if the run ends without succeeding.
    assert (claimed["action"], claimed["previous_endpoint_config"]) == ("update", "previous-config")


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


def test_deploy_endpoint_retry_after_crash_adopts_the_earlier_attempts_rollout(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attempt 0 died after CreateEndpoint (Runtime.ExitError; its claim stays): attempt 1 takes
    the creating endpoint over instead of waiting to update it a second time."""
    handler = load_function_module("deploy_endpoint").lambda_handler
    event = load_event("deploy_endpoint_task.json")
    handler(event, context)
    endpoint = endpoint_name(event)
    first_config = names.deployment_name(endpoint, run_hash(event), 0, 0)
    monkeypatch.setattr(
        sagemaker_client(),
        "describe_endpoint",
        lambda **_kw: {"EndpointName": endpoint, "EndpointStatus": "Creating", "EndpointConfigName": first_config},
    )
    retry = {**copy.deepcopy(event), "attempt": 1, "token": "token-of-attempt-1"}

    result = handler(retry, context)

    assert result == {
        "resource_name": endpoint,
        "endpoint_config_name": first_config,
        "created": False,
        "adopted": True,
    }
    record = store.get(endpoint)
    assert record is not None
    assert record.task_token == "token-of-attempt-1"
    assert record.context["endpoint_config_name"] == first_config
    assert record.context["action"] == "create"


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
    store.claim(endpoint, "other-token", other, "endpoint", {"action": "update"}, timeout_seconds=3600)
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
