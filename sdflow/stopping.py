"""Stopping a command that owns a local cloud on SIGTERM or SIGINT, cleanly (sdflow local up, sdflow demo)."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import Any


class StopRequested(BaseException):
    """SIGTERM or SIGINT reached a command that owns a local cloud: unwind, stopping what it started.

    A BaseException like KeyboardInterrupt, so `except Exception` on the way out does not eat it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention for "ended by signal N"


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn SIGTERM and SIGINT into StopRequested in the main thread, once.

    Python's default SIGTERM ends the process at once: no `finally`, no LocalCloud.stop(), so
    jobs and endpoints (their own process groups) outlive it and cloud.json stays behind. A
    second signal while stopping is ignored with a note: aborting the cleanup half-way would
    leave exactly those processes behind. A signal the parent set to be ignored (nohup, a
    background job of a non-interactive shell) stays ignored."""
    stopping = False

    def handler(signum: int, _frame: Any) -> None:
        nonlocal stopping
        if stopping:
            print(f"sdflow: {signal.Signals(signum).name} again; still stopping (SIGKILL abandons the cleanup)",
                  file=sys.stderr, flush=True)  # fmt: skip
            return
        stopping = True
        raise StopRequested(signum)

    previous: dict[int, Any] = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            previous[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for number, old in previous.items():
            signal.signal(number, old)
