"""Step Functions: each attempt of a `.waitForTaskToken` task has its own task token, dead once it ends."""

from __future__ import annotations

import json
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdflow.local import runtime as runtime_module
from sdflow.local.stepfunctions.tokens import TASK_TIMED_OUT_MESSAGE
from tests.unit.local.helpers import ROLE, client, wait_for
from tests.unit.local.machines import finished


def _start_waiting_task(**fields: Any) -> tuple[str, str]:
    """Starts a machine whose only task hands its token over SQS; returns (execution, queue URL)."""
    sfn, sqs = client("stepfunctions"), client("sqs")
    queue_url = sqs.create_queue(QueueName="tokens")["QueueUrl"]
    wait = {
        "Type": "Task",
        "Resource": "arn:aws:states:::sqs:sendMessage.waitForTaskToken",
        "Parameters": {
            "QueueUrl": queue_url,
            "MessageBody": {"token.$": "$$.Task.Token", "attempt.$": "$$.State.RetryCount"},
        },
        "End": True,
        **fields,
    }
    definition = json.dumps({"StartAt": "Wait", "States": {"Wait": wait}})
    machine = sfn.create_state_machine(name="m", definition=definition, roleArn=ROLE)["stateMachineArn"]
    return sfn.start_execution(stateMachineArn=machine, name="x", input="{}")["executionArn"], queue_url


def _next_message(queue_url: str) -> dict[str, Any]:
    sqs = client("sqs")
    messages = wait_for(lambda: sqs.receive_message(QueueUrl=queue_url).get("Messages"), what="a task token")
    sqs.delete_message(QueueUrl=queue_url, ReceiptHandle=messages[0]["ReceiptHandle"])
    return dict(json.loads(messages[0]["Body"]))


RETRY_ONCE = [{"ErrorEquals": ["DownloadJobFailed"], "IntervalSeconds": 1, "MaxAttempts": 1}]


def test_moto_gap_retry_reuses_the_first_attempts_token(aws: None) -> None:
    execution, queue_url = _start_waiting_task(Retry=RETRY_ONCE)
    first = _next_message(queue_url)
    client("stepfunctions").send_task_failure(taskToken=first["token"], error="DownloadJobFailed", cause="killed")
    second = _next_message(queue_url)
    assert second["token"] == first["token"]
    assert finished(execution)["status"] == "FAILED", "the retry answered with the stored failure at once"


def test_patch_each_retry_attempt_gets_a_fresh_token(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    execution, queue_url = _start_waiting_task(Retry=RETRY_ONCE)
    first = _next_message(queue_url)
    sfn.send_task_failure(taskToken=first["token"], error="DownloadJobFailed", cause="killed")
    second = _next_message(queue_url)
    assert (first["attempt"], second["attempt"]) == (0, 1)
    assert second["token"] != first["token"]
    assert sfn.describe_execution(executionArn=execution)["status"] == "RUNNING", "the retry waits for its own token"

    with pytest.raises(ClientError) as late:
        sfn.send_task_success(taskToken=first["token"], output=json.dumps({"late": True}))
    assert late.value.response["Error"]["Code"] == "TaskTimedOut"
    assert TASK_TIMED_OUT_MESSAGE in str(late.value)

    sfn.send_task_success(taskToken=second["token"], output=json.dumps({"shard": "ok"}))
    described = finished(execution)
    assert described["status"] == "SUCCEEDED"
    assert json.loads(described["output"]) == {"shard": "ok"}


def test_patch_token_of_a_timed_out_attempt_is_dead(runtime: runtime_module.Runtime) -> None:
    execution, queue_url = _start_waiting_task(TimeoutSeconds=1)
    token = _next_message(queue_url)["token"]
    assert finished(execution)["error"] == "States.Timeout"
    with pytest.raises(ClientError) as late:
        client("stepfunctions").send_task_success(taskToken=token, output="{}")
    assert late.value.response["Error"]["Code"] == "TaskTimedOut"


def test_patch_second_answer_to_a_token_is_refused(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    execution, queue_url = _start_waiting_task()
    token = _next_message(queue_url)["token"]
    sfn.send_task_success(taskToken=token, output=json.dumps({"first": True}))
    assert json.loads(finished(execution)["output"]) == {"first": True}
    for answer in (
        lambda: sfn.send_task_success(taskToken=token, output="{}"),
        lambda: sfn.send_task_failure(taskToken=token, error="E", cause="c"),
        lambda: sfn.send_task_heartbeat(taskToken=token),
    ):
        with pytest.raises(ClientError) as refused:
            answer()
        assert refused.value.response["Error"]["Code"] == "TaskTimedOut"


def test_patch_unknown_token_is_invalid(runtime: runtime_module.Runtime) -> None:
    with pytest.raises(ClientError) as refused:
        client("stepfunctions").send_task_success(taskToken="never-issued", output="{}")
    assert refused.value.response["Error"]["Code"] == "InvalidToken"


def test_patch_heartbeat_on_an_open_task_without_heartbeat_seconds_is_accepted(
    runtime: runtime_module.Runtime,
) -> None:
    sfn = client("stepfunctions")
    execution, queue_url = _start_waiting_task()
    token = _next_message(queue_url)["token"]
    sfn.send_task_heartbeat(taskToken=token)
    sfn.send_task_success(taskToken=token, output="{}")
    assert finished(execution)["status"] == "SUCCEEDED"
