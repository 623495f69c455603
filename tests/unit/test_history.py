"""The one reading of an execution history that `status`, `watch` and the console share."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sdflow import history, progress

T0 = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)


class History:
    """Events as GetExecutionHistory returns them: ids 1..n, previousEventId chaining a state's events."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def add(self, kind: str, previous: int | None = None, **details: Any) -> int:
        event_id = len(self.events) + 1
        event = {"id": event_id, "type": kind, "timestamp": T0 + timedelta(seconds=event_id)}
        event["previousEventId"] = event_id - 1 if previous is None else previous
        event.update(details)
        self.events.append(event)
        return event_id

    def enter(self, name: str, kind: str = "Task", previous: int | None = None) -> int:
        return self.add(f"{kind}StateEntered", previous, stateEnteredEventDetails={"name": name, "input": '{"in": 1}'})

    def exit(self, name: str, kind: str = "Task", previous: int | None = None) -> int:
        return self.add(f"{kind}StateExited", previous, stateExitedEventDetails={"name": name, "output": '{"out": 2}'})

    def fail(self, error: str, previous: int | None = None) -> int:
        return self.add("TaskFailed", previous, taskFailedEventDetails={"error": error, "cause": f"{error} cause"})


def test_history_failure_caught_by_catch_reads_caught_not_succeeded() -> None:
    h = History()
    h.add("ExecutionStarted", 0)
    h.enter("Build dataset index")
    h.add("TaskScheduled")
    h.add("TaskStarted")
    h.fail("Runtime.ExitError")
    h.exit("Build dataset index")
    h.enter("Notify failure", "Pass")

    states = history.read(h.events).states

    index = states["Build dataset index"]
    assert (index.status, index.error, index.attempts) == ("caught", "Runtime.ExitError", 1)
    assert states["Notify failure"].status == "running"


def test_history_failure_retried_then_succeeded_reads_succeeded_with_attempts() -> None:
    h = History()
    h.add("ExecutionStarted", 0)
    h.enter("Train model")
    h.add("TaskScheduled")
    h.fail("SageMakerQuotaExceeded")
    retry = h.add("TaskScheduled")
    assert history.read(h.events).states["Train model"].status == "running"
    h.add("TaskSucceeded", retry)
    h.exit("Train model")

    train = history.read(h.events).states["Train model"]

    assert (train.status, train.attempts) == ("succeeded", 2)
    assert train.duration_s(T0) == (train.exited - train.entered).total_seconds()  # type: ignore[operator]


def test_history_uncaught_failure_ends_execution_reads_failed_with_its_error() -> None:
    h = History()
    h.add("ExecutionStarted", 0)
    h.enter("Validate run")
    h.exit("Validate run")
    h.enter("Train model")
    h.add("TaskScheduled")
    h.fail("TrainingJobFailed")
    h.add("ExecutionFailed", executionFailedEventDetails={"error": "TrainingJobFailed", "cause": "oom"})

    states = history.read(h.events).states

    assert states["Validate run"].status == "succeeded"
    assert (states["Train model"].status, states["Train model"].error) == ("failed", "TrainingJobFailed")
    assert states["Train model"].exited is None, "a failed state never exited"


def test_history_execution_timed_out_or_stopped_marks_the_running_state() -> None:
    for terminal, details, expected in (
        ("ExecutionTimedOut", {"executionTimedOutEventDetails": {"error": "States.Timeout"}}, "failed"),
        ("ExecutionAborted", {"executionAbortedEventDetails": {}}, "aborted"),
    ):
        h = History()
        h.add("ExecutionStarted", 0)
        h.enter("Wait for approval")
        h.add("TaskScheduled")
        h.add(terminal, **details)

        run = history.read(h.events).states["Wait for approval"]

        assert run.status == expected, terminal
        assert run.exited is not None


def test_history_redriven_state_entered_again_reads_its_newest_entry() -> None:
    h = History()
    h.add("ExecutionStarted", 0)
    h.enter("Deploy endpoint")
    h.fail("EndpointDeployFailed")
    h.add("ExecutionFailed", executionFailedEventDetails={"error": "EndpointDeployFailed"})
    h.add("ExecutionRedriven", 0)
    h.enter("Deploy endpoint")
    h.add("TaskScheduled")

    read = history.read(h.events)

    deploy = read.states["Deploy endpoint"]
    assert (deploy.status, deploy.error, read.redrive_count) == ("running", None, 1)


def test_history_parallel_branches_attribute_failures_by_event_chain() -> None:
    h = History()
    h.add("ExecutionStarted", 0)
    parallel = h.enter("Checks", "Parallel")
    h.add("ParallelStateStarted")
    left = h.enter("Left", previous=parallel + 1)
    right = h.enter("Right", previous=parallel + 1)
    h.add("TaskScheduled", left)  # the left branch's task, recorded after Right entered
    h.fail("LeftBroke", previous=len(h.events))
    h.add("TaskScheduled", right)
    h.add("TaskSucceeded", len(h.events))
    h.exit("Right", previous=len(h.events))

    states = history.read(h.events).states

    assert (states["Left"].status, states["Left"].error) == ("failed", "LeftBroke")
    assert states["Right"].status == "succeeded"


def test_progress_lines_caught_state_is_not_shown_as_done() -> None:
    snap = progress.Progress(
        execution_arn="arn:aws:states:us-east-1:123456789012:execution:p:r",
        status="RUNNING",
        states={"Build dataset index": "caught", "Validate run": "succeeded"},
        attempts={"Validate run": 3},
    )

    lines = progress.state_lines(snap)

    assert "✔" not in lines["Build dataset index"]
    assert "caught" in lines["Build dataset index"]
    assert lines["Validate run"].startswith("  ✔")
    assert "attempt 3" in lines["Validate run"]
