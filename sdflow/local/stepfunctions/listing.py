"""Step Functions ListExecutions of a state machine, with the redrive members AWS gives.

API reference, ListExecutions: `redriveFilter` "Sets a filter to list executions based on whether
or not they have been redriven" (REDRIVEN | NOT_REDRIVEN); ExecutionListItem: `redriveCount`
("If you have not yet redriven an execution, the redriveCount is 0") and `redriveDate` ("The
date the execution was last redriven"), `stopDate` "If the execution already ended". moto's
listing has neither redrive member nor the filter, and gives no stopDate to a TIMED_OUT
execution. A Map Run's children are listed by stepfunctions/map_runs.py."""

from __future__ import annotations

from typing import Any

from sdflow.local.stepfunctions.map_runs import StepFunctionsValidationError

REDRIVE_FILTERS = ("REDRIVEN", "NOT_REDRIVEN")
ENDED = ("SUCCEEDED", "FAILED", "TIMED_OUT", "ABORTED")


def check_redrive_filter(value: str | None) -> None:
    """The service's model constraint on redriveFilter (an enum), answered as AWS words it."""
    if value is not None and value not in REDRIVE_FILTERS:
        raise StepFunctionsValidationError(
            f"1 validation error detected: Value '{value}' at 'redriveFilter' failed to satisfy constraint: "
            f"Member must satisfy enum value set: [{', '.join(REDRIVE_FILTERS)}]"
        )


def redrive_selected(count: int, redrive_filter: str | None) -> bool:
    """Whether an execution redriven `count` times passes the filter."""
    if redrive_filter is None:
        return True
    return (count > 0) == (redrive_filter == "REDRIVEN")


def redrive_members(execution: Any) -> dict[str, Any]:
    """An ExecutionListItem's redrive members for a state machine's execution."""
    members: dict[str, Any] = {"redriveCount": getattr(execution, "sdflow_redrive_count", 0)}
    date = getattr(execution, "sdflow_redrive_date", None)
    if date is not None:
        members["redriveDate"] = date
    return members


def _item(execution: Any, state_machine_arn: str) -> dict[str, Any]:
    item: dict[str, Any] = {
        "executionArn": execution.execution_arn,
        "name": execution.name,
        "startDate": execution.start_date,
        "stateMachineArn": state_machine_arn,
        "status": execution.status,
    }
    if execution.status in ENDED and execution.stop_date is not None:
        item["stopDate"] = execution.stop_date
    return item | redrive_members(execution)


def list_state_machine_executions(inner: Any, response: Any) -> Any:
    """ListExecutions with stateMachineArn: moto's listing (paging, status filter) with each item
    completed; with a redriveFilter the executions are selected before paging, as moto's own
    status filter is, so a page holds `maxResults` matches and moto's tokens keep working."""
    from moto.core.responses import ActionResult
    from moto.stepfunctions.models import StepFunctionBackend
    from moto.stepfunctions.utils import PAGINATION_MODEL
    from moto.utilities.paginator import Paginator

    redrive_filter = response._get_param("redriveFilter")
    check_redrive_filter(redrive_filter)
    if redrive_filter is None:
        result = inner(response)
        backend = response.stepfunction_backend
        listed = result.result.get("executions", [])
        for index, item in enumerate(listed):
            listed[index] = _item(backend.describe_execution(item["executionArn"]), item["stateMachineArn"])
        return result
    backend = response.stepfunction_backend
    arn = response._get_param("stateMachineArn")
    state_machine = backend.describe_state_machine(arn)
    # The undecorated listing: moto's status filter and order, without its paging.
    unpaged: Any = StepFunctionBackend.list_executions.__wrapped__  # type: ignore[attr-defined]
    executions = unpaged(backend, arn, status_filter=response._get_param("statusFilter"))
    selected = [e for e in executions if redrive_selected(getattr(e, "sdflow_redrive_count", 0), redrive_filter)]
    model = PAGINATION_MODEL["list_executions"]
    paginator = Paginator(
        max_results=response._get_int_param("maxResults") or model["limit_default"],
        max_results_default=model["limit_default"],
        starting_token=response._get_param("nextToken"),
        unique_attribute=model["unique_attribute"],
        param_values_to_check={
            "state_machine_arn": arn,
            "status_filter": response._get_param("statusFilter"),
            "redrive_filter": redrive_filter,
        },
    )
    page, next_token = paginator.paginate(selected)
    return ActionResult(
        {"executions": [_item(execution, state_machine.arn) for execution in page], "nextToken": next_token}
    )
