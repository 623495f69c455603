"""notify: the pipeline's execution-status events → cleanup → the message a person reads, once."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

import boto3
import pytest
from moto.core.config import default_user_config

from sdflow_common import aws, execution_history, names, notify
from sdflow_common.run_cleanup import CleanupIncomplete
from sdflow_common.token_store import TokenStore
from tests.constants import ACCOUNT, REGION
from tests.helpers import load_function_module
from tests.unit.helpers import AwsWorld, FakeLambdaContext, load_event
from tests.unit.sagemaker_fake import FakeSageMakerClient, client_error

EXECUTION_ARN = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:sdflow-pipeline-test:cats-v1-abc"
STARTED = "2026-11-22T10:00:00.000Z"
STOPPED = "2026-11-22T12:14:05.000Z"
NOW = datetime(2026, 11, 23, 0, 0, 0, tzinfo=UTC)

SUCCESS_STATE: dict[str, Any] = {
    "config": {"run_id": "cats-v1-abc", "run": {"run_name": "cats-v1"}},
    "dataset": {
        "index_uri": "s3://b/runs/cats-v1-abc/dataset/index.json",
        "total_samples": 94812,
        "shards_ok": 99,
        "shards_failed": 1,
        "failed_shards": [{"shard_id": "00042", "parquet_uri": "s3://b/datasets/part-00042.parquet"}],
    },
    "training": {
        "job_name": "sdf-tr-cats-v1-0123456789-r0-a0",
        "model_data_url": "s3://b/runs/cats-v1-abc/training/job/output/model/",
        "final_metrics": {"train:loss": 0.09123},
    },
    "endpoint": {
        "endpoint_name": "cats",
        "endpoint_config_name": "cats-0123456789-r0-a0",
        "model_name": "cats-0123456789-r0-a0",
        "action": "update",
    },
}


def _request(outcome: notify.Outcome, state: dict[str, Any], **fields: Any) -> notify.NotifyRequest:
    return notify.NotifyRequest(
        outcome=outcome,
        execution_arn=EXECUTION_ARN,
        execution_name="cats-v1-abc",
        start_time=STARTED,
        stop_time=STOPPED,
        state=state,
        **fields,
    )


# ---------------------------------------------------------------------------- the message


def test_notify_success_message_names_duration_shards_loss_and_endpoint() -> None:
    message = notify.compose(_request("succeeded", SUCCESS_STATE), now=NOW)

    assert message.subject == "[sdflow] Run cats-v1 (cats-v1-abc) succeeded"
    text = message.message
    assert "SUCCEEDED in 2 h 14 min" in text
    assert "99 of 100 shards downloaded, 94,812 samples" in text
    assert "failed shard 00042: s3://b/datasets/part-00042.parquet" in text
    assert "final loss 0.0912" in text
    assert "Endpoint:  cats (updated blue/green" in text
    assert "invoke-endpoint --endpoint-name cats" in text
    assert f"#/v2/executions/details/{EXECUTION_ARN}" in text
    assert "Cleanup:" not in text
    assert "redrive" not in text
    assert message.attributes == {"outcome": "succeeded", "run_id": "cats-v1-abc", "endpoint": "cats"}


def test_notify_success_with_adherence_metrics_reports_base_and_trained_and_where_the_plots_are() -> None:
    training = {
        **SUCCESS_STATE["training"],
        "final_metrics": {"train:loss": 0.09, "eval:prompt_adherence": 0.8542, "eval:base_prompt_adherence": 0.104},
    }

    text = notify.compose(_request("succeeded", {**SUCCESS_STATE, "training": training}), now=NOW).message

    assert "prompt adherence: base 0.10 → trained 0.85 (held-out prompts)" in text
    # The uncompressed model's files are objects of their own: each plot's own URI.
    model = "s3://b/runs/cats-v1-abc/training/job/output/model/"
    assert f"loss curve {model}loss.png, samples {model}samples.png" in text
    assert f"held-out prompts {model}adherence.png" in text


def test_notify_success_with_older_model_tar_gz_says_the_plots_are_in_it() -> None:
    training = {**SUCCESS_STATE["training"], "model_data_url": "s3://b/runs/old/training/job/output/model.tar.gz"}

    text = notify.compose(_request("succeeded", {**SUCCESS_STATE, "training": training}), now=NOW).message

    assert "model s3://b/runs/old/training/job/output/model.tar.gz" in text
    assert "loss curve loss.png, samples samples.png, held-out prompts adherence.png (in it)" in text


def test_notify_success_without_adherence_metrics_prints_no_adherence_line() -> None:
    text = notify.compose(_request("succeeded", SUCCESS_STATE), now=NOW).message

    assert "prompt adherence" not in text


REGISTRY = {
    "model": {
        "model_package_arn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:model-package/sdf-cats-v1/3",
        "approval_status": "Approved",
        "prompt_adherence": 0.875,
        "base_prompt_adherence": 0.125,
        "min_prompt_adherence": 0.8,
        "prompts": 48,
        "samples_uri": "s3://b/runs/cats-v1-abc/evaluation/sdf-ev-job/adherence.png",
    }
}


def test_notify_success_with_registered_model_names_package_score_gate_and_samples() -> None:
    text = notify.compose(_request("succeeded", {**SUCCESS_STATE, "registry": REGISTRY}), now=NOW).message

    assert "Model:     arn:aws:sagemaker:us-east-1:123456789012:model-package/sdf-cats-v1/3 (Approved)" in text
    # An older run's result (flat prompt adherence only) reads as the prompt_adherence metric.
    assert "prompt_adherence ↑: base 0.12 → trained 0.88 (48 scene prompts)" in text
    assert "quality gate: prompt_adherence ≥ 0.80" in text
    assert (
        "scene prompts grid (base | trained per prompt): s3://b/runs/cats-v1-abc/evaluation/sdf-ev-job/adherence.png"
        in (text)
    )


def test_notify_quality_gate_failed_gives_score_and_suggests_a_resumed_run_not_a_redrive() -> None:
    state = {key: SUCCESS_STATE[key] for key in ("config", "dataset", "training")}
    cause = (
        "prompt adherence 0.41 is below the quality gate 0.80 (evaluation.min_prompt_adherence): model package "
        "arn:aws:sagemaker:us-east-1:123456789012:model-package/sdf-cats-v1/4 is registered as Rejected and was "
        "not deployed; endpoint cats keeps serving its current model. Samples (base | trained per prompt): "
        "s3://b/runs/cats-v1-abc/evaluation/sdf-ev-job/adherence.png"
    )

    text = notify.compose(
        _request("failed", state, error="QualityGateFailed", cause=cause, running_state="Register model"), now=NOW
    ).message

    assert "0.41 is below the quality gate 0.80" in text
    assert "adherence.png" in text
    assert f"sdflow resume {EXECUTION_ARN} --manifest NEW.json" in text
    assert "redrive-execution" not in text


def test_notify_approval_timed_out_says_how_to_approve_and_redrive() -> None:
    pending = {"model": {**REGISTRY["model"], "approval_status": "PendingManualApproval"}}
    state = {key: SUCCESS_STATE[key] for key in ("config", "dataset", "training")} | {"registry": pending}

    text = notify.compose(
        _request("failed", state, error="States.Timeout", cause="", running_state="Wait for approval"), now=NOW
    ).message

    assert "nobody approved the model in time" in text
    assert "--model-package-arn arn:aws:sagemaker:us-east-1:123456789012:model-package/sdf-cats-v1/3" in text
    assert f"redrive-execution --execution-arn {EXECUTION_ARN}" in text


def test_notify_failure_of_validation_lists_each_field_error_and_says_nothing_started() -> None:
    cause = json.dumps(
        {
            "errorType": "InvalidRunDocument",
            "errorMessage": json.dumps(
                [
                    {"field": "training.instance_count", "message": "Input should be greater than or equal to 1"},
                    {"field": "dataset.parquet_uris", "message": "is empty"},
                ]
            ),
        }
    )
    request = _request(
        "failed",
        {},
        running_state="Validate run",
        error="InvalidRunDocument",
        cause=cause,
        cleanup=["Nothing was left running."],
    )

    message = notify.compose(request, now=NOW)

    assert message.subject == "[sdflow] Run cats-v1-abc FAILED"
    assert "FAILED after 2 h 14 min, in state: Validate run." in message.message
    assert "nothing was started; fix the run document" in message.message
    assert "redrive-execution" not in message.message
    assert "Error:     InvalidRunDocument" in message.message
    assert "  - training.instance_count: Input should be greater than or equal to 1" in message.message
    assert "  - dataset.parquet_uris: is empty" in message.message
    assert message.attributes["error"] == "InvalidRunDocument"
    assert "endpoint" not in message.attributes


def test_notify_failure_during_training_names_state_cleanup_and_how_to_resume() -> None:
    state = {"config": SUCCESS_STATE["config"], "dataset": SUCCESS_STATE["dataset"]}
    cleanup = ["Stopped: 1 training job (sdf-tr-x)", "endpoint cats rolled back to config old"]
    request = _request(
        "failed",
        state,
        running_state="Train model",
        error="TrainingJobFailed",
        cause="AlgorithmError: CUDA out of memory",
        cleanup=cleanup,
        redrive_count=1,
    )

    message = notify.compose(request, now=NOW).message

    assert "FAILED after 2 h 14 min, in state: Train model. (redrive 1)" in message
    assert "AlgorithmError: CUDA out of memory" in message
    assert "99 of 100 shards downloaded" in message
    assert (
        "Cleanup:   Stopped: 1 training job (sdf-tr-x)\n           endpoint cats rolled back to config old" in message
    )
    assert f"aws stepfunctions redrive-execution --execution-arn {EXECUTION_ARN}" in message
    assert f"sdflow resume {EXECUTION_ARN}" in message


def test_notify_aborted_run_says_stopped_and_by_whom() -> None:
    request = _request(
        "aborted",
        {"config": SUCCESS_STATE["config"]},
        running_state="Download shards",
        error="UserStopped",
        cause="stopped by alice@example.com: wrong dataset",
        cleanup=["Stopped: 2 download jobs (a, b)"],
    )

    message = notify.compose(request, now=NOW)

    assert message.subject == "[sdflow] Run cats-v1 (cats-v1-abc) STOPPED"
    assert "was STOPPED after 2 h 14 min (StopExecution), in state: Download shards." in message.message
    assert "Stopped by / because: stopped by alice@example.com: wrong dataset" in message.message
    assert message.attributes["outcome"] == "aborted"


def test_notify_aborted_by_local_cloud_stop_says_so_and_offers_no_redrive() -> None:
    request = _request(
        "aborted",
        {"config": SUCCESS_STATE["config"]},
        running_state="Train model",
        error=notify.LOCAL_CLOUD_STOPPED,
        cause="The local cloud stopped while this run was running.",
    )

    message = notify.compose(request, now=NOW).message

    assert "(the local cloud stopped), in state: Train model." in message
    assert "StopExecution" not in message
    assert "redrive-execution" not in message
    assert "sdflow resume" not in message
    assert "start the local cloud again (sdflow local up) and start the run anew" in message


def test_notify_aborted_without_cause_says_no_reason_was_given() -> None:
    message = notify.compose(_request("aborted", {}, running_state="Train model"), now=NOW).message

    assert "Stopped by a StopExecution call that gave no error or cause." in message
    assert "UnknownError" not in message


def test_notify_timed_out_run_says_it_exceeded_its_time_limit() -> None:
    message = notify.compose(_request("timed_out", {}, running_state="Train model"), now=NOW)

    assert message.subject.endswith("TIMED OUT")
    assert "TIMED OUT after 2 h 14 min: the run exceeded its time limit" in message.message
    assert "Error:     States.Timeout" in message.message
    assert message.attributes["error"] == "States.Timeout"


def test_notify_very_long_cause_is_truncated_and_subject_fits_sns_limit() -> None:
    request = notify.NotifyRequest(
        outcome="failed",
        execution_arn=EXECUTION_ARN,
        execution_name="z" * 80,
        start_time=STARTED,
        state={"config": {"run_id": "z", "run": {"run_name": "x" * 40}}},
        error="States.Timeout",
        cause="y" * 10_000,
    )

    message = notify.compose(request, now=NOW)

    assert len(message.subject) <= notify.SUBJECT_LIMIT
    assert len(message.message) < notify.CAUSE_LIMIT + 1500


@pytest.mark.parametrize(
    "document_keys",
    [
        {"training": {"instance_count": 0}, "dataset": {"prefix": "s3://b/x/"}},
        {"dataset": {"parquet_uris": []}},
        {"config": {"run": {"run_name": "x\ny"}}, "endpoint": {"name": "e"}},
    ],
)
def test_notify_validation_failure_with_document_keys_in_state_names_validate_run_and_no_progress(
    document_keys: dict[str, Any],
) -> None:
    """Keys a run document shares with the pipeline's results (training, dataset, config, endpoint) are
    not progress: only what the steps wrote counts, and lines without data are left out. With no
    state named by the history, the step is judged from the results."""
    message = notify.compose(_request("failed", document_keys, error="InvalidRunDocument", cause="[]"), now=NOW)

    assert "in state: Validate run" in message.message
    for placeholder in ("0 of 0 shards", "job ?", "Dataset:", "Training:", "Endpoint:", "config ?"):
        assert placeholder not in message.message
    assert "endpoint" not in message.attributes
    assert message.subject == "[sdflow] Run cats-v1-abc FAILED"


def test_notify_subject_of_any_execution_name_is_a_valid_sns_subject() -> None:
    request = notify.NotifyRequest(
        outcome="failed", execution_arn=EXECUTION_ARN, execution_name="caf\u00e9-\u2028-" + "\u00fc" * 90
    )

    subject = notify.compose(request, now=NOW).subject

    assert len(subject) < 100
    assert subject.isascii()
    assert subject.isprintable()


def test_notify_tolerated_intake_warnings_are_listed() -> None:
    warning = {"field": "dataset.url_column", "message": "column 'URL' is not in 1 of 3 objects (s3://b/p2.parquet)"}
    state = {**SUCCESS_STATE, "config": {**SUCCESS_STATE["config"], "warnings": [warning]}}

    message = notify.compose(_request("succeeded", state), now=NOW)

    assert "dataset.url_column: column 'URL' is not in 1 of 3 objects (s3://b/p2.parquet)" in message.message


@pytest.mark.parametrize(
    ("event_file", "outcome"),
    [
        ("stepfunctions_execution_succeeded.json", "succeeded"),
        ("stepfunctions_execution_failed.json", "failed"),
        ("stepfunctions_execution_timed_out.json", "timed_out"),
        ("stepfunctions_execution_aborted.json", "aborted"),
    ],
)
def test_notify_sample_event_parses_with_its_outcome_and_dates(event_file: str, outcome: notify.Outcome) -> None:
    change = notify.ExecutionStatusChange.model_validate(load_event(event_file))

    assert change.detail.outcome == outcome
    request = notify.NotifyRequest.from_event(change.detail)
    assert request.start_time == "2026-11-22T10:00:00Z"
    assert names.run_hash(change.detail.execution_arn, change.detail.start_date) == names.run_hash(
        EXECUTION_ARN, request.start_time
    )


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
