"""Step Functions on the local cloud's clock: Retry, Wait, TimeoutSeconds and HeartbeatSeconds
play out in moments, with the history stamped in the clock's time."""

from __future__ import annotations

import inspect
import json
import time
from typing import Any

from sdflow.local import runtime as runtime_module
from sdflow.local.clock import Clock
from tests.unit.local.helpers import ROLE, client, wait_for


def _machine(states: dict[str, Any], start: str) -> str:
    definition = json.dumps({"StartAt": start, "States": states})
    return str(
        client("stepfunctions").create_state_machine(name="clocked", definition=definition, roleArn=ROLE)[
            "stateMachineArn"
        ]
    )


def _ended(arn: str) -> dict[str, Any]:
    sfn = client("stepfunctions")
    return dict(
        wait_for(lambda: (d := sfn.describe_execution(executionArn=arn))["status"] != "RUNNING" and d, "the end")
    )


def _history(arn: str) -> list[dict[str, Any]]:
    return list(client("stepfunctions").get_execution_history(executionArn=arn, maxResults=1000)["events"])


def _pending(clock: Clock, what: str) -> None:
    wait_for(lambda: any(what in p.what for p in clock.pending()), f"a pending {what}")


def _token_task(**extra: Any) -> tuple[str, str]:
    sqs = client("sqs")
    queue_url = str(sqs.create_queue(QueueName="tokens")["QueueUrl"])
    task = {
        "Type": "Task",
        "Resource": "arn:aws:states:::sqs:sendMessage.waitForTaskToken",
        "Parameters": {"QueueUrl": queue_url, "MessageBody": {"token.$": "$$.Task.Token"}},
        "End": True,
        **extra,
    }
    machine = _machine({"Wait for job": task}, "Wait for job")
    return machine, queue_url


# ------------------------------------------------------------------ moto's waits, as the patches assume


def test_moto_gap_retrier_sleeps_with_time_sleep() -> None:
    from moto.stepfunctions.parser.asl.component.common.retry.retrier_decl import RetrierDecl

    assert "time.sleep(interval_seconds)" in inspect.getsource(RetrierDecl._eval_body)


def test_moto_gap_timeout_waits_on_module_threading_event() -> None:
    from moto.stepfunctions.parser.asl.component.state.exec.execute_state import ExecutionState

    source = inspect.getsource(ExecutionState._evaluate_with_timeout)
    assert "threading.Event()" in source
    assert "terminated_event.wait(timeout_seconds)" in source


def test_moto_gap_callback_endpoints_wait_on_module_event() -> None:
    from moto.stepfunctions.parser.asl.eval.callback import callback

    assert "self._notify_event = Event()" in inspect.getsource(callback.CallbackEndpoint.__init__)
    assert "self._next_heartbeat_event = Event()" in inspect.getsource(callback.HeartbeatEndpoint.__init__)


def test_moto_gap_wait_state_and_history_read_the_wall_clock() -> None:
    from moto.stepfunctions.parser import models
    from moto.stepfunctions.parser.asl.component.state.wait.wait_function.timestamp import Timestamp
    from moto.stepfunctions.parser.asl.component.state.wait.wait_function.wait_function import WaitFunction
    from moto.stepfunctions.parser.asl.eval.event.event_manager import EventManager

    assert "env.program_state_event.wait(wait_seconds)" in inspect.getsource(WaitFunction._wait_interval)
    assert "datetime.datetime.now()" in inspect.getsource(Timestamp._get_wait_seconds)
    assert "datetime.datetime.now(tz=datetime.timezone.utc)" in inspect.getsource(EventManager._get_current_timestamp)
    # models.py uses its `datetime` import for StartExecution's startDate and nothing else.
    uses = [line.strip() for line in inspect.getsource(models).splitlines() if "datetime." in line]
    assert uses == ["start_date=datetime.datetime.now(tz=datetime.timezone.utc),"]


# ------------------------------------------------------------------ the patches


def test_patch_retry_interval_of_an_hour_plays_out_on_scaled_clock(runtime: runtime_module.Runtime) -> None:
    runtime.clock = Clock(scale=36_000)
    branch = {"StartAt": "Boom", "States": {"Boom": {"Type": "Fail", "Error": "CapacityError", "Cause": "none"}}}
    retry = [{"ErrorEquals": ["CapacityError"], "IntervalSeconds": 3600, "MaxAttempts": 1}]
    machine = _machine({"Train": {"Type": "Parallel", "Branches": [branch], "Retry": retry, "End": True}}, "Train")
    started = time.monotonic()
    arn = client("stepfunctions").start_execution(stateMachineArn=machine, name="retry")["executionArn"]
    ended = _ended(arn)
    assert time.monotonic() - started < 15
    assert ended["status"] == "FAILED"
    assert ended["error"] == "CapacityError"
    attempts = [e["timestamp"] for e in _history(arn) if e["type"] == "ParallelStateStarted"]
    assert len(attempts) == 2
    assert (attempts[1] - attempts[0]).total_seconds() >= 3600  # the history tells the clock's time
    assert (ended["stopDate"] - ended["startDate"]).total_seconds() >= 3600


def test_patch_wait_state_of_a_day_ends_when_clock_advances(runtime: runtime_module.Runtime) -> None:
    clock = runtime.clock
    machine = _machine({"Wait a day": {"Type": "Wait", "Seconds": 86_400, "End": True}}, "Wait a day")
    arn = client("stepfunctions").start_execution(stateMachineArn=machine, name="wait")["executionArn"]
    _pending(clock, "Wait state")
    assert client("stepfunctions").describe_execution(executionArn=arn)["status"] == "RUNNING"
    clock.advance(86_400)
    ended = _ended(arn)
    assert ended["status"] == "SUCCEEDED"
    assert (ended["stopDate"] - ended["startDate"]).total_seconds() >= 86_400


def test_patch_wait_state_until_timestamp_counts_from_clock_now(runtime: runtime_module.Runtime) -> None:
    clock = runtime.clock
    clock.advance(2 * 86_400)  # a timestamp one day ahead of the wall clock is a day in the past here
    tomorrow = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 86_400))
    machine = _machine({"Wait until": {"Type": "Wait", "Timestamp": tomorrow, "End": True}}, "Wait until")
    arn = client("stepfunctions").start_execution(stateMachineArn=machine, name="until")["executionArn"]
    assert _ended(arn)["status"] == "SUCCEEDED"


def test_patch_task_token_timeout_fires_when_clock_passes_it(runtime: runtime_module.Runtime) -> None:
    clock = runtime.clock
    machine, queue_url = _token_task(TimeoutSeconds=7 * 86_400)
    arn = client("stepfunctions").start_execution(stateMachineArn=machine, name="timeout")["executionArn"]
    wait_for(lambda: client("sqs").receive_message(QueueUrl=queue_url).get("Messages"), "the task token")
    _pending(clock, "TimeoutSeconds")
    assert clock.advance_to_next(what="TimeoutSeconds") is not None
    ended = _ended(arn)
    assert ended["status"] == "FAILED"
    assert ended["error"] == "States.Timeout"


def test_patch_heartbeat_timeout_fires_when_clock_passes_it(runtime: runtime_module.Runtime) -> None:
    clock = runtime.clock
    machine, queue_url = _token_task(TimeoutSeconds=86_400, HeartbeatSeconds=600)
    arn = client("stepfunctions").start_execution(stateMachineArn=machine, name="heartbeat")["executionArn"]
    wait_for(lambda: client("sqs").receive_message(QueueUrl=queue_url).get("Messages"), "the task token")
    _pending(clock, "heartbeat")
    clock.advance(601)
    ended = _ended(arn)
    assert ended["status"] == "FAILED"
    # The heartbeat ended it, a day before TimeoutSeconds. (moto 5.2.5 names a heartbeat
    # timeout States.Timeout where AWS says States.HeartbeatTimeout; the pipeline sets no
    # HeartbeatSeconds, so that gap is left as it is.)
    assert ended["error"] == "States.Timeout"
    assert 600 <= (ended["stopDate"] - ended["startDate"]).total_seconds() < 86_400
