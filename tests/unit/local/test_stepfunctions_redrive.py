"""RedriveExecution and `$$.Execution.RedriveCount` (sdflow/local/stepfunctions/redrive.py)."""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdflow.local import runtime as runtime_module
from tests.constants import ACCOUNT, REGION
from tests.unit.local.helpers import ROLE, client, wait_for

AWS_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
CHILD_ARN = re.compile(rf"^arn:aws:states:{REGION}:{ACCOUNT}:execution:m/shards:[0-9a-f-]{{36}}$")


def _machine(definition: dict[str, Any], name: str = "m") -> str:
    sfn = client("stepfunctions")
    return str(sfn.create_state_machine(name=name, definition=json.dumps(definition), roleArn=ROLE)["stateMachineArn"])


def _ended(arn: str) -> dict[str, Any]:
    sfn = client("stepfunctions")
    return dict(
        wait_for(
            lambda: (d := sfn.describe_execution(executionArn=arn))["status"] != "RUNNING" and d,
            what="the execution to end",
        )
    )


def _distributed_map(processor_states: dict[str, Any], start_at: str, **extra: Any) -> dict[str, Any]:
    return {
        "Type": "Map",
        "Label": "shards",
        "ItemsPath": "$.items",
        "MaxConcurrency": 1,
        "ItemProcessor": {
            "ProcessorConfig": {"Mode": "DISTRIBUTED", "ExecutionType": "STANDARD"},
            "StartAt": start_at,
            "States": processor_states,
        },
        **extra,
    }


def _error_code(call: Any, **kwargs: Any) -> tuple[str, str]:
    with pytest.raises(ClientError) as raised:
        call(**kwargs)
    return str(raised.value.response["Error"]["Code"]), str(raised.value.response["Error"]["Message"])


# ---------------------------------------------------------------- $$.Execution


CONTEXT = {"Type": "Pass", "Parameters": {"execution.$": "$$.Execution"}, "End": True}


def test_context_execution_never_redriven_has_redrive_count_zero(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    machine = _machine({"StartAt": "C", "States": {"C": CONTEXT}})
    arn = sfn.start_execution(stateMachineArn=machine, name="x", input='{"a": 1}')["executionArn"]

    execution = json.loads(_ended(arn)["output"])["execution"]

    assert execution["RedriveCount"] == 0
    assert "RedriveTime" not in execution  # "only available if you've redriven an execution"
    assert (execution["Id"], execution["Name"], execution["Input"]) == (arn, "x", {"a": 1})
    assert AWS_TIME.match(execution["StartTime"])


def test_context_execution_distributed_map_child_is_its_own_execution(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    selector = {"value.$": "$$.Map.Item.Value", "parent.$": "$$.Execution.Id", "count.$": "$$.Execution.RedriveCount"}
    definition = {
        "StartAt": "Shards",
        "States": {"Shards": {**_distributed_map({"C": CONTEXT}, "C", ItemSelector=selector), "End": True}},
    }
    arn = sfn.start_execution(stateMachineArn=_machine(definition), name="x", input='{"items": [7]}')["executionArn"]

    (child,) = json.loads(_ended(arn)["output"])
    execution = child["execution"]

    # The ItemSelector reads the parent's context; the child's states read the child's own.
    assert execution["Input"] == {"value": 7, "parent": arn, "count": 0}
    assert CHILD_ARN.match(execution["Id"])
    assert execution["Id"].endswith(":" + execution["Name"])
    assert execution["RedriveCount"] == 0
    assert AWS_TIME.match(execution["StartTime"])


# ---------------------------------------------------------------- RedriveExecution


# "Gate" fails (States.Runtime: no such path) until the execution has been redriven, as
# $$.Execution.RedriveTime only exists then; "Prepare" records the redrive count it ran under.
PREPARE_THEN_GATE = {
    "StartAt": "Prepare",
    "States": {
        "Prepare": {
            "Type": "Pass",
            "Parameters": {"count.$": "$$.Execution.RedriveCount"},
            "ResultPath": "$.prepared",
            "Next": "Gate",
        },
        "Gate": {
            "Type": "Pass",
            "Parameters": {"at.$": "$$.Execution.RedriveTime", "count.$": "$$.Execution.RedriveCount"},
            "ResultPath": "$.gate",
            "End": True,
        },
    },
}


def _events(arn: str) -> list[dict[str, Any]]:
    return list(client("stepfunctions").get_execution_history(executionArn=arn, maxResults=1000)["events"])


def _entered(events: list[dict[str, Any]], name: str) -> int:
    return sum(1 for e in events if e.get("stateEnteredEventDetails", {}).get("name") == name)


def _status_events_queue() -> str:
    sqs, events = client("sqs"), client("events")
    queue_url = str(sqs.create_queue(QueueName="states-events")["QueueUrl"])
    events.put_rule(Name="states", EventPattern=json.dumps({"source": ["aws.states"]}))
    events.put_targets(Rule="states", Targets=[{"Id": "q", "Arn": f"arn:aws:sqs:{REGION}:{ACCOUNT}:states-events"}])
    return queue_url


def _status_events(queue_url: str, count: int) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []

    def poll() -> bool:
        messages = client("sqs").receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10).get("Messages", [])
        found.extend(json.loads(m["Body"])["detail"] for m in messages)
        return len(found) >= count

    wait_for(poll, what=f"{count} status-change events")
    return found


def test_redrive_failed_execution_continues_at_failed_state_with_its_input(runtime: runtime_module.Runtime) -> None:
    sfn, queue_url = client("stepfunctions"), _status_events_queue()
    arn = sfn.start_execution(stateMachineArn=_machine(PREPARE_THEN_GATE), name="x", input='{"a":1}')["executionArn"]
    failed = _ended(arn)
    assert (failed["status"], failed["error"]) == ("FAILED", "States.Runtime")
    assert (failed["redriveCount"], failed["redriveStatus"]) == (0, "REDRIVABLE")

    redriven = sfn.redrive_execution(executionArn=arn)
    done = _ended(arn)

    assert done["status"] == "SUCCEEDED"
    assert (done["startDate"], done["name"], done["input"]) == (failed["startDate"], "x", '{"a":1}')
    assert (done["redriveCount"], done["redriveDate"]) == (1, redriven["redriveDate"])
    assert (done["redriveStatus"], done["redriveStatusReason"]) == (
        "NOT_REDRIVABLE",
        "Execution is SUCCEEDED and cannot be redriven",
    )
    output = json.loads(done["output"])
    # Prepare ran once, before the redrive; Gate got the input it failed with.
    assert output["a"] == 1
    assert output["prepared"] == {"count": 0}
    assert output["gate"]["count"] == 1
    assert AWS_TIME.match(output["gate"]["at"])
    events = _events(arn)
    types = [e["type"] for e in events]
    assert types.index("ExecutionFailed") < types.index("ExecutionRedriven") < types.index("ExecutionSucceeded")
    assert events[types.index("ExecutionRedriven")]["executionRedrivenEventDetails"] == {"redriveCount": 1}
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    assert (_entered(events, "Prepare"), _entered(events, "Gate")) == (1, 2)
    statuses = [(d["status"], d["redriveCount"]) for d in _status_events(queue_url, 4)]
    assert statuses == [("RUNNING", 0), ("FAILED", 0), ("RUNNING", 1), ("SUCCEEDED", 1)]


def test_redrive_not_redrivable_executions_are_refused_with_the_reason(runtime: runtime_module.Runtime) -> None:
    from moto.stepfunctions.parser.models import stepfunctions_parser_backends

    sfn = client("stepfunctions")
    machine = _machine({"StartAt": "P", "States": {"P": {"Type": "Pass", "End": True}}})
    succeeded = sfn.start_execution(stateMachineArn=machine, name="ok")["executionArn"]
    _ended(succeeded)
    old = sfn.start_execution(stateMachineArn=_machine(PREPARE_THEN_GATE, "g"), name="old")["executionArn"]
    _ended(old)
    execution: Any = stepfunctions_parser_backends[ACCOUNT][REGION].describe_execution(old)
    execution.stop_date -= dt.timedelta(days=14, seconds=1)

    assert _error_code(sfn.redrive_execution, executionArn=succeeded) == (
        "ExecutionNotRedrivable",
        "Execution is SUCCEEDED and cannot be redriven",
    )
    assert _error_code(sfn.redrive_execution, executionArn=old) == (
        "ExecutionNotRedrivable",
        "Execution redrivable period exceeded",
    )
    assert sfn.describe_execution(executionArn=old)["redriveStatusReason"] == "Execution redrivable period exceeded"
    missing = succeeded.replace(":ok", ":nope")
    assert _error_code(sfn.redrive_execution, executionArn=missing)[0] == "ExecutionDoesNotExist"


def test_redrive_client_token_repeated_gets_the_same_redrive(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    arn = sfn.start_execution(stateMachineArn=_machine(PREPARE_THEN_GATE), name="x")["executionArn"]
    _ended(arn)

    first = sfn.redrive_execution(executionArn=arn, clientToken="t-1")
    _ended(arn)
    again = sfn.redrive_execution(executionArn=arn, clientToken="t-1")

    assert again["redriveDate"] == first["redriveDate"]
    assert sfn.describe_execution(executionArn=arn)["redriveCount"] == 1
    assert _error_code(sfn.redrive_execution, executionArn=arn, clientToken="t-2")[0] == "ExecutionNotRedrivable"


def _wait_task(queue_url: str) -> dict[str, Any]:
    return {
        "Type": "Task",
        "Resource": "arn:aws:states:::sqs:sendMessage.waitForTaskToken",
        "Parameters": {"QueueUrl": queue_url, "MessageBody": {"token.$": "$$.Task.Token"}},
        "End": True,
    }


def _token(queue_url: str) -> str:
    sqs = client("sqs")
    found = wait_for(
        lambda: sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=1).get("Messages"), what="a task token"
    )
    return str(json.loads(found[0]["Body"])["token"])


def test_redrive_aborted_execution_reruns_the_interrupted_task(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    queue_url = str(client("sqs").create_queue(QueueName="tokens")["QueueUrl"])
    definition = {"StartAt": "Wait", "States": {"Wait": _wait_task(queue_url)}}
    arn = sfn.start_execution(stateMachineArn=_machine(definition), name="x")["executionArn"]
    first = _token(queue_url)
    sfn.stop_execution(executionArn=arn, error="OperatorStop")
    assert sfn.describe_execution(executionArn=arn)["redriveStatus"] == "REDRIVABLE"

    sfn.redrive_execution(executionArn=arn)
    second = _token(queue_url)
    assert sfn.describe_execution(executionArn=arn)["status"] == "RUNNING"
    sfn.send_task_success(taskToken=second, output='{"done":true}')

    done = _ended(arn)
    assert (done["status"], json.loads(done["output"]), done["redriveCount"]) == ("SUCCEEDED", {"done": True}, 1)
    assert "error" not in done
    assert second != first
    types = [e["type"] for e in _events(arn)]
    assert types.index("ExecutionAborted") < types.index("ExecutionRedriven") < types.index("ExecutionSucceeded")


def _parallel_failing(**extra: Any) -> dict[str, Any]:
    branch = {"StartAt": "Break", "States": {"Break": {"Type": "Fail", "Error": "Custom", "Cause": "broken"}}}
    return {"Type": "Parallel", "Branches": [branch], **extra}


def test_redrive_retry_attempts_start_again_from_zero(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    retry = [{"ErrorEquals": ["Custom"], "MaxAttempts": 1, "IntervalSeconds": 1, "BackoffRate": 1.0}]
    definition = {"StartAt": "Try", "States": {"Try": _parallel_failing(Retry=retry, End=True)}}
    arn = sfn.start_execution(stateMachineArn=_machine(definition), name="x")["executionArn"]
    _ended(arn)
    attempts_before = [e["type"] for e in _events(arn)].count("ParallelStateStarted")

    sfn.redrive_execution(executionArn=arn)
    again = _ended(arn)

    assert (again["status"], again["error"], again["redriveCount"]) == ("FAILED", "Custom", 1)
    assert attempts_before == 2  # the attempt and its one retry
    assert [e["type"] for e in _events(arn)].count("ParallelStateStarted") == 2 * attempts_before


def test_redrive_caught_failure_is_not_rerun_the_fail_state_is(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    catch = [{"ErrorEquals": ["States.ALL"], "Next": "Give up"}]
    definition = {
        "StartAt": "Try",
        "States": {
            "Try": _parallel_failing(Catch=catch, End=True),
            "Give up": {"Type": "Fail", "Error": "GaveUp", "Cause": "caught"},
        },
    }
    arn = sfn.start_execution(stateMachineArn=_machine(definition), name="x")["executionArn"]
    _ended(arn)

    sfn.redrive_execution(executionArn=arn)
    again = _ended(arn)

    assert (again["status"], again["error"], again["redriveCount"]) == ("FAILED", "GaveUp", 1)
    events = _events(arn)
    assert (_entered(events, "Try"), _entered(events, "Give up")) == (1, 2)


# ---------------------------------------------------------------- Distributed Map


def _shard_children(hard: tuple[int, ...] = ()) -> dict[str, Any]:
    """Items >= 2 pass through "Gate", which fails until the child itself has been redriven;
    the `hard` items always fail."""
    choices: list[dict[str, Any]] = [{"Variable": "$.value", "NumericEquals": v, "Next": "Hard"} for v in hard]
    choices.append({"Variable": "$.value", "NumericGreaterThanEquals": 2, "Next": "Gate"})
    report = {
        "value.$": "$.value",
        "parent_count.$": "$.parent_count",
        "count.$": "$$.Execution.RedriveCount",
        "id.$": "$$.Execution.Id",
    }
    return {
        "Pick": {"Type": "Choice", "Choices": choices, "Default": "Report"},
        "Hard": {"Type": "Fail", "Error": "Hard", "Cause": "always"},
        "Gate": {
            "Type": "Pass",
            "Parameters": {"at.$": "$$.Execution.RedriveTime"},
            "ResultPath": None,
            "Next": "Report",
        },
        "Report": {"Type": "Pass", "Parameters": report, "End": True},
    }


SELECTOR = {"value.$": "$$.Map.Item.Value", "parent_count.$": "$$.Execution.RedriveCount"}


def test_redrive_distributed_map_reruns_only_unsuccessful_children(runtime: runtime_module.Runtime) -> None:
    sfn, s3 = client("stepfunctions"), client("s3")
    s3.create_bucket(Bucket="results")
    writer = {"Resource": "arn:aws:states:::s3:putObject", "Parameters": {"Bucket": "results", "Prefix": "out"}}
    shards = _distributed_map(_shard_children(), "Pick", ItemSelector=SELECTOR, ResultWriter=writer, Next="Done")
    definition = {"StartAt": "Shards", "States": {"Shards": shards, "Done": {"Type": "Pass", "End": True}}}
    arn = sfn.start_execution(stateMachineArn=_machine(definition), name="x", input='{"items": [0, 1, 2, 3]}')[
        "executionArn"
    ]
    assert _ended(arn)["error"] == "States.ExceedToleratedFailureThreshold"
    (map_run,) = [r["mapRunArn"] for r in sfn.list_map_runs(executionArn=arn)["mapRuns"]]
    before = {c["executionArn"]: c for c in sfn.list_executions(mapRunArn=map_run)["executions"]}
    assert sorted(c["status"] for c in before.values()) == ["FAILED", "FAILED", "SUCCEEDED", "SUCCEEDED"]

    sfn.redrive_execution(executionArn=arn)
    done = _ended(arn)

    assert (done["status"], done["redriveCount"]) == ("SUCCEEDED", 1)
    assert [r["mapRunArn"] for r in sfn.list_map_runs(executionArn=arn)["mapRuns"]] == [map_run]
    described = sfn.describe_map_run(mapRunArn=map_run)
    assert (described["status"], described["redriveCount"]) == ("SUCCEEDED", 1)
    assert "redriveDate" in described
    counts = described["executionCounts"]
    assert (counts["succeeded"], counts["failed"], counts["total"]) == (4, 0, 4)
    after = {c["executionArn"]: c for c in sfn.list_executions(mapRunArn=map_run)["executions"]}
    assert after.keys() == before.keys()  # the same child executions, redriven
    redriven = {arn_ for arn_, c in before.items() if c["status"] == "FAILED"}
    assert {arn_ for arn_, c in after.items() if c["redriveCount"] == 1} == redriven
    manifest = json.loads(
        s3.get_object(Bucket="results", Key=f"out/{map_run.split(':')[-1]}/manifest.json")["Body"].read()
    )
    assert manifest["ResultFiles"]["FAILED"] == []
    (succeeded_file,) = manifest["ResultFiles"]["SUCCEEDED"]
    entries = json.loads(s3.get_object(Bucket="results", Key=succeeded_file["Key"])["Body"].read())
    outputs = [json.loads(entry["Output"]) for entry in entries]
    # Children 0 and 1 kept their first results; 2 and 3 ran again as their own first redrive,
    # with the input they had (the parent's count when they were started).
    assert [(o["value"], o["count"], o["parent_count"]) for o in outputs] == [
        (0, 0, 0),
        (1, 0, 0),
        (2, 1, 0),
        (3, 1, 0),
    ]
    assert {o["id"] for o in outputs} == set(before)
    events = _events(arn)
    redriven_event = next(e for e in events if e["type"] == "MapRunRedriven")
    assert redriven_event["mapRunRedrivenEventDetails"] == {"mapRunArn": map_run, "redriveCount": 1}
    assert _entered(events, "Shards") == 2


def test_redrive_distributed_map_tolerated_failures_count_the_whole_map_run(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    shards = _distributed_map(
        _shard_children(hard=(1, 3)), "Pick", ItemSelector=SELECTOR, ToleratedFailurePercentage=50.0, End=True
    )
    arn = sfn.start_execution(
        stateMachineArn=_machine({"StartAt": "Shards", "States": {"Shards": shards}}),
        name="x",
        input='{"items": [0, 1, 2, 3]}',
    )["executionArn"]
    assert _ended(arn)["error"] == "States.ExceedToleratedFailureThreshold"  # 3 of 4 failed

    sfn.redrive_execution(executionArn=arn)
    done = _ended(arn)

    # 1 and 3 fail again, 2 succeeds: 2 of the Map Run's 4 items failed, 50% is tolerated.
    assert done["status"] == "SUCCEEDED"
    outputs = json.loads(done["output"])
    assert [o and o["value"] for o in outputs] == [0, None, 2, None]
    (map_run,) = sfn.list_map_runs(executionArn=arn)["mapRuns"]
    counts = sfn.describe_map_run(mapRunArn=map_run["mapRunArn"])["executionCounts"]
    assert (counts["succeeded"], counts["failed"], counts["total"]) == (2, 2, 4)


def test_redrive_distributed_map_role_needs_redrive_execution_on_its_children(
    runtime: runtime_module.Runtime,
) -> None:
    from sdflow.local.services.iam import IamEnforcer

    sfn, iam = client("stepfunctions"), client("iam")
    runtime.iam = IamEnforcer(REGION)
    shards = _distributed_map(_shard_children(), "Pick", ItemSelector=SELECTOR, End=True)
    definition = {"StartAt": "Shards", "States": {"Shards": shards}}
    arn = sfn.start_execution(stateMachineArn=_machine(definition), name="x", input='{"items": [0, 2]}')["executionArn"]
    _ended(arn)
    (child,) = [c for c in sfn.list_executions(mapRunArn=_map_run(arn))["executions"] if c["status"] == "FAILED"]

    sfn.redrive_execution(executionArn=arn)
    denied = _ended(arn)

    # The role "test" has no policy: the child is not redriven, it stays failed.
    assert (denied["status"], denied["error"]) == ("FAILED", "States.ExceedToleratedFailureThreshold")
    assert sfn.describe_execution(executionArn=child["executionArn"])["redriveCount"] == 0
    statement = {
        "Effect": "Allow",
        "Action": "states:RedriveExecution",
        # Developer Guide, "IAM permission to redrive a Map Run".
        "Resource": f"arn:aws:states:{REGION}:{ACCOUNT}:execution:m/shards:*",
    }
    policy = json.dumps({"Version": "2012-10-17", "Statement": [statement]})
    iam.put_role_policy(RoleName="test", PolicyName="redrive", PolicyDocument=policy)
    runtime.iam.forget_policies()
    sfn.redrive_execution(executionArn=arn)

    assert _ended(arn)["status"] == "SUCCEEDED"
    assert sfn.describe_execution(executionArn=child["executionArn"])["redriveCount"] == 1
    assert sfn.describe_map_run(mapRunArn=_map_run(arn))["redriveCount"] == 2


def _map_run(arn: str) -> str:
    (map_run,) = client("stepfunctions").list_map_runs(executionArn=arn)["mapRuns"]
    return str(map_run["mapRunArn"])


def test_redrive_distributed_map_after_1000_map_run_redrives_fails_states_runtime(
    runtime: runtime_module.Runtime,
) -> None:
    from moto.stepfunctions.parser.models import stepfunctions_parser_backends

    sfn = client("stepfunctions")
    shards = _distributed_map(_shard_children(), "Pick", ItemSelector=SELECTOR, End=True)
    definition = {"StartAt": "Shards", "States": {"Shards": shards}}
    arn = sfn.start_execution(stateMachineArn=_machine(definition), name="x", input='{"items": [2]}')["executionArn"]
    _ended(arn)
    execution: Any = stepfunctions_parser_backends[ACCOUNT][REGION].describe_execution(arn)
    (record,) = execution.exec_worker.env.map_run_record_pool_manager.get_all()
    record.sdflow_redrive_count = 1000

    sfn.redrive_execution(executionArn=arn)
    again = _ended(arn)

    assert (again["status"], again["error"]) == ("FAILED", "States.Runtime")
    assert "1000" in again["cause"]
