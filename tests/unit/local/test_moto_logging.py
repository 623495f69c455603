"""moto's failure dumps go to the local cloud's log file; the console gets one short line."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from sdflow.local import moto_logging
from sdflow.local import runtime as runtime_module
from tests.unit.local.helpers import client, fail_waiting_task, start_waiting_task


def test_moto_gap_failed_execution_logs_component_repr_at_error(aws: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="moto"):
        fail_waiting_task()
    dumps = [r for r in caplog.records if r.name.startswith("moto.stepfunctions") and r.levelno >= logging.ERROR]
    assert dumps, "moto no longer logs execution failures at ERROR: review sdflow/local/moto_logging.py"
    assert "DownloadJobFailed" in dumps[0].getMessage()
    assert " at '(" in dumps[0].getMessage()  # the component repr the console line leaves out


def test_route_failed_execution_console_one_line_file_full(
    aws: None, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    log_path = tmp_path / "logs" / "moto.log"
    routing = moto_logging.route(log_path)
    try:
        execution = fail_waiting_task()
    finally:
        routing.restore()
    assert execution["status"] == "FAILED"
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Error=DownloadJobFailed" in lines[0]
    assert str(log_path) in lines[0]
    assert len(lines[0]) < moto_logging.CONSOLE_LINE_CHARS + 100 + len(str(log_path))
    full = log_path.read_text()
    assert "DownloadJobFailed" in full
    assert "StateTaskServiceSqs" in full  # the repr is kept for debugging


def test_route_restore_gives_moto_logger_back(tmp_path: Path) -> None:
    logger = logging.getLogger("moto")
    before = (list(logger.handlers), logger.propagate, logger.level)
    routing = moto_logging.route(tmp_path / "moto.log")
    assert logger.propagate is False
    routing.restore()
    assert (list(logger.handlers), logger.propagate, logger.level) == before


def test_console_summary_long_message_clipped_and_repeats_once(tmp_path: Path) -> None:
    lines: list[str] = []

    class Sink:
        def write(self, text: str) -> int:
            lines.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    handler = moto_logging.ConsoleSummary(Sink(), tmp_path / "moto.log")
    message = "Exception=FailureEventException, Details=" + "x" * 5000 + " at '(StateMap| ...)'"
    for _ in range(3):  # each enclosing component logs the same failure again
        handler.handle(logging.LogRecord("moto.x", logging.ERROR, __file__, 1, message, None, None))
    assert len(lines) == 1
    assert len(lines[0]) < moto_logging.CONSOLE_LINE_CHARS + 100 + len(str(tmp_path))  # the path is not clipped
    assert "StateMap" not in lines[0]


def test_console_summary_lambda_error_cause_read_as_fields_and_fixes() -> None:
    cause = json.dumps(
        {
            "errorMessage": json.dumps([{"field": "dataset.prefix", "message": "no *.parquet objects; upload them"}]),
            "errorType": "ValidationError",
            "requestId": "r-1",
            "stackTrace": ['  File "/var/task/app.py", line 1, in handler'],
        }
    )
    details = {"taskFailedEventDetails": {"error": "ValidationError", "cause": cause}}
    message = f"Exception=FailureEventException, Error=ValidationError, Details={json.dumps(details)}"

    line = moto_logging.readable(message)

    assert line == (
        "Exception=FailureEventException, Error=ValidationError, "
        "Cause=- dataset.prefix: no *.parquet objects; upload them"
    )
    assert moto_logging.readable("Exception=X, Details=None-Available") == "Exception=X, Details=None-Available"


def _stop_waiting_task() -> dict[str, Any]:
    """A waitForTaskToken task whose execution is stopped (StopExecution) while it waits."""
    sfn = client("stepfunctions")
    execution, _token = start_waiting_task()
    sfn.stop_execution(executionArn=execution, error="UserStop", cause="stopped by hand")
    time.sleep(0.5)  # the interrupted task's thread ends after the stop
    return dict(sfn.describe_execution(executionArn=execution))


def test_route_stopped_execution_console_says_aborted_not_timeout(
    runtime: runtime_module.Runtime, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    routing = moto_logging.route(tmp_path / "moto.log")
    try:
        execution = _stop_waiting_task()
    finally:
        routing.restore()

    assert execution["status"] == "ABORTED"
    err = capfd.readouterr().err
    assert "Timeout" not in err
    assert "execution x was stopped (ABORTED by StopExecution)" in err
