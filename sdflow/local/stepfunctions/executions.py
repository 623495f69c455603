"""Step Functions: an execution's own records, kept on moto's objects, which the API
(stepfunctions/api.py) and redrive (stepfunctions/redrive.py) both read: its lock, its history
(ending at ExecutionAborted once stopped), its status-change event, and DescribeExecution's redrive
members."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

from sdflow.local.runtime import current_clock
from sdflow.local.stepfunctions import map_runs
from sdflow.local.stepfunctions.map_runs import publish_status_change

# Developer Guide, "Redrive eligibility for unsuccessful executions".
REDRIVABLE_PERIOD = dt.timedelta(days=14)
MAX_OPEN_TIME = dt.timedelta(days=365)
HISTORY_EVENT_LIMIT = 24_999
REDRIVABLE = "REDRIVABLE"
NOT_REDRIVABLE = "NOT_REDRIVABLE"


def execution_lock(obj: Any) -> threading.Lock:
    lock: threading.Lock = vars(obj).setdefault("_sdflow_lock", threading.Lock())
    return lock


def is_express(execution: Any) -> bool:
    return str(getattr(execution, "sm_type", None) or "STANDARD").upper().endswith("EXPRESS")


def event_manager(execution: Any) -> Any:
    worker = execution.exec_worker
    if worker is None:
        return None
    manager = getattr(worker, "_sdflow_event_manager", None)
    return manager if manager is not None else getattr(worker.env, "event_manager", None)


def history(execution: Any) -> list[dict[str, Any]]:
    """The events, ending at ExecutionAborted for a stopped execution (what the interrupted thread
    records after the stop never happened on AWS)."""
    manager = event_manager(execution)
    events: list[dict[str, Any]] = manager.get_event_history() if manager is not None else []
    abort = getattr(execution, "_sdflow_abort", None)
    if abort is None:
        return events
    from moto.core.utils import iso_8601_datetime_with_milliseconds

    stop_date, error, cause, length = abort
    details = {key: value for key, value in (("error", error), ("cause", cause)) if value is not None}
    aborted = {
        "id": length + 1,
        "previousEventId": 0,  # as moto's Program records ExecutionAborted
        "type": "ExecutionAborted",
        "timestamp": iso_8601_datetime_with_milliseconds(stop_date),
        "executionAbortedEventDetails": details,
    }
    return [*events[:length], aborted]


def execution_detail(execution: Any, status: str) -> dict[str, Any]:
    """The `detail` of a status-change event: "the same information as the DescribeExecution API"
    (Step Functions Developer Guide, EventBridge events for Step Functions execution status changes),
    redrive members included (stepfunctions/redrive.py)."""
    # The interpreter keeps the output as a value: a string result is still JSON-encoded.
    output = map_runs.compact_json(execution.output) if status == "SUCCEEDED" else None
    detail = map_runs.status_detail(
        execution_arn=execution.execution_arn,
        state_machine_arn=execution.state_machine.arn,
        name=execution.name,
        status=status,
        start=execution.start_date,
        stop=execution.stop_date if status != "RUNNING" else None,
        input_text=execution.execution_input,
        output_text=output,
        error=execution.error,
        cause=execution.cause,
    )
    redrive = redrive_fields_of(execution, status)
    if "redriveDate" in redrive:
        redrive["redriveDate"] = map_runs.epoch_ms(redrive["redriveDate"])
    return {**detail, **redrive}


def publish_execution(execution: Any, status: str) -> None:
    # Developer Guide, "Standard versus Express workflows": only standard workflows emit events.
    if not is_express(execution):
        publish_status_change(execution.account_id, execution.region_name, lambda: execution_detail(execution, status))


def redrive_status(execution: Any, status: str | None = None) -> tuple[str, str | None]:
    """DescribeExecution's redriveStatus and redriveStatusReason (API reference, DescribeExecution);
    `status` where the execution's is not set yet (the RUNNING event goes out before it is)."""
    status = status or execution.status
    if is_express(execution):
        return NOT_REDRIVABLE, "RedriveExecution is not supported by EXPRESS state machines"
    if status in ("RUNNING", "SUCCEEDED"):
        return NOT_REDRIVABLE, f"Execution is {status} and cannot be redriven"
    now = current_clock().now()
    if execution.stop_date is not None and now - execution.stop_date > REDRIVABLE_PERIOD:
        return NOT_REDRIVABLE, "Execution redrivable period exceeded"
    if now - execution.start_date > MAX_OPEN_TIME:
        return NOT_REDRIVABLE, "Execution has exceeded the max execution time"
    if len(history(execution)) >= HISTORY_EVENT_LIMIT:
        return NOT_REDRIVABLE, "Execution history event limit exceeded"
    return REDRIVABLE, None


def redrive_fields_of(execution: Any, status: str | None = None) -> dict[str, Any]:
    """The redrive members of DescribeExecution (and of the status-change event's detail)."""
    fields: dict[str, Any] = {"redriveCount": getattr(execution, "sdflow_redrive_count", 0)}
    date = getattr(execution, "sdflow_redrive_date", None)
    if date is not None:
        fields["redriveDate"] = date
    redrivable, reason = redrive_status(execution, status)
    fields["redriveStatus"] = redrivable
    if reason is not None:
        fields["redriveStatusReason"] = reason
    return fields
