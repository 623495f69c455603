"""Step Functions: moto's interpreter with AWS's semantics where the pipeline relies on them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sdflow.local import patching
from sdflow.local import runtime as runtime_module
from sdflow.local.stepfunctions import core as stepfunctions
from tests.constants import REGION
from tests.unit.local.helpers import ROLE, client, fail_waiting_task


def test_moto_gap_send_task_failure_drops_cause(aws: None) -> None:
    failed = fail_waiting_task()
    assert failed["error"] == "DownloadJobFailed"
    assert "cause" not in failed


def test_patch_send_task_failure_keeps_cause(runtime: runtime_module.Runtime) -> None:
    failed = fail_waiting_task()
    assert failed["error"] == "DownloadJobFailed"
    assert failed["cause"] == "AlgorithmError: all URLs failed"


def _pass_machine() -> str:
    definition = json.dumps({"StartAt": "P", "States": {"P": {"Type": "Pass", "End": True}}})
    return str(
        client("stepfunctions").create_state_machine(name="m", definition=definition, roleArn=ROLE)["stateMachineArn"]
    )


def test_moto_gap_start_execution_without_name_is_named_none(aws: None) -> None:
    arn = client("stepfunctions").start_execution(stateMachineArn=_pass_machine())["executionArn"]
    assert arn.endswith(":None")


def test_patch_start_execution_without_name_gets_unique_name(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    machine = _pass_machine()
    first = sfn.start_execution(stateMachineArn=machine)["executionArn"]
    second = sfn.start_execution(stateMachineArn=machine)["executionArn"]
    assert first != second
    assert not first.endswith(":None")


class _RecordingExecution:
    """Stands in for moto's Execution and records the order its fields are set in."""

    order: list[str]

    def __init__(self, program_state: Any) -> None:
        env = type("Env", (), {"program_state": lambda _self: program_state, "states": None})()
        env.states = type("States", (), {"get_input": lambda _self: {"done": True}})()
        object.__setattr__(self, "order", [])
        object.__setattr__(self, "exec_worker", type("Worker", (), {"env": env})())

    def __setattr__(self, name: str, value: Any) -> None:
        self.order.append(name)
        object.__setattr__(self, name, value)


def _reflect_order(reflect: Callable[[Any], None]) -> list[str]:
    from moto.stepfunctions.parser.asl.eval.program_state import ProgramEnded

    execution = _RecordingExecution(ProgramEnded())
    reflect(type("Comm", (), {"execution": execution})())
    return list(execution.order)


def test_moto_gap_execution_status_set_before_output() -> None:
    from moto.stepfunctions.parser.backend.execution import BaseExecutionWorkerCommunication

    order = _reflect_order(BaseExecutionWorkerCommunication._reflect_execution_status)
    assert order.index("exec_status") < order.index("output")


def test_patch_execution_output_set_before_status() -> None:
    order = _reflect_order(stepfunctions.sfn_reflect_execution_status)
    assert order.index("output") < order.index("exec_status")


def test_moto_gap_interpreter_builds_a_new_client_per_task() -> None:
    import moto.stepfunctions.parser.asl.utils.boto_client as boto_client

    assert boto_client.boto_client_for(REGION, "lambda") is not boto_client.boto_client_for(REGION, "lambda")


def test_patch_interpreter_reuses_one_client_per_service(tmp_path: Path) -> None:
    import moto.stepfunctions.parser.asl.component.state.exec.state_task.lambda_eval_utils as lambda_eval_utils
    import moto.stepfunctions.parser.asl.utils.boto_client as boto_client

    with patching.patched(runtime_module.Runtime(workdir=tmp_path)):
        assert boto_client.boto_client_for(REGION, "lambda") is boto_client.boto_client_for(REGION, "lambda")
        assert lambda_eval_utils.boto_client_for.patch_wrapper is stepfunctions.sfn_boto_client_for
    assert lambda_eval_utils.boto_client_for is not stepfunctions.sfn_boto_client_for, "uninstall restores moto"
