"""One reading of an execution's history: what each state did, for `status`, `watch` and the console.

A state's events hang off its `<Type>StateEntered` event through `previousEventId` (Step Functions
API reference, HistoryEvent: "The id of the previous event"): TaskScheduled points at the entry,
TaskStarted at TaskScheduled, TaskFailed at TaskSubmitted, a retry's TaskScheduled at the
TaskFailed before it. Following that chain attributes every event to its state, even when
branches of a Parallel or an inline Map run side by side.

A state's status is its newest entry's (a redrive or a loop enters it again):
- running: entered, no exit yet (a retry after a failed attempt is running again, attempts + 1);
- succeeded: exited after a successful attempt;
- caught: exited after a failed attempt, i.e. a Catch took the failure and the run went on. Before
  this module `watch` read "exited" as success and printed ✔ for a Train model whose job died;
- failed: its failure ended the execution (no exit follows), or the execution failed or timed
  out while it ran;
- aborted: the execution was stopped while it ran.
States never entered are absent: "not reached"."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

PAGE_SIZE = 1000  # GetExecutionHistory's maxResults ceiling

# Events that end an attempt of a state in failure, and where their error/cause sit.
_FAILURE_DETAILS = {
    "TaskFailed": "taskFailedEventDetails",
    "TaskTimedOut": "taskTimedOutEventDetails",
    "TaskStartFailed": "taskStartFailedEventDetails",
    "TaskSubmitFailed": "taskSubmitFailedEventDetails",
    "LambdaFunctionFailed": "lambdaFunctionFailedEventDetails",
    "LambdaFunctionTimedOut": "lambdaFunctionTimedOutEventDetails",
    "LambdaFunctionStartFailed": "lambdaFunctionStartFailedEventDetails",
    "LambdaFunctionScheduleFailed": "lambdaFunctionScheduleFailedEventDetails",
    "ActivityFailed": "activityFailedEventDetails",
    "ActivityTimedOut": "activityTimedOutEventDetails",
    "ActivityScheduleFailed": "activityScheduleFailedEventDetails",
    "MapRunFailed": "mapRunFailedEventDetails",
    "MapStateFailed": None,
    "ParallelStateFailed": None,
    "EvaluationFailed": "evaluationFailedEventDetails",
}
# A new attempt of a state that had failed: Retry scheduled it again.
_ATTEMPT_STARTS = frozenset({"TaskScheduled", "LambdaFunctionScheduled", "ActivityScheduled", "MapRunStarted"})
_TERMINAL = {
    "ExecutionFailed": ("failed", "executionFailedEventDetails"),
    "ExecutionTimedOut": ("failed", "executionTimedOutEventDetails"),
    "ExecutionAborted": ("aborted", "executionAbortedEventDetails"),
}
STATUSES = ("running", "succeeded", "failed", "caught", "aborted")


@dataclass
class StateRun:
    """The newest entry of one state."""

    name: str
    type: str
    status: str
    entered: datetime
    exited: datetime | None = None
    attempts: int = 1
    error: str | None = None
    cause: str | None = None
    input: str | None = None
    output: str | None = None
    event_ids: list[int] = field(default_factory=list)
    _failed_attempt: bool = False

    def duration_s(self, now: datetime) -> float:
        return max(0.0, ((self.exited or now) - self.entered).total_seconds())


@dataclass
class ExecutionHistory:
    events: list[dict[str, Any]]
    states: dict[str, StateRun]
    redrive_count: int = 0

    def event(self, event_id: int) -> dict[str, Any] | None:
        # Ids are 1..n in order in a whole history; fall back to a search for a partial one.
        if 0 < event_id <= len(self.events) and self.events[event_id - 1].get("id") == event_id:
            return self.events[event_id - 1]
        return next((e for e in self.events if e.get("id") == event_id), None)

    def statuses(self) -> dict[str, str]:
        return {name: run.status for name, run in self.states.items()}


def _details(event: dict[str, Any], key: str | None) -> dict[str, Any]:
    if key is None:
        return {}
    return event.get(key) or {}


def _state_type(event_type: str, suffix: str) -> str:
    return event_type.removesuffix(suffix) or "Task"


class _Reader:
    def __init__(self) -> None:
        self.states: dict[str, StateRun] = {}
        self.owner: dict[int, str] = {}  # event id -> state name
        self.redrives = 0
        self._last_running: list[str] = []  # entry order, for events without a usable previousEventId

    def absorb(self, event: dict[str, Any]) -> None:
        kind = str(event.get("type", ""))
        event_id = int(event.get("id") or 0)
        if kind.endswith("StateEntered"):
            self._entered(event, kind, event_id)
            return
        if kind.endswith("StateExited"):
            self._exited(event, event_id)
            return
        if kind in _TERMINAL:
            self._terminal(event, kind)
            return
        if kind == "ExecutionRedriven":
            self.redrives += 1
            return
        name = self._owner_of(event)
        if name is None:
            return
        self.owner[event_id] = name
        run = self.states[name]
        run.event_ids.append(event_id)
        if kind in _FAILURE_DETAILS:
            details = _details(event, _FAILURE_DETAILS[kind])
            run.status, run._failed_attempt = "failed", True
            run.error, run.cause = details.get("error") or run.error, details.get("cause") or run.cause
        elif kind in _ATTEMPT_STARTS and run._failed_attempt:
            run.status, run._failed_attempt = "running", False
            run.attempts += 1

    def _entered(self, event: dict[str, Any], kind: str, event_id: int) -> None:
        details = event.get("stateEnteredEventDetails") or {}
        name = str(details.get("name", ""))
        self.states[name] = StateRun(
            name=name,
            type=_state_type(kind, "StateEntered"),
            status="running",
            entered=event["timestamp"],
            input=details.get("input"),
            event_ids=[event_id],
        )
        self.owner[event_id] = name
        self._last_running = [n for n in self._last_running if n != name] + [name]

    def _exited(self, event: dict[str, Any], event_id: int) -> None:
        details = event.get("stateExitedEventDetails") or {}
        name = str(details.get("name", ""))
        run = self.states.get(name)
        if run is None:  # a partial history: the entry is on a page not read
            return
        run.exited, run.output = event["timestamp"], details.get("output")
        run.status = "caught" if run._failed_attempt else "succeeded"
        run.event_ids.append(event_id)
        self.owner[event_id] = name
        self._last_running = [n for n in self._last_running if n != name]

    def _terminal(self, event: dict[str, Any], kind: str) -> None:
        status, key = _TERMINAL[kind]
        details = _details(event, key)
        for run in self.states.values():
            if run.status == "running":
                run.status = status
                run.exited = event["timestamp"]
                if status == "failed" and not run.error:
                    run.error, run.cause = details.get("error"), details.get("cause")

    def _owner_of(self, event: dict[str, Any]) -> str | None:
        previous = int(event.get("previousEventId") or 0)
        if previous in self.owner:
            return self.owner[previous]
        running = [n for n in self._last_running if self.states[n].status in {"running", "failed"}]
        return running[-1] if running else None


def read(events: list[dict[str, Any]]) -> ExecutionHistory:
    """`events` oldest first, as GetExecutionHistory returns them without reverseOrder."""
    reader = _Reader()
    for event in events:
        reader.absorb(event)
    return ExecutionHistory(events=events, states=reader.states, redrive_count=reader.redrives)


def fetch(sfn: Any, execution_arn: str) -> list[dict[str, Any]]:
    """The whole history, oldest first."""
    events: list[dict[str, Any]] = []
    kwargs: dict[str, Any] = {"executionArn": execution_arn, "maxResults": PAGE_SIZE}
    while True:
        page = sfn.get_execution_history(**kwargs)
        events.extend(page["events"])
        if not page.get("nextToken"):
            return events
        kwargs["nextToken"] = page["nextToken"]


def decode(text: str | None) -> Any:
    """A state's input or output: the parsed JSON when it parses, else the text as it is."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text
