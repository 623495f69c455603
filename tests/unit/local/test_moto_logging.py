"""moto's failure dumps go to the local cloud's log file; the console gets one short line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from sdflow.local import moto_logging
from tests.unit.local.helpers import fail_waiting_task


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
