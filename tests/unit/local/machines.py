"""State machines for the Step Functions tests: run one to its end, its history, a Distributed Map, a failing child."""

from __future__ import annotations

import json
from typing import Any

from tests.unit.local.helpers import ROLE, client, wait_for


def run_machine(definition: dict[str, Any], execution_input: Any = None, name: str = "m") -> dict[str, Any]:
    """Creates a state machine, runs it to its end and returns DescribeExecution."""
    sfn = client("stepfunctions")
    machine = sfn.create_state_machine(name=name, definition=json.dumps(definition), roleArn=ROLE)["stateMachineArn"]
    arn = sfn.start_execution(stateMachineArn=machine, input=json.dumps(execution_input or {}))["executionArn"]
    return finished(arn)


def finished(execution_arn: str) -> dict[str, Any]:
    sfn = client("stepfunctions")
    return dict(
        wait_for(
            lambda: (d := sfn.describe_execution(executionArn=execution_arn))["status"] != "RUNNING" and d,
            what="the execution to end",
        )
    )


def history(execution_arn: str) -> list[dict[str, Any]]:
    return list(client("stepfunctions").get_execution_history(executionArn=execution_arn)["events"])


def distributed_map(child_states: dict[str, Any], start_at: str, **fields: Any) -> dict[str, Any]:
    """A Distributed Map state over $.items (ResultPath null unless given), ending the machine."""
    return {
        "Type": "Map",
        "ItemsPath": "$.items",
        "ItemProcessor": {
            "ProcessorConfig": {"Mode": "DISTRIBUTED", "ExecutionType": "STANDARD"},
            "StartAt": start_at,
            "States": child_states,
        },
        "ResultPath": None,
        "End": True,
        **fields,
    }


FAIL_WHEN_ASKED = {
    "Check": {
        "Type": "Choice",
        "Choices": [{"Variable": "$.fail", "BooleanEquals": True, "Next": "Fail"}],
        "Default": "Done",
    },
    "Fail": {"Type": "Fail", "Error": "ShardFailed", "Cause": "the shard could not be read"},
    "Done": {"Type": "Pass", "Parameters": {"shard.$": "$.shard", "status": "ok"}, "End": True},
}
