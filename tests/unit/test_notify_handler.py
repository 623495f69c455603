"""notify's handler: the execution's history read back (moto's interpreter runs real executions), then the
cleanup and the one publication of a run's end."""

from __future__ import annotations

import json
import time
from typing import Any

import boto3
import pytest
from moto.core.config import default_user_config

from sdflow_common import aws, execution_history, names
from sdflow_common.run_cleanup import CleanupIncomplete
from sdflow_common.token_store import TokenStore
from tests.constants import REGION
from tests.helpers import load_function_module
from tests.unit.helpers import AwsWorld, FakeLambdaContext, load_event
from tests.unit.sagemaker_fake import FakeSageMakerClient, client_error

# ---------------------------------------------------------------------------- the execution history


FAILING_MACHINE = {
    "StartAt": "Validate run",
    "States": {
        "Validate run": {
            "Type": "Pass",
            "Result": {"run_id": "cats-v1-abc", "run": {"run_name": "cats-v1"}},
            "ResultPath": "$.config",
            "Next": "Download shards",
        },
        "Download shards": {
            "Type": "Map",
            "ItemsPath": "$.shards",
            "ResultPath": None,
            "ItemProcessor": {
                "StartAt": "Download shard",
                "States": {"Download shard": {"Type": "Pass", "Result": {"x": 1}, "End": True}},
            },
            "Next": "Build dataset index",
        },
        "Build dataset index": {
            "Type": "Pass",
            "Result": {"index_uri": "s3://b/i.json", "shards_ok": 2, "shards_failed": 0, "total_samples": 10},
            "ResultPath": "$.dataset",
            "Next": "Wait for training",
        },
        "Wait for training": {"Type": "Wait", "SecondsPath": "$.wait", "Next": "Train model"},
        "Train model": {"Type": "Fail", "Error": "TrainingJobFailed", "Cause": "AlgorithmError: CUDA out of memory"},
    },
}


class NewestFirst:
    """moto 5.2.5's GetExecutionHistory ignores reverseOrder (its responses.py passes only the ARN;
    the local cloud's sdflow/local/stepfunctions/api.py fixes it): this client answers as AWS does, newest first."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def get_execution_history(self, **params: Any) -> dict[str, Any]:
        newest_first = params.pop("reverseOrder", False)
        page = dict(self.client.get_execution_history(**params))
        if newest_first:
            page["events"] = list(reversed(page["events"]))
        return page


@pytest.fixture
def executing(mocked_aws: AwsWorld, monkeypatch: pytest.MonkeyPatch) -> AwsWorld:
    """moto's Step Functions interpreter runs the executions (real histories)."""
    monkeypatch.setitem(default_user_config, "stepfunctions", {"execute_state_machine": True})
    mocked_aws.sfn = NewestFirst(mocked_aws.sfn)
    _route(monkeypatch, "stepfunctions", NewestFirst)
    return mocked_aws


def _route(monkeypatch: pytest.MonkeyPatch, service: str, wrap: Any) -> None:
    """The functions' `aws.client(service)` answers `wrap(the real client)`."""
    real = aws.client

    def client(name: str) -> Any:
        return wrap(real(name)) if name == service else real(name)

    client.cache_clear = real.cache_clear  # type: ignore[attr-defined]  # conftest resets clients on teardown
    monkeypatch.setattr(aws, "client", client)


def _run(world: AwsWorld, wait: int, *, stop: bool = False) -> dict[str, Any]:
    iam = boto3.client("iam", region_name=REGION)
    role = iam.create_role(RoleName="sfn", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    machine = world.sfn.create_state_machine(
        name="sdflow-pipeline-test", definition=json.dumps(FAILING_MACHINE), roleArn=role
    )
    arn = world.sfn.start_execution(
        stateMachineArn=machine["stateMachineArn"],
        name="cats-v1-abc",
        input=json.dumps({"wait": wait, "shards": [1, 2, 3]}),
    )["executionArn"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        described = world.sfn.describe_execution(executionArn=arn)
        if stop and any(
            e["type"] == "WaitStateEntered" for e in world.sfn.get_execution_history(executionArn=arn)["events"]
        ):
            world.sfn.stop_execution(executionArn=arn, error="UserStopped", cause="stopped by alice")
            stop = False
        if described["status"] != "RUNNING":
            return dict(described)
        time.sleep(0.05)
    raise AssertionError("the execution did not end")


def test_read_history_of_a_failed_execution_names_the_state_and_its_input(executing: AwsWorld) -> None:
    described = _run(executing, wait=0)

    history = execution_history.read_history(executing.sfn, described["executionArn"])

    assert described["status"] == "FAILED"
    assert history.running_state == "Train model"
    assert history.state["dataset"]["index_uri"] == "s3://b/i.json"
    assert history.state["config"]["run_id"] == "cats-v1-abc"
    assert (history.error, history.cause) == ("TrainingJobFailed", "AlgorithmError: CUDA out of memory")


def test_read_history_of_a_stopped_execution_names_the_waiting_state(executing: AwsWorld) -> None:
    described = _run(executing, wait=30, stop=True)

    history = execution_history.read_history(executing.sfn, described["executionArn"])

    assert described["status"] == "ABORTED"
    assert history.running_state == "Wait for training"
    assert history.state["dataset"]["shards_ok"] == 2


# ---------------------------------------------------------------------------- the handler


def _subscribe_queue(world: AwsWorld) -> tuple[Any, str]:
    sqs = boto3.client("sqs", region_name=REGION)
    queue_url = sqs.create_queue(QueueName="notifications")["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    world.sns.subscribe(TopicArn=world.topic_arn, Protocol="sqs", Endpoint=queue_arn)
    return sqs, queue_url


def _received(sqs: Any, queue_url: str) -> list[dict[str, Any]]:
    messages = sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10).get("Messages", [])
    return [json.loads(m["Body"]) for m in messages]


@pytest.fixture
def lambda_context() -> FakeLambdaContext:
    return FakeLambdaContext(function_name="notify")


@pytest.fixture
def fake_sagemaker(monkeypatch: pytest.MonkeyPatch, mocked_aws: AwsWorld) -> FakeSageMakerClient:
    fake = FakeSageMakerClient()
    _route(monkeypatch, "sagemaker", lambda _real: fake)
    return fake


def _event_for(described: dict[str, Any], sample: str) -> dict[str, Any]:
    """The sample event, for the execution moto actually ran."""
    event = load_event(sample)
    start_ms = names.start_millis(described["startDate"])
    event["detail"].update(
        executionArn=described["executionArn"], stateMachineArn=described["stateMachineArn"], startDate=start_ms
    )
    event["resources"] = [described["executionArn"]]
    return event


def _start_training_job(store: TokenStore, sagemaker: FakeSageMakerClient, execution_arn: str, job: str) -> None:
    """The run's training job as its starter leaves it: claimed, then created."""
    store.claim(job, "token-train", execution_arn, "training", timeout_seconds=3600)
    sagemaker.add_job("training", job)


def test_notify_handler_failed_run_stops_its_jobs_then_publishes_once(
    executing: AwsWorld, fake_sagemaker: FakeSageMakerClient, lambda_context: FakeLambdaContext, store: TokenStore
) -> None:
    sqs, queue_url = _subscribe_queue(executing)
    described = _run(executing, wait=0)
    run_hash = names.run_hash(described["executionArn"], described["startDate"])
    job = names.training_job_name(run_hash, "cats-v1-abc", 0, 0)
    _start_training_job(store, fake_sagemaker, described["executionArn"], job)
    event = _event_for(described, "stepfunctions_execution_failed.json")
    handler = load_function_module("notify").lambda_handler

    first = handler(event, lambda_context)
    second = handler(event, lambda_context)

    assert first == second, "a duplicate event returns the first result"
    assert fake_sagemaker.jobs["training"][job] == "Stopping"
    assert len(fake_sagemaker.called("StopTrainingJob")) == 1
    [published] = _received(sqs, queue_url)
    text = published["Message"]
    assert published["Subject"] == "[sdflow] Run cats-v1 (cats-v1-abc) FAILED"
    assert "in state: Train model." in text
    assert f"Stopped: 1 training job ({job})" in text
    assert "CUDA out of memory" in text
    assert "redrive-execution" in text
    assert published["MessageAttributes"]["error"]["Value"] == "TrainingJobFailed"


def test_notify_handler_cleanup_error_publishes_once_raises_and_the_retry_finishes(
    executing: AwsWorld, fake_sagemaker: FakeSageMakerClient, lambda_context: FakeLambdaContext, store: TokenStore
) -> None:
    sqs, queue_url = _subscribe_queue(executing)
    described = _run(executing, wait=0)
    job = names.training_job_name(
        names.run_hash(described["executionArn"], described["startDate"]), "cats-v1-abc", 0, 0
    )
    _start_training_job(store, fake_sagemaker, described["executionArn"], job)
    fake_sagemaker.fail_next(
        "StopTrainingJob", job, client_error("ThrottlingException", "Rate exceeded", "StopTrainingJob")
    )
    event = _event_for(described, "stepfunctions_execution_failed.json")
    handler = load_function_module("notify").lambda_handler

    with pytest.raises(CleanupIncomplete, match=job):
        handler(event, lambda_context)
    retried = handler(event, lambda_context)

    assert fake_sagemaker.jobs["training"][job] == "Stopping"
    assert retried["stopped"] == 1
    [published] = _received(sqs, queue_url)
    assert f"NOT cleaned up: training job {job} is still running" in published["Message"]


def test_notify_handler_success_event_publishes_the_output_without_cleanup(
    mocked_aws: AwsWorld, fake_sagemaker: FakeSageMakerClient, lambda_context: FakeLambdaContext
) -> None:
    sqs, queue_url = _subscribe_queue(mocked_aws)
    handler = load_function_module("notify").lambda_handler

    result = handler(load_event("stepfunctions_execution_succeeded.json"), lambda_context)

    assert fake_sagemaker.calls == []
    [published] = _received(sqs, queue_url)
    assert published["Subject"] == "[sdflow] Run cats-v1 (cats-v1-abc) succeeded"
    assert "SUCCEEDED in 2 h 14 min" in published["Message"]
    assert "Endpoint:  sdflow-cats (created" in published["Message"]
    assert result["status"] == "SUCCEEDED"


def test_notify_handler_running_status_is_ignored(
    mocked_aws: AwsWorld, fake_sagemaker: FakeSageMakerClient, lambda_context: FakeLambdaContext
) -> None:
    sqs, queue_url = _subscribe_queue(mocked_aws)
    event = load_event("stepfunctions_execution_succeeded.json")
    event["detail"].update(status="RUNNING", stopDate=None, output=None)

    result = load_function_module("notify").lambda_handler(event, lambda_context)

    assert result == {"ignored": "RUNNING"}
    assert _received(sqs, queue_url) == []


def test_notify_handler_event_without_token_table_names_the_variable(
    mocked_aws: AwsWorld, monkeypatch: pytest.MonkeyPatch, lambda_context: FakeLambdaContext
) -> None:
    monkeypatch.delenv("TOKEN_TABLE")
    handler = load_function_module("notify").lambda_handler

    with pytest.raises(RuntimeError, match="TOKEN_TABLE"):
        handler(load_event("stepfunctions_execution_aborted.json"), lambda_context)
