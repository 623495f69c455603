"""Step Functions: the 256 KiB payload limit and terminal errors, as AWS documents them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdflow.local import runtime as runtime_module
from sdflow.local.stepfunctions import limits
from tests.unit.local.helpers import ROLE, client
from tests.unit.local.machines import distributed_map, history, run_machine

LIMIT = limits.MAX_PAYLOAD_BYTES
CATCH_ALL = [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.error", "Next": "Caught"}]
CAUGHT = {"Type": "Pass", "End": True}


def _big_object(size: int) -> None:
    """A DynamoDB item of `size` bytes of text (items may be 400 KB; S3 bodies reach moto's
    interpreter as streams, not text)."""
    ddb = client("dynamodb")
    ddb.create_table(
        TableName="data",
        KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "id", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    ddb.put_item(TableName="data", Item={"id": {"S": "big"}, "text": {"S": "x" * size}})


def _get_big_object(**fields: Any) -> dict[str, Any]:
    """A machine whose task's result (the DynamoDB item) is about as large as the item."""
    task = {
        "Type": "Task",
        "Resource": "arn:aws:states:::dynamodb:getItem",
        "Parameters": {"TableName": "data", "Key": {"id": {"S": "big"}}},
        "End": True,
        **fields,
    }
    return {"StartAt": "Get", "States": {"Get": task, "Caught": CAUGHT}}


def test_moto_gap_states_all_catches_data_limit_exceeded(aws: None) -> None:
    _big_object(LIMIT + 1)
    described = run_machine(_get_big_object(Catch=CATCH_ALL))
    assert described["status"] == "SUCCEEDED", "the oversized result was caught by States.ALL"
    assert "error" in json.loads(described["output"])


def test_patch_data_limit_exceeded_escapes_states_all_catch(runtime: runtime_module.Runtime) -> None:
    _big_object(LIMIT + 1)
    described = run_machine(_get_big_object(Catch=CATCH_ALL))
    assert described["status"] == "FAILED"
    assert described["error"] == "States.DataLimitExceeded"
    assert "returned a result with a size exceeding the maximum number of bytes service limit" in described["cause"]


def test_patch_data_limit_exceeded_is_not_retried_by_states_all(runtime: runtime_module.Runtime) -> None:
    _big_object(LIMIT + 1)
    retry = [{"ErrorEquals": ["States.ALL"], "IntervalSeconds": 1, "MaxAttempts": 2}]
    described = run_machine(_get_big_object(Retry=retry))
    assert described["status"] == "FAILED"
    scheduled = [e for e in history(described["executionArn"]) if e["type"] == "TaskScheduled"]
    assert len(scheduled) == 1, "a terminal error gets no second attempt"


def test_patch_data_limit_exceeded_caught_when_named(runtime: runtime_module.Runtime) -> None:
    _big_object(LIMIT + 1)
    catch = [{"ErrorEquals": ["States.DataLimitExceeded"], "ResultPath": "$.error", "Next": "Caught"}]
    assert run_machine(_get_big_object(Catch=catch))["status"] == "SUCCEEDED"


def test_patch_result_just_under_limit_is_allowed(runtime: runtime_module.Runtime) -> None:
    _big_object(LIMIT - 2_000)  # the body plus the response's metadata stays under 256 KiB
    assert run_machine(_get_big_object(ResultPath=None, Catch=CATCH_ALL))["status"] == "SUCCEEDED"


def test_patch_size_is_measured_as_compact_utf8() -> None:
    # AWS counts the compact UTF-8 text: "é" is 2 bytes (moto: a 6-byte \u00e9 escape).
    assert limits.sfn_is_within_size_quota({"k": "é" * ((LIMIT - 8) // 2)})
    assert not limits.sfn_is_within_size_quota({"k": "é" * ((LIMIT - 8) // 2 + 1)})
    assert limits.sfn_is_within_size_quota(list(range(40_000)))  # 228,890 bytes compact, 268,890 with ", "


def test_moto_gap_parameters_over_limit_are_sent(aws: None) -> None:
    client("s3").create_bucket(Bucket="data")
    described = run_machine(_put_three_copies(), {"x": "x" * 100_000})
    assert described["status"] == "SUCCEEDED"


def _put_three_copies() -> dict[str, Any]:
    """A task whose Parameters (three copies of a 100 KB input) exceed 256 KiB."""
    task = {
        "Type": "Task",
        "Resource": "arn:aws:states:::aws-sdk:s3:putObject",
        "Parameters": {"Bucket": "data", "Key": "k", "Body.$": "States.Format('{}{}{}', $.x, $.x, $.x)"},
        "ResultPath": None,
        "Catch": CATCH_ALL,
        "End": True,
    }
    return {"StartAt": "Put", "States": {"Put": task, "Caught": CAUGHT}}


def test_patch_parameters_over_limit_fail_the_execution(runtime: runtime_module.Runtime) -> None:
    client("s3").create_bucket(Bucket="data")
    described = run_machine(_put_three_copies(), {"x": "x" * 100_000})
    assert described["status"] == "FAILED"
    assert described["error"] == "States.DataLimitExceeded"
    assert "Key" not in client("s3").list_objects_v2(Bucket="data").get("Contents", [{}])[0]


def _iteration_input_over_limit() -> tuple[dict[str, Any], dict[str, Any]]:
    """An inline Map whose ItemSelector builds an iteration input of ~375 KB from a 250 KB input;
    the iteration's only state returns something small."""
    map_state = {
        "Type": "Map",
        "ItemsPath": "$.items",
        "ItemSelector": {"a.$": "$$.Map.Item.Value", "b.$": "$.pad", "c.$": "$.pad"},
        "ItemProcessor": {"StartAt": "Small", "States": {"Small": {"Type": "Pass", "Result": 1, "End": True}}},
        "ResultPath": None,
        "End": True,
    }
    return {"StartAt": "Map", "States": {"Map": map_state}}, {"pad": "p" * 125_000, "items": ["i" * 125_000]}


def test_moto_gap_state_input_over_limit_is_accepted(aws: None) -> None:
    assert run_machine(*_iteration_input_over_limit())["status"] == "SUCCEEDED"


def test_patch_state_input_over_limit_fails_the_execution(runtime: runtime_module.Runtime) -> None:
    described = run_machine(*_iteration_input_over_limit())
    assert described["status"] == "FAILED"
    assert described["error"] == "States.DataLimitExceeded"
    assert "'Small'" in described["cause"]


def _collect_300_kb(**fields: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Distributed Map whose 20 children each return 15 KB: 300 KB collected, ResultPath null."""
    child = {"Echo": {"Type": "Pass", "End": True}}
    map_state = distributed_map(child, "Echo", ItemSelector={"pad.$": "$.pad"}, Catch=CATCH_ALL, **fields)
    return {"StartAt": "Map", "States": {"Map": map_state, "Caught": CAUGHT}}, {
        "pad": "p" * 15_000,
        "items": list(range(20)),
    }


def test_moto_gap_map_collected_result_is_not_measured(aws: None) -> None:
    assert run_machine(*_collect_300_kb())["status"] == "SUCCEEDED"


def test_patch_map_collected_result_over_limit_fails_despite_result_path_null(
    runtime: runtime_module.Runtime,
) -> None:
    described = run_machine(*_collect_300_kb())
    assert described["status"] == "FAILED"
    assert described["error"] == "States.DataLimitExceeded"
    assert "'Map'" in described["cause"]


def test_patch_map_with_result_writer_does_not_collect(runtime: runtime_module.Runtime) -> None:
    client("s3").create_bucket(Bucket="results")
    writer = {"Resource": "arn:aws:states:::s3:putObject", "Parameters": {"Bucket": "results", "Prefix": "out"}}
    assert run_machine(*_collect_300_kb(ResultWriter=writer))["status"] == "SUCCEEDED"


def test_moto_gap_start_execution_accepts_input_over_limit(aws: None) -> None:
    machine = client("stepfunctions").create_state_machine(
        name="m", definition=json.dumps({"StartAt": "P", "States": {"P": {"Type": "Pass", "End": True}}}), roleArn=ROLE
    )["stateMachineArn"]
    client("stepfunctions").start_execution(stateMachineArn=machine, input=json.dumps({"x": "x" * LIMIT}))


def test_patch_start_execution_refuses_input_over_limit(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    machine = sfn.create_state_machine(
        name="m", definition=json.dumps({"StartAt": "P", "States": {"P": {"Type": "Pass", "End": True}}}), roleArn=ROLE
    )["stateMachineArn"]
    with pytest.raises(ClientError) as refused:
        sfn.start_execution(stateMachineArn=machine, input=json.dumps({"x": "é" * (LIMIT // 2)}))
    assert refused.value.response["Error"]["Code"] == "ValidationException"
    assert "Member must have size less than or equal to 262144 bytes in UTF-8 encoding" in str(refused.value)
    sfn.start_execution(stateMachineArn=machine, input=json.dumps({"x": "x" * (LIMIT - 10)}))


def test_patch_counts_state_transitions_and_retries(runtime: runtime_module.Runtime) -> None:
    definition = {
        "StartAt": "A",
        "States": {
            "A": {"Type": "Pass", "Next": "Map"},
            "Map": distributed_map({"Child": {"Type": "Pass", "End": True}}, "Child"),
        },
    }
    assert run_machine(definition, {"items": [1, 2, 3]})["status"] == "SUCCEEDED"
    assert runtime.sfn_transitions == 2 + 3, "A, Map, and one state in each of the 3 children"


def _pass_machine() -> str:
    return str(
        client("stepfunctions").create_state_machine(
            name="m",
            definition=json.dumps({"StartAt": "P", "States": {"P": {"Type": "Pass", "End": True}}}),
            roleArn=ROLE,
        )["stateMachineArn"]
    )


def _start_refused(machine: str, execution_input: str) -> tuple[int, str, str]:
    with pytest.raises(ClientError) as refused:
        client("stepfunctions").start_execution(stateMachineArn=machine, input=execution_input)
    response = refused.value.response
    return response["ResponseMetadata"]["HTTPStatusCode"], response["Error"]["Code"], response["Error"]["Message"]


def test_patch_start_execution_input_not_json_is_invalid_execution_input(runtime: runtime_module.Runtime) -> None:
    machine = _pass_machine()

    status, code, message = _start_refused(machine, "{not json")

    assert (status, code) == (400, "InvalidExecutionInput")
    assert message.startswith("Invalid State Machine Execution Input: '")


def test_patch_start_execution_input_nested_too_deep_is_invalid_execution_input(
    runtime: runtime_module.Runtime,
) -> None:
    machine = _pass_machine()
    # Brackets inside a string do not nest: this one is accepted.
    client("stepfunctions").start_execution(stateMachineArn=machine, input=json.dumps({"s": "[" * 2000}))

    status, code, message = _start_refused(machine, "[" * 1001 + "]" * 1001)

    assert (status, code) == (400, "InvalidExecutionInput")
    assert message == (
        "Invalid State Machine Execution Input: 'Document nesting depth (1001) exceeds the maximum allowed (1000)'"
    )


def test_moto_gap_start_execution_bad_input_has_no_error_code(aws: None) -> None:
    status, code, _ = _start_refused(_pass_machine(), "{not json")
    assert (status, code) == (400, "")
