"""Constants every test layer shares."""

from __future__ import annotations

# The local cloud's clock in tests (sdflow/local/clock.py): while nothing works, ten minutes pass
# in 6 s, so the state machine's real Retry intervals play out in moments; work (a Lambda
# invocation, a job's process) keeps its real length. Waits of hours or days (task timeouts,
# approvals) are reached with Clock.advance instead. Faster would also fire the reconciler's
# 10-minute schedule every fraction of a second, keeping a Lambda busy most of the time.
TIME_SCALE = 100.0

# The region and account of the mocked AWS (moto's default account) that the unit tests run against.
REGION = "us-east-1"
ACCOUNT = "123456789012"


def hold_for(real_seconds: float) -> float:
    """A no-op job's hold, in the clock's seconds, that lasts at least `real_seconds` of real time
    (the clock runs TIME_SCALE times faster while nothing works): long enough for a test to find
    the job running and stop or kill it."""
    return real_seconds * TIME_SCALE
