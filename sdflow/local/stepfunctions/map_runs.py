"""Step Functions: the Map Runs' records: a Distributed Map's child workflow executions as AWS lists
them, paging, and the "Step Functions Execution Status Change" events, used by stepfunctions/api.py
and stepfunctions/executions.py; stepfunctions/maprun.py keeps them as the children run.

moto runs each Map item as a frame inside the parent's thread and keeps no record of it: here each
started child gets one (ARN, status, dates, input, output, error, cause) on its MapRunRecord."""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moto.core.exceptions import AWSError

from sdflow.local.runtime import current_clock, runtime_or_none

SOURCE = "aws.states"
DETAIL_TYPE = "Step Functions Execution Status Change"
# Developer Guide, EventBridge payloads: "If the combined escaped input and escaped output sent to
# EventBridge exceeds 248KB, then the input will be excluded. Similarly, if the escaped output
# exceeds 248KB, then the output will be excluded."
EVENT_DATA_LIMIT = 248 * 1024
# API reference (ListExecutions, GetExecutionHistory, ListMapRuns), maxResults: "The default is 100
# and the maximum allowed page size is 1000. A value of 0 uses the default."
PAGE_DEFAULT = 100
PAGE_MAX = 1000
UNSET: Any = object()


class StepFunctionsValidationError(AWSError):
    """API reference, Common Errors: ValidationException, the input fails to satisfy a constraint."""

    TYPE = "ValidationException"


class PageTokenInvalid(AWSError):
    """API reference, nextToken: "Keep all other arguments unchanged. … Using an expired pagination
    token will return an HTTP 400 InvalidToken error"."""

    TYPE = "InvalidToken"


class MapRunNotFound(AWSError):
    """API reference, DescribeMapRun / ListExecutions: ResourceNotFound, "Could not find the
    referenced resource"."""

    TYPE = "ResourceNotFound"


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _epoch_ms(value: dt.datetime | None) -> int | None:
    return None if value is None else int(value.timestamp() * 1000)


epoch_ms = _epoch_ms


def _iso(value: dt.datetime) -> str:
    from moto.core.utils import iso_8601_datetime_with_milliseconds

    return str(iso_8601_datetime_with_milliseconds(value))


# ---------------------------------------------------------------- status-change events


def status_detail(
    *,
    execution_arn: str,
    state_machine_arn: str,
    name: str,
    status: str,
    start: dt.datetime,
    stop: dt.datetime | None,
    input_text: str | None,
    output_text: str | None,
    error: str | None,
    cause: str | None,
) -> dict[str, Any]:
    """The event `detail` (Developer Guide, Step Functions event examples), with the 248 KB rule."""
    output_size = len(json.dumps(output_text)) if output_text is not None else 0
    keep_output = output_text is not None and output_size <= EVENT_DATA_LIMIT
    input_size = len(json.dumps(input_text)) if input_text is not None else 0
    keep_input = input_text is not None and input_size + (output_size if keep_output else 0) <= EVENT_DATA_LIMIT
    detail: dict[str, Any] = {
        "executionArn": execution_arn,
        "stateMachineArn": state_machine_arn,
        "name": name,
        "status": status,
        "startDate": _epoch_ms(start),
        "stopDate": _epoch_ms(stop),
        "input": input_text if keep_input else None,
        "inputDetails": {"included": keep_input},
        "output": output_text if keep_output else None,
        "outputDetails": {"included": keep_output} if output_text is not None else None,
    }
    detail.update({key: value for key, value in (("error", error), ("cause", cause)) if value is not None})
    return detail


def _takes_states_events(rule: Any) -> bool:
    """Whether a rule could take a Step Functions event at all; most rules name other sources."""
    if getattr(rule, "state", "ENABLED") != "ENABLED" or rule.event_pattern is None:
        return False
    pattern = rule.event_pattern.get_pattern()
    if not pattern:  # a scheduled rule: it takes no events
        return False
    sources = pattern.get("source")
    return not (isinstance(sources, list) and all(isinstance(s, str) for s in sources) and SOURCE not in sources)


def publish_status_change(account: str, region: str, detail: Callable[[], dict[str, Any]]) -> None:
    """Puts the event on the account's default bus through moto's backend (PutEvents at the API
    refuses `aws.*` sources from callers, as AWS does). The detail is built only when some rule
    could take the event, which keeps a 10,000-child Map cheap."""
    from moto.events.models import events_backends

    backend = events_backends[account][region]
    bus = backend.event_buses.get("default")
    rules = [rule for rule in list(bus.rules.values()) if _takes_states_events(rule)] if bus is not None else []
    if not rules:
        return
    body = detail()
    runtime = runtime_or_none()
    if runtime is not None and runtime.drops_status_event(body["executionArn"], body["status"]):
        return  # faults.drop_end_event: delivered best effort, this one was not
    envelope: Any = {
        "version": "0",
        "source": SOURCE,
        "detail-type": DETAIL_TYPE,
        "account": account,
        "region": region,
        "resources": [body["executionArn"]],
        "detail": body,
    }
    if any(rule.event_pattern.matches_event(envelope) for rule in rules):
        backend.put_events(
            [
                {
                    "Source": SOURCE,
                    "DetailType": DETAIL_TYPE,
                    "Detail": json.dumps(body),
                    "Resources": [body["executionArn"]],
                }
            ]
        )


# ---------------------------------------------------------------- paging


def page_size(value: Any) -> int:
    if value is None or value == 0:
        return PAGE_DEFAULT
    if not isinstance(value, int) or not 0 < value <= PAGE_MAX:
        raise StepFunctionsValidationError(
            f"1 validation error detected: Value '{value}' at 'maxResults' failed to satisfy constraint: "
            f"Member must have value less than or equal to {PAGE_MAX} and greater than or equal to 0"
        )
    return value


def encode_page_token(request: dict[str, Any], position: int) -> str:
    raw = compact_json({"request": request, "position": position}).encode()
    return base64.urlsafe_b64encode(raw).decode()


def decode_page_token(token: str | None, request: dict[str, Any]) -> int | None:
    """The position a nextToken points at, or None without one; InvalidToken for a token of
    another request (AWS: keep every other argument unchanged) or one not made here."""
    if not token:
        return None
    try:
        decoded = json.loads(base64.urlsafe_b64decode(token.encode()))
        position = decoded["position"]
        same_request = decoded["request"] == request
    except (ValueError, KeyError, TypeError, binascii.Error):
        raise PageTokenInvalid(f"Invalid Token: '{token}' is not a nextToken this API returned") from None
    if not same_request or not isinstance(position, int):
        raise PageTokenInvalid("Invalid Token: the nextToken belongs to a request with other arguments")
    return position


# ---------------------------------------------------------------- child executions


@dataclass
class ChildExecution:
    """One child workflow execution of a Map Run, as DescribeExecution / ListExecutions show it."""

    arn: str
    name: str
    state_machine_arn: str
    map_run_arn: str
    start_date: dt.datetime
    input_text: str
    status: str = "RUNNING"
    stop_date: dt.datetime | None = None
    output_text: str | None = None
    error: str | None = None
    cause: str | None = None
    index: int = -1  # the item's index in the Map Run
    # Redriven with its Map Run (stepfunctions/redrive_map.py): the same execution, run again.
    redrive_count: int = 0
    redrive_date: dt.datetime | None = None

    def redrive_fields(self) -> dict[str, Any]:
        """DescribeExecution's redrive members (API reference) for a STANDARD child."""
        fields: dict[str, Any] = {"redriveCount": self.redrive_count}
        if self.redrive_date is not None:
            fields["redriveDate"] = self.redrive_date
        if self.status in ("RUNNING", "SUCCEEDED"):
            fields["redriveStatus"] = "NOT_REDRIVABLE"
            fields["redriveStatusReason"] = f"Execution is {self.status} and cannot be redriven"
        else:
            fields["redriveStatus"] = "REDRIVABLE"
        return fields

    def list_item(self) -> dict[str, Any]:
        item: dict[str, Any] = {
            "executionArn": self.arn,
            "stateMachineArn": self.state_machine_arn,
            "name": self.name,
            "status": self.status,
            "startDate": self.start_date,
            "mapRunArn": self.map_run_arn,
            "itemCount": 1,  # one item per child: no ItemBatcher
        }
        if self.stop_date is not None:
            item["stopDate"] = self.stop_date
        item["redriveCount"] = self.redrive_count
        if self.redrive_date is not None:
            item["redriveDate"] = self.redrive_date
        return item

    def describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {
            "executionArn": self.arn,
            "stateMachineArn": self.state_machine_arn,
            "name": self.name,
            "status": self.status,
            "startDate": self.start_date,
            "input": self.input_text,
            "inputDetails": {"included": True},
            "mapRunArn": self.map_run_arn,
        }
        if self.stop_date is not None:
            described["stopDate"] = self.stop_date
        if self.output_text is not None:
            described.update(output=self.output_text, outputDetails={"included": True})
        described.update({key: value for key, value in (("error", self.error), ("cause", self.cause)) if value})
        described.update(self.redrive_fields())
        return described

    def detail(self) -> dict[str, Any]:
        redrive = self.redrive_fields()
        if "redriveDate" in redrive:
            redrive["redriveDate"] = _epoch_ms(redrive["redriveDate"])
        return redrive | status_detail(
            execution_arn=self.arn,
            state_machine_arn=self.state_machine_arn,
            name=self.name,
            status=self.status,
            start=self.start_date,
            stop=self.stop_date,
            input_text=self.input_text,
            output_text=self.output_text,
            error=self.error,
            cause=self.cause,
        )


@dataclass
class MapRunChildren:
    """The child executions one MapRunRecord started, in start order."""

    record: Any
    total_items: int
    standard: bool
    children: list[ChildExecution] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def where(self) -> tuple[str, str]:
        parts = self.record.map_run_arn.split(":")  # arn:aws:states:<region>:<account>:mapRun:…
        return parts[4], parts[3]

    def start(self, item: Any, index: int = -1) -> ChildExecution:
        name = str(uuid.uuid4())
        # "arn:…:execution:<machine>/<label>:<id>": the Map Run's state machine ARN, as an execution.
        machine = self.record.map_state_machine_arn
        child = ChildExecution(
            arn=f"{machine.replace(':stateMachine:', ':execution:', 1)}:{name}",
            name=name,
            state_machine_arn=machine,
            map_run_arn=self.record.map_run_arn,
            start_date=current_clock().now(),
            input_text=compact_json(item),
            index=index,
        )
        with self.lock:
            self.children.append(child)
        if self.standard:
            publish_status_change(*self.where, child.detail)
        return child

    def restart(self, child: ChildExecution) -> ChildExecution:
        """The Map Run is redriven: the same child execution runs again (Developer Guide,
        "Redriving Map Runs": STANDARD children are redriven with RedriveExecution)."""
        with self.lock:
            child.status, child.stop_date = "RUNNING", None
            child.output_text = child.error = child.cause = None
            child.redrive_count += 1
            child.redrive_date = current_clock().now()
        if self.standard:
            publish_status_change(*self.where, child.detail)
        return child

    def finish(self, child: ChildExecution, state: Any, output: Any, child_input: Any = UNSET) -> None:
        """The child ended; `child_input` is its input after ItemSelector, where known
        (stepfunctions/map.py keeps it on the child's frame), else the raw item stays."""
        status, error, cause = _outcome(state)
        with self.lock:
            if child.status != "RUNNING":  # aborted with its parent meanwhile
                return
            if child_input is not UNSET:
                child.input_text = compact_json(child_input)
            child.stop_date = current_clock().now()
            child.output_text = compact_json(output) if status == "SUCCEEDED" else None
            child.error, child.cause, child.status = error, cause, status
        if self.standard:
            publish_status_change(*self.where, child.detail)

    def abort(self, stop_date: dt.datetime) -> None:
        with self.lock:
            running = [child for child in self.children if child.status == "RUNNING"]
            for child in running:
                child.status, child.stop_date = "ABORTED", stop_date
        if self.standard:
            for child in running:
                publish_status_change(*self.where, child.detail)

    def counts(self, map_run_running: bool) -> dict[str, int]:
        """MapRunExecutionCounts: pending children only while the Map Run still runs."""
        statuses = [child.status for child in self.children]
        started = len(statuses)
        pending = max(self.total_items - started, 0) if map_run_running else 0
        return {
            "pending": pending,
            "running": statuses.count("RUNNING"),
            "succeeded": statuses.count("SUCCEEDED"),
            "failed": statuses.count("FAILED"),
            "timedOut": statuses.count("TIMED_OUT"),
            "aborted": statuses.count("ABORTED"),
            "total": started + pending,
        }


def _outcome(state: Any) -> tuple[str, str | None, str | None]:
    from moto.stepfunctions.parser.asl.eval.program_state import (
        ProgramEnded,
        ProgramError,
        ProgramStopped,
        ProgramTimedOut,
    )

    if isinstance(state, ProgramEnded):
        return "SUCCEEDED", None, None
    if isinstance(state, ProgramError):
        details = state.error or {}
        return "FAILED", details.get("error"), details.get("cause")
    if isinstance(state, ProgramTimedOut):
        return "TIMED_OUT", None, None
    if isinstance(state, ProgramStopped):
        return "ABORTED", state.error, state.cause
    return "FAILED", "States.Runtime", f"the child workflow ended in state {type(state).__name__}"


# ---------------------------------------------------------------- Map Runs


def _map_run_records(backend: Any) -> list[Any]:
    records = []
    for machine in list(backend.state_machines):
        for execution in list(machine.executions):
            env = execution.exec_worker.env if getattr(execution, "exec_worker", None) is not None else None
            if env is not None:
                records += env.map_run_record_pool_manager.get_all()
    return records


def find_map_run(backend: Any, map_run_arn: str) -> Any:
    for record in _map_run_records(backend):
        if record.map_run_arn == map_run_arn:
            return record
    raise MapRunNotFound(f"Resource not found: '{map_run_arn}'")


def find_child(backend: Any, execution_arn: str | None) -> ChildExecution | None:
    if not execution_arn:
        return None
    for record in _map_run_records(backend):
        prefix = record.map_state_machine_arn.replace(":stateMachine:", ":execution:", 1) + ":"
        runs = getattr(record, "_sdflow_children", None)
        if runs is not None and execution_arn.startswith(prefix):
            for child in list(runs.children):
                if child.arn == execution_arn:
                    return child
    return None


def list_children(
    record: Any, status_filter: str | None, limit: int, start: int | None, redrive_filter: str | None = None
) -> tuple[list[dict[str, Any]], int | None]:
    """A page of the Map Run's children, most recent first; the position is an index into the
    start-ordered list, so children started between pages do not shift it. `redrive_filter`:
    REDRIVEN keeps the children redriven at least once, NOT_REDRIVEN the others."""
    runs = getattr(record, "_sdflow_children", None)
    children = list(runs.children) if runs is not None else []
    index = len(children) - 1 if start is None else min(start, len(children) - 1)
    items: list[dict[str, Any]] = []
    while index >= 0 and len(items) < limit:
        child = children[index]
        redrive_kept = redrive_filter is None or (child.redrive_count > 0) == (redrive_filter == "REDRIVEN")
        if (status_filter is None or child.status == status_filter) and redrive_kept:
            items.append(child.list_item())
        index -= 1
    return items, (index if index >= 0 else None)


def abort_map_run(record: Any, stop_date: dt.datetime) -> None:
    """The parent was stopped: a running Map Run and its running children end ABORTED."""
    if getattr(record, "_sdflow_aborted_at", None) is not None or record.status != "RUNNING":
        return
    record._sdflow_aborted_at = stop_date
    runs = getattr(record, "_sdflow_children", None)
    if runs is not None:
        runs.abort(stop_date)


def _status_override(record: Any, shown: dict[str, Any]) -> dict[str, Any]:
    aborted_at = getattr(record, "_sdflow_aborted_at", None)
    if aborted_at is not None:
        shown.update(status="ABORTED", stopDate=_iso(aborted_at))
    return shown


def describe_map_run(record: Any, described: dict[str, Any]) -> dict[str, Any]:
    described = _status_override(record, dict(described))
    # API reference, DescribeMapRun: redriveCount (0 until redriven) and redriveDate.
    described["redriveCount"] = getattr(record, "sdflow_redrive_count", 0)
    if getattr(record, "sdflow_redrive_date", None) is not None:
        described["redriveDate"] = _iso(record.sdflow_redrive_date)
    runs = getattr(record, "_sdflow_children", None)
    if runs is not None:
        counts = runs.counts(map_run_running=described.get("status") == "RUNNING")
        for key in ("executionCounts", "itemCounts"):
            written = dict(described.get(key) or {}).get("resultsWritten", 0)
            described[key] = {**counts, "resultsWritten": written}
    return described


def list_item(record: Any) -> dict[str, Any]:
    return _status_override(record, dict(record.list_item()))
