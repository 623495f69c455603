"""ListExecutions' redrive members and redriveFilter (sdflow/local/stepfunctions/listing.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdflow.local import runtime as runtime_module
from tests.unit.local.helpers import ROLE, client, wait_for

# Fails on its first run ($$.Execution.RedriveTime exists only once redriven), succeeds redriven.
GATE = {
    "StartAt": "Gate",
    "States": {"Gate": {"Type": "Pass", "Parameters": {"at.$": "$$.Execution.RedriveTime"}, "End": True}},
}


def _machine() -> str:
    sfn = client("stepfunctions")
    return str(sfn.create_state_machine(name="m", definition=json.dumps(GATE), roleArn=ROLE)["stateMachineArn"])


def _ended(arn: str) -> dict[str, Any]:
    sfn = client("stepfunctions")
    return dict(
        wait_for(
            lambda: (d := sfn.describe_execution(executionArn=arn))["status"] != "RUNNING" and d,
            what="the execution to end",
        )
    )


def _one_redriven_one_failed() -> tuple[str, str, str]:
    """(machine, the redriven execution's ARN, the failed one's), both ended."""
    sfn = client("stepfunctions")
    machine = _machine()
    redriven = sfn.start_execution(stateMachineArn=machine, name="redriven")["executionArn"]
    _ended(redriven)
    failed = sfn.start_execution(stateMachineArn=machine, name="failed")["executionArn"]
    _ended(failed)
    sfn.redrive_execution(executionArn=redriven)
    assert _ended(redriven)["status"] == "SUCCEEDED"
    return machine, redriven, failed


def test_list_executions_redriven_execution_item_has_redrive_count_and_date(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    machine, redriven, failed = _one_redriven_one_failed()

    items = {e["executionArn"]: e for e in sfn.list_executions(stateMachineArn=machine)["executions"]}

    described = sfn.describe_execution(executionArn=redriven)
    assert (items[redriven]["redriveCount"], items[redriven]["redriveDate"]) == (1, described["redriveDate"])
    assert items[failed]["redriveCount"] == 0
    assert "redriveDate" not in items[failed]  # only once redriven
    assert all("stopDate" in item for item in items.values())


def test_list_executions_redrive_filter_selects_redriven_or_not(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    machine, redriven, failed = _one_redriven_one_failed()

    only_redriven = sfn.list_executions(stateMachineArn=machine, redriveFilter="REDRIVEN")["executions"]
    not_redriven = sfn.list_executions(stateMachineArn=machine, redriveFilter="NOT_REDRIVEN")["executions"]
    failed_redriven = sfn.list_executions(stateMachineArn=machine, redriveFilter="REDRIVEN", statusFilter="FAILED")

    assert [e["executionArn"] for e in only_redriven] == [redriven]
    assert [e["executionArn"] for e in not_redriven] == [failed]
    assert failed_redriven["executions"] == []


def test_list_executions_redrive_filter_pages_hold_only_matches(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    machine, _redriven, failed = _one_redriven_one_failed()
    extra = sfn.start_execution(stateMachineArn=machine, name="extra")["executionArn"]
    _ended(extra)

    first = sfn.list_executions(stateMachineArn=machine, redriveFilter="NOT_REDRIVEN", maxResults=1)
    second = sfn.list_executions(stateMachineArn=machine, redriveFilter="NOT_REDRIVEN", nextToken=first["nextToken"])

    assert [e["executionArn"] for e in first["executions"] + second["executions"]] == [extra, failed]
    assert "nextToken" not in second


def test_list_executions_unknown_redrive_filter_is_refused(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    machine = _machine()

    with pytest.raises(ClientError) as raised:
        sfn.list_executions(stateMachineArn=machine, redriveFilter="SOMETIMES")

    assert raised.value.response["Error"]["Code"] == "ValidationException"
    assert "redriveFilter" in raised.value.response["Error"]["Message"]


def test_moto_gap_list_executions_has_no_redrive_members(aws: None) -> None:
    sfn = client("stepfunctions")
    machine = _machine()
    arn = sfn.start_execution(stateMachineArn=machine, name="x")["executionArn"]
    _ended(arn)

    (item,) = sfn.list_executions(stateMachineArn=machine)["executions"]

    assert "redriveCount" not in item
