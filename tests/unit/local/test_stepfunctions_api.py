"""Step Functions API semantics (sdflow/local/stepfunctions/api.py, executions.py, map_runs.py, maprun.py):
StopExecution, Map Run child executions, history paging and the status-change events."""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdflow.local import runtime as runtime_module
from sdflow.local.stepfunctions import core, shutdown
from tests.constants import ACCOUNT, REGION
from tests.unit.local.helpers import ROLE, client, wait_for

CHILD_ARN = re.compile(rf"^arn:aws:states:{REGION}:{ACCOUNT}:execution:m/shards:[0-9a-f-]{{36}}$")


def _machine(definition: dict[str, Any], name: str = "m") -> str:
    sfn = client("stepfunctions")
    return str(sfn.create_state_machine(name=name, definition=json.dumps(definition), roleArn=ROLE)["stateMachineArn"])


def _queue(name: str) -> str:
    return str(client("sqs").create_queue(QueueName=name)["QueueUrl"])


def _wait_task(queue_url: str) -> dict[str, Any]:
    """A waitForTaskToken task handing its token (and the Map item, if any) over through SQS."""
    return {
        "Type": "Task",
        "Resource": "arn:aws:states:::sqs:sendMessage.waitForTaskToken",
        "Parameters": {"QueueUrl": queue_url, "MessageBody": {"token.$": "$$.Task.Token", "item.$": "$"}},
        "TimeoutSeconds": 60,
        "End": True,
    }


def _tokens(queue_url: str, count: int) -> list[str]:
    found: list[str] = []

    def poll() -> bool:
        messages = client("sqs").receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10).get("Messages", [])
        found.extend(json.loads(m["Body"])["token"] for m in messages)
        return len(found) >= count

    wait_for(poll, what=f"{count} task tokens")
    return found


def _distributed_map(processor_states: dict[str, Any], start_at: str, concurrency: int) -> dict[str, Any]:
    return {
        "StartAt": "Shards",
        "States": {
            "Shards": {
                "Type": "Map",
                "Label": "shards",
                "ItemsPath": "$.items",
                "MaxConcurrency": concurrency,
                "ItemProcessor": {
                    "ProcessorConfig": {"Mode": "DISTRIBUTED", "ExecutionType": "STANDARD"},
                    "StartAt": start_at,
                    "States": processor_states,
                },
                "ResultPath": None,
                "End": True,
            }
        },
    }


def _ended(arn: str) -> dict[str, Any]:
    sfn = client("stepfunctions")
    return dict(
        wait_for(
            lambda: (d := sfn.describe_execution(executionArn=arn))["status"] != "RUNNING" and d,
            what="the execution to end",
        )
    )


def _error_code(call: Any, **kwargs: Any) -> str:
    with pytest.raises(ClientError) as raised:
        call(**kwargs)
    return str(raised.value.response["Error"]["Code"])


# ---------------------------------------------------------------- StopExecution


def test_stop_execution_waiting_task_aborts_at_once_keeping_error_and_cause(runtime: runtime_module.Runtime) -> None:
    sfn, queue_url = client("stepfunctions"), _queue("tokens")
    machine = _machine({"StartAt": "Wait", "States": {"Wait": _wait_task(queue_url)}})
    arn = sfn.start_execution(stateMachineArn=machine, name="x", input="{}")["executionArn"]
    (token,) = _tokens(queue_url, 1)

    stopped = sfn.stop_execution(executionArn=arn, error="OperatorStop", cause="stopped by hand")
    described = sfn.describe_execution(executionArn=arn)

    assert described["status"] == "ABORTED"
    assert described["stopDate"] == stopped["stopDate"]
    assert (described["error"], described["cause"]) == ("OperatorStop", "stopped by hand")
    last = sfn.get_execution_history(executionArn=arn, reverseOrder=True, maxResults=1)["events"][0]
    assert last["type"] == "ExecutionAborted"
    assert last["executionAbortedEventDetails"] == {"error": "OperatorStop", "cause": "stopped by hand"}
    assert _error_code(sfn.send_task_success, taskToken=token, output="{}") == "TaskTimedOut"
    assert _error_code(sfn.send_task_failure, taskToken=token, error="E") == "TaskTimedOut"
    time.sleep(0.3)  # the interrupted thread ends: the record keeps what StopExecution set
    assert sfn.describe_execution(executionArn=arn)["stopDate"] == stopped["stopDate"]
    events = sfn.get_execution_history(executionArn=arn)["events"]
    assert [e["type"] for e in events].count("ExecutionAborted") == 1
    assert events[-1]["type"] == "ExecutionAborted"


def test_stop_execution_finished_execution_changes_nothing(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    machine = _machine({"StartAt": "P", "States": {"P": {"Type": "Pass", "End": True}}})
    arn = sfn.start_execution(stateMachineArn=machine, name="x")["executionArn"]
    done = _ended(arn)
    sfn.stop_execution(executionArn=arn, error="Late")
    again = sfn.describe_execution(executionArn=arn)
    assert again["status"] == "SUCCEEDED"
    assert again["stopDate"] == done["stopDate"]
    assert "error" not in again


def test_stop_execution_error_over_256_characters_is_refused(runtime: runtime_module.Runtime) -> None:
    sfn, queue_url = client("stepfunctions"), _queue("tokens")
    machine = _machine({"StartAt": "Wait", "States": {"Wait": _wait_task(queue_url)}})
    arn = sfn.start_execution(stateMachineArn=machine, name="x")["executionArn"]
    assert _error_code(sfn.stop_execution, executionArn=arn, error="E" * 257) == "ValidationException"
    assert sfn.describe_execution(executionArn=arn)["status"] == "RUNNING"


def test_stop_execution_parent_aborts_its_map_run_and_children(runtime: runtime_module.Runtime) -> None:
    sfn, queue_url = client("stepfunctions"), _queue("tokens")
    machine = _machine(_distributed_map({"Wait": _wait_task(queue_url)}, "Wait", concurrency=2))
    arn = sfn.start_execution(stateMachineArn=machine, name="x", input=json.dumps({"items": list(range(5))}))[
        "executionArn"
    ]
    tokens = _tokens(queue_url, 2)
    map_run = sfn.list_map_runs(executionArn=arn)["mapRuns"][0]["mapRunArn"]

    sfn.stop_execution(executionArn=arn, error="OperatorStop")
    time.sleep(0.5)  # no child may start after the stop

    described = sfn.describe_map_run(mapRunArn=map_run)
    assert described["status"] == "ABORTED"
    assert "stopDate" in described
    assert described["executionCounts"]["aborted"] == 2
    assert described["executionCounts"]["total"] == 2
    children = sfn.list_executions(mapRunArn=map_run)["executions"]
    assert [c["status"] for c in children] == ["ABORTED", "ABORTED"]
    assert "stopDate" in sfn.list_map_runs(executionArn=arn)["mapRuns"][0]
    assert all(_error_code(sfn.send_task_success, taskToken=t, output="{}") == "TaskTimedOut" for t in tokens)


# ---------------------------------------------------------------- Map Run child executions


def _fail_on_three() -> dict[str, Any]:
    return {
        "Check": {
            "Type": "Choice",
            "Choices": [{"Variable": "$", "NumericEquals": 3, "Next": "Broken"}],
            "Default": "Done",
        },
        "Broken": {"Type": "Fail", "Error": "ShardBroken", "Cause": "item 3"},
        "Done": {"Type": "Pass", "End": True},
    }


def _finished_map_run(items: list[int]) -> str:
    sfn = client("stepfunctions")
    machine = _machine(_distributed_map(_fail_on_three(), "Check", concurrency=1))
    arn = sfn.start_execution(stateMachineArn=machine, name="x", input=json.dumps({"items": items}))["executionArn"]
    _ended(arn)
    return str(sfn.list_map_runs(executionArn=arn)["mapRuns"][0]["mapRunArn"])


def test_list_executions_map_run_arn_lists_children_most_recent_first_in_pages(
    runtime: runtime_module.Runtime,
) -> None:
    sfn = client("stepfunctions")
    map_run = _finished_map_run([0, 1, 2, 4, 3])
    pages, token = [], None
    while True:
        page = sfn.list_executions(mapRunArn=map_run, maxResults=2, **({"nextToken": token} if token else {}))
        pages.append(page["executions"])
        token = page.get("nextToken")
        if not token:
            break
    children = [c for page in pages for c in page]

    assert [len(p) for p in pages] == [2, 2, 1]
    assert len({c["executionArn"] for c in children}) == 5
    assert all(CHILD_ARN.match(c["executionArn"]) for c in children)
    assert {c["stateMachineArn"] for c in children} == {f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:m/shards"}
    assert all(c["mapRunArn"] == map_run and "stopDate" in c for c in children)
    starts = [c["startDate"] for c in children]
    assert starts == sorted(starts, reverse=True)
    assert children[0]["status"] == "FAILED"  # item 3 ran last


def test_list_executions_map_run_arn_status_filter_selects_children(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    map_run = _finished_map_run([0, 3, 1])
    failed = sfn.list_executions(mapRunArn=map_run, statusFilter="FAILED")["executions"]
    succeeded = sfn.list_executions(mapRunArn=map_run, statusFilter="SUCCEEDED")["executions"]
    assert len(failed) == 1
    assert len(succeeded) == 2

    child = sfn.describe_execution(executionArn=failed[0]["executionArn"])
    assert (child["status"], child["error"], child["cause"]) == ("FAILED", "ShardBroken", "item 3")
    assert child["mapRunArn"] == map_run
    assert json.loads(child["input"]) == 3
    counts = sfn.describe_map_run(mapRunArn=map_run)["executionCounts"]
    assert (counts["total"], counts["succeeded"], counts["failed"], counts["running"]) == (3, 2, 1, 0)


def test_list_executions_map_run_arn_bad_requests_are_refused(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    map_run = _finished_map_run([0, 1, 2])
    machine = f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:m"
    token = sfn.list_executions(mapRunArn=map_run, maxResults=1)["nextToken"]

    both = _error_code(sfn.list_executions, mapRunArn=map_run, stateMachineArn=machine)
    other_filter = _error_code(sfn.list_executions, mapRunArn=map_run, statusFilter="FAILED", nextToken=token)
    unknown = _error_code(sfn.list_executions, mapRunArn=map_run.replace(":mapRun:m/", ":mapRun:nope/"))
    too_many = _error_code(sfn.list_executions, mapRunArn=map_run, maxResults=1001)
    assert (both, other_filter, unknown, too_many) == (
        "ValidationException",
        "InvalidToken",
        "ResourceNotFound",
        "ValidationException",
    )


# ---------------------------------------------------------------- GetExecutionHistory


def _history_of_three_passes() -> str:
    sfn = client("stepfunctions")
    states = {
        "A": {"Type": "Pass", "Next": "B"},
        "B": {"Type": "Pass", "Next": "C"},
        "C": {"Type": "Pass", "Result": {"out": "secret-output"}, "End": True},
    }
    machine = _machine({"StartAt": "A", "States": states})
    arn = sfn.start_execution(stateMachineArn=machine, name="x", input=json.dumps({"in": "secret-input"}))[
        "executionArn"
    ]
    _ended(arn)
    return str(arn)


def test_get_execution_history_max_results_pages_through_every_event(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    arn = _history_of_three_passes()
    everything = sfn.get_execution_history(executionArn=arn, maxResults=1000)["events"]
    paged, token = [], None
    while True:
        page = sfn.get_execution_history(executionArn=arn, maxResults=3, **({"nextToken": token} if token else {}))
        assert len(page["events"]) <= 3
        paged += page["events"]
        token = page.get("nextToken")
        if not token:
            break
    assert len(everything) > 3
    assert [e["id"] for e in paged] == [e["id"] for e in everything] == list(range(1, len(everything) + 1))
    assert _error_code(sfn.get_execution_history, executionArn=arn, maxResults=1001) == "ValidationException"


def test_get_execution_history_reverse_order_lists_latest_first(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    arn = _history_of_three_passes()
    forward = [e["id"] for e in sfn.get_execution_history(executionArn=arn)["events"]]
    backward = [e["id"] for e in sfn.get_execution_history(executionArn=arn, reverseOrder=True)["events"]]
    assert backward == forward[::-1]
    assert sfn.get_execution_history(executionArn=arn, reverseOrder=True)["events"][0]["type"] == "ExecutionSucceeded"


def test_get_execution_history_without_execution_data_drops_inputs_and_outputs(
    runtime: runtime_module.Runtime,
) -> None:
    sfn = client("stepfunctions")
    arn = _history_of_three_passes()
    with_data = json.dumps(sfn.get_execution_history(executionArn=arn)["events"], default=str)
    without = sfn.get_execution_history(executionArn=arn, includeExecutionData=False)["events"]
    assert "secret-input" in with_data
    assert "secret-output" in with_data
    assert "secret" not in json.dumps(without, default=str)
    assert [e["type"] for e in without] == [e["type"] for e in json.loads(with_data)]


# ---------------------------------------------------------------- status-change events


def _status_events_queue() -> str:
    queue_url = _queue("states-events")
    events = client("events")
    events.put_rule(
        Name="states",
        EventPattern=json.dumps({"source": ["aws.states"], "detail-type": ["Step Functions Execution Status Change"]}),
    )
    events.put_targets(Rule="states", Targets=[{"Id": "q", "Arn": f"arn:aws:sqs:{REGION}:{ACCOUNT}:states-events"}])
    return queue_url


def _status_events(queue_url: str, count: int) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []

    def poll() -> bool:
        messages = client("sqs").receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10).get("Messages", [])
        found.extend(json.loads(m["Body"]) for m in messages)
        return len(found) >= count

    wait_for(poll, what=f"{count} status-change events")
    return found


def test_status_change_events_running_and_succeeded_reach_a_rule(runtime: runtime_module.Runtime) -> None:
    sfn, queue_url = client("stepfunctions"), _status_events_queue()
    machine = _machine({"StartAt": "P", "States": {"P": {"Type": "Pass", "Result": "done", "End": True}}})
    arn = sfn.start_execution(stateMachineArn=machine, name="x", input='{"a":1}')["executionArn"]
    running, succeeded = _status_events(queue_url, 2)

    assert (running["source"], running["detail-type"], running["resources"]) == (
        "aws.states",
        "Step Functions Execution Status Change",
        [arn],
    )
    assert running["detail"]["status"] == "RUNNING"
    assert running["detail"]["stopDate"] is None
    assert running["detail"]["input"] == '{"a":1}'
    assert running["detail"]["inputDetails"] == {"included": True}
    done = succeeded["detail"]
    assert (done["executionArn"], done["stateMachineArn"], done["name"]) == (arn, machine, "x")
    assert (done["status"], done["output"], done["outputDetails"]) == ("SUCCEEDED", '"done"', {"included": True})
    assert done["stopDate"] >= done["startDate"] > 0


def test_status_change_events_failed_timed_out_and_aborted(runtime: runtime_module.Runtime) -> None:
    sfn, queue_url = client("stepfunctions"), _status_events_queue()
    failing = _machine({"StartAt": "F", "States": {"F": {"Type": "Fail", "Error": "Boom", "Cause": "c"}}}, "f")
    slow = _machine(
        {"TimeoutSeconds": 1, "StartAt": "W", "States": {"W": {"Type": "Wait", "Seconds": 30, "End": True}}}, "t"
    )
    stopped = _machine({"StartAt": "W", "States": {"W": {"Type": "Wait", "Seconds": 30, "End": True}}}, "s")
    sfn.start_execution(stateMachineArn=failing, name="x")
    sfn.start_execution(stateMachineArn=slow, name="x")
    arn = sfn.start_execution(stateMachineArn=stopped, name="x")["executionArn"]
    sfn.stop_execution(executionArn=arn, error="Stop", cause="by hand")

    ends = {
        e["detail"]["status"]: e["detail"] for e in _status_events(queue_url, 6) if e["detail"]["status"] != "RUNNING"
    }
    assert set(ends) == {"FAILED", "TIMED_OUT", "ABORTED"}
    assert (ends["FAILED"]["error"], ends["FAILED"]["cause"], ends["FAILED"]["output"]) == ("Boom", "c", None)
    assert (ends["ABORTED"]["error"], ends["ABORTED"]["cause"]) == ("Stop", "by hand")
    assert all(detail["stopDate"] is not None for detail in ends.values())


def test_status_change_events_standard_map_children_emit_their_own(runtime: runtime_module.Runtime) -> None:
    sfn, queue_url = client("stepfunctions"), _status_events_queue()
    machine = _machine(_distributed_map({"Done": {"Type": "Pass", "End": True}}, "Done", concurrency=2))
    sfn.start_execution(stateMachineArn=machine, name="x", input=json.dumps({"items": [1, 2]}))
    events = _status_events(queue_url, 6)  # parent RUNNING/SUCCEEDED, each child RUNNING/SUCCEEDED
    children = [e["detail"] for e in events if CHILD_ARN.match(e["detail"]["executionArn"])]
    assert sorted(d["status"] for d in children) == ["RUNNING", "RUNNING", "SUCCEEDED", "SUCCEEDED"]
    assert {d["stateMachineArn"] for d in children} == {f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:m/shards"}


# ---------------------------------------------------------------- moto without the patches


def test_moto_gap_stop_execution_leaves_a_waiting_execution_running(aws: None) -> None:
    sfn, queue_url = client("stepfunctions"), _queue("tokens")
    machine = _machine({"StartAt": "Wait", "States": {"Wait": _wait_task(queue_url)}})
    arn = sfn.start_execution(stateMachineArn=machine, name="x")["executionArn"]
    (token,) = _tokens(queue_url, 1)
    sfn.stop_execution(executionArn=arn, error="OperatorStop", cause="stopped by hand")
    described = sfn.describe_execution(executionArn=arn)
    assert described["status"] == "RUNNING"
    assert "error" not in described
    sfn.send_task_success(taskToken=token, output="{}")  # lets the thread end


def test_moto_gap_get_execution_history_ignores_max_results(aws: None) -> None:
    sfn = client("stepfunctions")
    arn = _history_of_three_passes()
    page = sfn.get_execution_history(executionArn=arn, maxResults=2)
    assert len(page["events"]) > 2
    assert "nextToken" not in page


def test_moto_gap_interpreter_keeps_every_thread_it_started(aws: None) -> None:
    from moto.stepfunctions.parser.asl.component.program import program
    from moto.stepfunctions.parser.utils import TMP_THREADS

    assert program.TMP_THREADS is TMP_THREADS, "the interpreter appends to one module-level list"
    assert type(TMP_THREADS) is list, "a plain list: moto never removes a thread from it"


def test_live_threads_drop_finished_threads_as_the_list_grows() -> None:
    threads = core.LiveThreads()
    release = threading.Event()
    running = threading.Thread(target=release.wait)
    running.start()
    threads.append(running)
    for _ in range(core.LiveThreads.PRUNE_EVERY * 2):
        done = threading.Thread(target=lambda: None)
        done.start()
        done.join()
        threads.append(done)
    assert running in threads
    assert len(threads) < core.LiveThreads.PRUNE_EVERY, "finished threads dropped"
    release.set()
    running.join()


def test_patch_interpreter_modules_share_the_live_threads_list(runtime: runtime_module.Runtime) -> None:
    from moto.stepfunctions.parser import utils
    from moto.stepfunctions.parser.asl.component.program import program
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import state_task_service_callback

    assert isinstance(utils.TMP_THREADS, core.LiveThreads)
    assert program.TMP_THREADS is utils.TMP_THREADS
    assert state_task_service_callback.TMP_THREADS is utils.TMP_THREADS


def test_local_cloud_stopping_ends_running_executions_aborted_with_its_cause(runtime: runtime_module.Runtime) -> None:
    sfn, queue_url = client("stepfunctions"), _queue("stopping")
    machine = _machine({"StartAt": "Wait", "States": {"Wait": _wait_task(queue_url)}})
    done = _machine({"StartAt": "Done", "States": {"Done": {"Type": "Pass", "End": True}}}, name="done")
    finished = sfn.start_execution(stateMachineArn=done, name="finished", input="{}")["executionArn"]
    wait_for(lambda: sfn.describe_execution(executionArn=finished)["status"] == "SUCCEEDED", what="the Pass run")
    running = sfn.start_execution(stateMachineArn=machine, name="running", input="{}")["executionArn"]
    _tokens(queue_url, 1)

    assert shutdown.end_running_executions(runtime, ACCOUNT, REGION) == [running]
    runtime.clock.close()  # what LocalCloud.stop does next: every wait ends, as if timed out

    described = sfn.describe_execution(executionArn=running)
    assert described["status"] == "ABORTED"
    assert (described["error"], described["cause"]) == (shutdown.STOPPED_ERROR, shutdown.STOPPED_CAUSE)
    time.sleep(0.3)  # the interrupted task's thread ends: no States.Timeout replaces the stop
    assert sfn.describe_execution(executionArn=running)["status"] == "ABORTED"
    assert sfn.describe_execution(executionArn=finished)["status"] == "SUCCEEDED"
