"""Following a run in a terminal: a line whenever a state starts, ends or makes progress."""

from __future__ import annotations

import sys
from typing import Any

from sdflow import progress as progress_mod
from sdflow.runs import follow
from sdflow.session import Session


def watch(
    session: Session, execution_arn: str, *, interval: float = 1.0, out: Any = sys.stdout
) -> progress_mod.Progress:
    """Print a line whenever a state starts, ends or makes progress, until the execution ends."""
    printed: dict[str, str] = {}
    print(f"watching {execution_arn}", file=out, flush=True)
    for snap in follow(session, execution_arn, interval_s=interval):
        for state, line in progress_mod.state_lines(snap).items():
            if printed.get(state) != line:
                print(line, file=out, flush=True)
                printed[state] = line
    print(f"execution {execution_arn.rsplit(':', 1)[-1]}: {snap.status}", file=out, flush=True)
    if snap.error:
        print(f"  error: {snap.error}: {snap.cause or ''}"[:600], file=out, flush=True)
    return snap
