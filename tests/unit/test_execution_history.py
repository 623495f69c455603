"""Reading back what a run had done from its execution history, newest first, page by page."""

from __future__ import annotations

import json
from typing import Any

from sdflow_common import execution_history

EXECUTION_ARN = "arn:aws:states:us-east-1:123456789012:execution:sdflow-pipeline-test:cats-v1-abc"


class PagedHistory:
    """GetExecutionHistory in pages of `size`, newest first: a 25,000-event history spans pages."""

    def __init__(self, events: list[dict[str, Any]], size: int) -> None:
        self.events, self.size, self.requests = list(reversed(events)), size, 0

    def get_execution_history(self, **params: Any) -> dict[str, Any]:
        assert params["reverseOrder"] is True
        self.requests += 1
        start = int(params.get("nextToken", "0"))
        page: dict[str, Any] = {"events": self.events[start : start + self.size]}
        if start + self.size < len(self.events):
            page["nextToken"] = str(start + self.size)
        return page


def _entered(name: str, kind: str = "Task") -> dict[str, Any]:
    return {"type": f"{kind}StateEntered", "stateEnteredEventDetails": {"name": name}}


def _exited(name: str, output: Any, kind: str = "Task") -> dict[str, Any]:
    return {"type": f"{kind}StateExited", "stateExitedEventDetails": {"name": name, "output": json.dumps(output)}}


def test_read_history_nested_states_and_pages_are_skipped_for_the_top_level() -> None:
    events = [
        {"type": "ExecutionStarted"},
        _entered("Validate run"),
        _exited("Validate run", {"config": {"run_id": "r"}}),
        _entered("Checks", "Parallel"),
        {"type": "ParallelStateStarted"},
        _entered("inner", "Pass"),
        _exited("inner", {"inner": True}, "Pass"),
        {"type": "ParallelStateSucceeded"},
        _exited("Checks", {"config": {"run_id": "r"}, "checked": True}, "Parallel"),
        _entered("Train model"),
        {"type": "TaskScheduled"},
        *[{"type": "TaskSubmitted"} for _ in range(40)],
        {"type": "ExecutionFailed", "executionFailedEventDetails": {"error": "TrainingJobFailed", "cause": "oom"}},
    ]
    sfn = PagedHistory(events, size=7)

    history = execution_history.read_history(sfn, EXECUTION_ARN)

    assert history.running_state == "Train model"
    assert history.state == {"config": {"run_id": "r"}, "checked": True}
    assert (history.error, history.cause) == ("TrainingJobFailed", "oom")
    assert sfn.requests == 7, "reading stops at the page holding the newest exit (of 8 pages)"
