"""What a run had done when it ended, read back from its execution history.

The state machine no longer calls a Notify state, so nothing hands the notification the
state: GetExecutionHistory does. Read newest first (reverseOrder), a page at a time, until
three things are known:
- the terminal event's error and cause (ExecutionFailed / ExecutionTimedOut / ExecutionAborted
  details; after a redrive, the newest one);
- the state that was running: the newest top-level `<Type>StateEntered` with no
  `<Type>StateExited` after it;
- the state the run had built: the newest top-level `<Type>StateExited` output, which holds what
  the steps wrote (`config`, `dataset`, `training`).
"Top-level" leaves out the states inside an inline Map iteration or a Parallel branch (between
MapIterationStarted and its end, between ParallelStateStarted and its end); a Distributed Map's
children are executions of their own and never appear here. Event types and their detail
fields: Step Functions API reference, HistoryEvent."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# GetExecutionHistory returns at most 1,000 events a page.
PAGE_SIZE = 1000
_TERMINAL_DETAILS = {
    "ExecutionFailed": "executionFailedEventDetails",
    "ExecutionTimedOut": "executionTimedOutEventDetails",
    "ExecutionAborted": "executionAbortedEventDetails",
}
# Read newest first, the end of a nested block is met before its start.
_NEST_END = frozenset(
    {
        "MapIterationSucceeded",
        "MapIterationFailed",
        "MapIterationAborted",
        "ParallelStateSucceeded",
        "ParallelStateFailed",
        "ParallelStateAborted",
    }
)
_NEST_START = frozenset({"MapIterationStarted", "ParallelStateStarted"})


@dataclass
class RunHistory:
    state: dict[str, Any] = field(default_factory=dict)
    running_state: str | None = None
    error: str | None = None
    cause: str | None = None
    _terminal_seen: bool = False
    _exit_seen: bool = False
    _entered_seen: bool = False

    def complete(self) -> bool:
        return self._terminal_seen and self._exit_seen and self._entered_seen

    def _take_terminal(self, event: dict[str, Any]) -> None:
        details = event.get(_TERMINAL_DETAILS[event["type"]]) or {}
        self.error, self.cause = details.get("error"), details.get("cause")
        self._terminal_seen = True

    def _take_entered(self, event: dict[str, Any]) -> None:
        if not self._exit_seen:
            # Entered with no exit after it: the state the run was in when it ended.
            self.running_state = (event.get("stateEnteredEventDetails") or {}).get("name")
        self._entered_seen = True

    def _take_exited(self, event: dict[str, Any]) -> None:
        output = (event.get("stateExitedEventDetails") or {}).get("output")
        try:
            decoded = json.loads(output) if output else {}
        except ValueError:
            decoded = {}
        self.state = decoded if isinstance(decoded, dict) else {}
        self._exit_seen = True


def _absorb(history: RunHistory, event: dict[str, Any], depth: int) -> int:
    kind = str(event.get("type", ""))
    if kind in _NEST_END:
        return depth + 1
    if kind in _NEST_START:
        return max(0, depth - 1)
    if kind in _TERMINAL_DETAILS and not history._terminal_seen:
        history._take_terminal(event)
    elif depth == 0 and kind.endswith("StateEntered") and not history._entered_seen:
        history._take_entered(event)
    elif depth == 0 and kind.endswith("StateExited") and not history._exit_seen:
        history._take_exited(event)
    return depth


def read_history(sfn: Any, execution_arn: str) -> RunHistory:
    history = RunHistory()
    request: dict[str, Any] = {
        "executionArn": execution_arn,
        "reverseOrder": True,
        "maxResults": PAGE_SIZE,
        "includeExecutionData": True,
    }
    depth = 0
    while True:
        page = sfn.get_execution_history(**request)
        for event in page.get("events", []):
            depth = _absorb(history, event, depth)
            if history.complete():
                return history
        token = page.get("nextToken")
        if not token:
            return history
        request["nextToken"] = token
