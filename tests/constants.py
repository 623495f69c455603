"""Constants every test layer shares."""

from __future__ import annotations

# The local cloud's clock in tests (sdflow/local/clock.py): while nothing works, an hour passes
# in 3.6 s, so the state machine's real Retry intervals and timeouts play out in moments; work
# (a Lambda invocation, a job's process) keeps its real length.
TIME_SCALE = 1000.0
