"""Where moto's own log records go while a local cloud runs: a file, and one short line on the console.

moto's Step Functions interpreter (moto/stepfunctions/parser/asl/component/eval_component.py,
`_log_failure_event_exception` / `_log_exception`) logs every failure at ERROR with `repr()` of
the component that saw it, and does so again at each enclosing component as the failure
propagates (state, iteration, map, program). With no logging configured, Python's last-resort
handler prints all of it on stderr: kilobytes of interpreter internals for one failed state,
interleaved with `sdflow watch`'s progress. The run's own error and cause are already in the
execution's history (and printed by `watch`), so the console gets one line per failure and the
full records go to the local cloud's log file.

A task interrupted by StopExecution ends, inside the interpreter, as a task timeout
(States.Timeout): its console line says the execution was stopped (ABORTED) instead
(stepfunctions/tokens.py marks the thread, `stopped_here`)."""

from __future__ import annotations

import json
import logging
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

MOTO_LOGGER = "moto"
CONSOLE_LINE_CHARS = 200
# moto's messages end with " at '<repr of the component>'": the part worth a console line is before it.
_COMPONENT_MARK = " at '"
# A Choice rule's IsPresent test on a missing path ("Check trained model" when the run resumes
# nothing) is logged as NoSuchJsonPathError although it is the rule's normal `false`; a path that
# really is missing fails the state with States.Runtime, which is logged (and shown) on its own.
_QUIET_SUMMARIES = ("Exception=NoSuchJsonPathError",)


_thread_state = threading.local()


def stopped_here(execution_name: str | None) -> None:
    """The failure now propagating on this thread is the end of an execution StopExecution
    stopped (None: a new attempt began on this thread, what fails next is its own)."""
    _thread_state.stopped = execution_name


def readable(summary: str) -> str:
    """moto's `..., Details={"taskFailedEventDetails": {"error", "cause"}}` with the cause read as a
    person reads it (sdflow_common.causes: a Lambda error's message, its fields and fixes; never
    the escaped JSON or the stack trace), else the summary as it was."""
    from sdflow_common import causes

    head, mark, details = summary.partition(", Details=")
    try:
        decoded = json.loads(details) if mark else None
    except ValueError:
        return summary
    found = next((v for v in decoded.values() if isinstance(v, dict)), None) if isinstance(decoded, dict) else None
    cause = found.get("cause") if found is not None else None
    if not isinstance(cause, str):
        return summary
    lines = [line.strip() for line in causes.readable_cause(cause).splitlines() if line.strip()]
    return f"{head}, Cause={' '.join(lines)}"


class Writable(Protocol):
    def write(self, text: str, /) -> int: ...
    def flush(self) -> None: ...


class ConsoleSummary(logging.Handler):
    """One line per distinct failure: moto's message without the component repr, clipped.

    The same failure logged again by each enclosing component (same text before " at '") is
    shown once per thread; the file keeps every record."""

    def __init__(self, stream: Writable, log_path: Path) -> None:
        super().__init__(level=logging.ERROR)
        self.stream = stream
        self.log_path = log_path
        self._last = threading.local()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            summary = readable(record.getMessage().split(_COMPONENT_MARK, 1)[0]).replace("\n", " ")
            stopped = getattr(_thread_state, "stopped", None)
            if stopped is not None:
                summary = f"execution {stopped} was stopped (ABORTED by StopExecution); its running task ended with it"
            if getattr(self._last, "summary", None) == summary or summary.startswith(_QUIET_SUMMARIES):
                return
            self._last.summary = summary
            if len(summary) > CONSOLE_LINE_CHARS:
                summary = summary[: CONSOLE_LINE_CHARS - 1] + "…"
            self.stream.write(f"local cloud: {summary} (details: {self.log_path})\n")
            self.stream.flush()
        except Exception:
            self.handleError(record)


@dataclass
class Routing:
    """The handlers put on moto's logger, and its settings before, for restore()."""

    logger: logging.Logger
    handlers: list[logging.Handler]
    propagate: bool
    level: int
    restored: bool = field(default=False)

    def restore(self) -> None:
        if self.restored:
            return
        self.restored = True
        for handler in self.handlers:
            self.logger.removeHandler(handler)
            handler.close()
        self.logger.propagate = self.propagate
        self.logger.setLevel(self.level)


def route(log_path: Path, console: Writable | None = None) -> Routing:
    """Send moto's WARNING+ records to `log_path` in full, and a one-line summary of each ERROR
    to `console` (default: stderr, looked up at emit time so test capture sees it)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(MOTO_LOGGER)
    file_handler = logging.FileHandler(log_path, encoding="utf-8", delay=True)
    file_handler.setLevel(logging.WARNING)
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s"))
    summary = ConsoleSummary(console if console is not None else _Stderr(), log_path)
    routing = Routing(logger, [file_handler, summary], logger.propagate, logger.level)
    for handler in routing.handlers:
        logger.addHandler(handler)
    # Not propagated: a root handler (a user's basicConfig, the last-resort handler) would print it all again.
    logger.propagate = False
    if logger.level == logging.NOTSET or logger.level > logging.WARNING:
        logger.setLevel(logging.WARNING)
    return routing


class _Stderr:
    """sys.stderr as it is when written to (pytest's capture replaces it after route())."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()
