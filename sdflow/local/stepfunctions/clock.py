"""Step Functions: every wait of moto's interpreter on the local cloud's clock (sdflow/local/clock.py).

moto's interpreter (LocalStack's) waits on the wall clock in four places; each is redirected here
so that Retry intervals, Wait states, TimeoutSeconds and HeartbeatSeconds play out at the clock's
speed and end when a test advances it:

- Retry: RetrierDecl._eval_body computes the interval (backoff, MaxDelaySeconds, jitter) and
  calls `time.sleep(interval_seconds)` (asl/component/common/retry/retrier_decl.py).
- TimeoutSeconds: ExecutionState._evaluate_with_timeout runs the attempt in a thread and waits
  `threading.Event().wait(timeout_seconds)` for it (asl/component/state/exec/execute_state.py).
- Task tokens and heartbeats: CallbackEndpoint and HeartbeatEndpoint wait on `Event().wait(timeout)`
  (asl/eval/callback/callback.py, `from threading import Event`).
- Wait states: WaitFunction._wait_interval waits on the environment's program-state event and
  measures with time.time() (asl/component/state/wait/wait_function/wait_function.py); a
  Timestamp wait measures against datetime.now() (…/wait_function/timestamp.py).

History events and the execution's start and stop dates (parser/models.py's StartExecution and
the local patches' stop dates) are stamped from the clock too, so the history shows a 300 s
retry as 300 s whatever the clock's speed."""

from __future__ import annotations

import datetime as dt
import threading
import time
import types
from typing import Any

from sdflow.local.patching import Patch, replace, wrap
from sdflow.local.runtime import current_clock


class _ClockEvent(threading.Event):
    """threading.Event whose wait(timeout) counts the timeout on the local cloud's clock."""

    what = "event"

    def wait(self, timeout: float | None = None) -> bool:
        return current_clock().wait(self, timeout, what=self.what)


class TimeoutEvent(_ClockEvent):
    what = "TimeoutSeconds"


class CallbackEvent(_ClockEvent):
    what = "task token or heartbeat"


class _Module(types.SimpleNamespace):
    """Stands in for a standard module inside one moto module: the names given are ours, every
    other attribute is the real module's."""

    def __init__(self, real: types.ModuleType, **ours: Any) -> None:
        super().__init__(**ours)
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _retry_sleep(seconds: float) -> None:
    current_clock().sleep(seconds, what=f"Retry interval {seconds:g} s")


RETRIER_TIME = _Module(time, sleep=_retry_sleep)
EXECUTE_STATE_THREADING = _Module(threading, Event=TimeoutEvent)


def sfn_wait_interval(self: Any, env: Any, wait_seconds: int) -> None:
    """Replaces moto's WaitFunction._wait_interval: waits `wait_seconds` on the clock, and ends
    early only when the execution stops (moto: a program-state change while still running is an
    "unrelated interrupt" and the wait goes on)."""
    clock = current_clock()
    deadline = clock.monotonic() + wait_seconds
    while env.is_running():
        left = deadline - clock.monotonic()
        if left <= 0:
            return
        if clock.wait(env.program_state_event, left, what=f"Wait state {wait_seconds} s") and env.is_running():
            clock.sleep(deadline - clock.monotonic(), what=f"Wait state {wait_seconds} s")
            return


def sfn_timestamp_wait_seconds(inner: Any, self: Any, env: Any) -> int:
    """Wraps moto's Timestamp._get_wait_seconds, which counts from the wall clock's now: counted
    from the clock's now instead."""

    wall = inner(self, env)
    return int(wall - round(current_clock().offset_s()))


def _clock_now(tz: dt.tzinfo | None = None) -> dt.datetime:
    now = current_clock().now()
    return now.astimezone(tz) if tz is not None else now.astimezone().replace(tzinfo=None)


# moto/stepfunctions/parser/models.py stamps StartExecution's startDate with
# `datetime.datetime.now(tz=datetime.timezone.utc)`, its only use of the module.
MODELS_DATETIME = _Module(dt, datetime=_Module(dt.datetime, now=_clock_now))  # type: ignore[arg-type]


def sfn_history_timestamp() -> dt.datetime:
    """Replaces moto's EventManager._get_current_timestamp (a staticmethod): the clock's now."""
    return current_clock().now()


def patches() -> list[Patch]:
    import moto.stepfunctions.parser.asl.component.common.retry.retrier_decl as retrier_decl
    import moto.stepfunctions.parser.asl.component.state.exec.execute_state as execute_state
    import moto.stepfunctions.parser.asl.eval.callback.callback as callback
    import moto.stepfunctions.parser.models as parser_models
    from moto.stepfunctions.parser.asl.component.state.wait.wait_function.timestamp import Timestamp
    from moto.stepfunctions.parser.asl.component.state.wait.wait_function.wait_function import WaitFunction
    from moto.stepfunctions.parser.asl.eval.event.event_manager import EventManager

    return [
        replace(retrier_decl, "time", RETRIER_TIME),
        replace(execute_state, "threading", EXECUTE_STATE_THREADING),
        replace(callback, "Event", CallbackEvent),
        replace(WaitFunction, "_wait_interval", sfn_wait_interval),
        wrap(Timestamp, "_get_wait_seconds", sfn_timestamp_wait_seconds),
        replace(EventManager, "_get_current_timestamp", staticmethod(sfn_history_timestamp)),
        replace(parser_models, "datetime", MODELS_DATETIME),
    ]
