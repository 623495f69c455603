"""The local cloud's one clock: every part that waits or tells the time reads it.

Step Functions' Retry intervals, Wait states, TimeoutSeconds and heartbeats, Lambda's asynchronous
retries and timeouts, scheduled rules and the reconciler's period, the handlers' view of "now"
(claim and token deadlines), the no-op SageMaker jobs' durations and the injected capacity failure
all wait on a `Clock` instead of the wall clock, so that one setting decides how fast a run's
waiting plays out:

- `Clock()` runs at real speed: the demo and `sdflow local up`.
- `Clock(scale=N)` runs N times faster *while nothing is working* and at real speed while
  something is (a Lambda invocation, a SageMaker job process: `busy()`). Work keeps its real
  length, so a Lambda's 30 s timeout still means 30 s of the handler's time, while a 300 s Retry
  interval between two attempts takes 300/N s. Tests run at a large N; `sdflow local up
  --time-scale N` lets a user watch a day-long retry policy play out.
- `advance(seconds)` jumps ahead at once (a test that waits for a deadline while nothing works).

Virtual time only moves forward and never slower than real time, so a deadline measured on it is
never later than the same deadline on the wall clock. While anything is busy, virtual time is
real time plus a constant `offset_s()`: that is what the Lambda workers (separate processes) add
to their own clock (lambda_worker.py), so a handler's `time.time()` agrees with the cloud's.

One timekeeper thread holds every pending deadline in a heap and wakes exactly the waiters that
are due, so thousands of waiting tasks (a large Distributed Map) cost no polling."""

from __future__ import annotations

import contextlib
import datetime as dt
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


class ClockError(ValueError):
    """A clock setting that cannot work (a scale below 1, a negative advance)."""


@dataclass(order=True)
class _Waiter:
    deadline: float  # virtual elapsed seconds
    seq: int
    what: str = field(compare=False)
    cond: threading.Condition | None = field(compare=False, default=None)
    action: Callable[[], None] | None = field(compare=False, default=None)
    due: bool = field(compare=False, default=False)
    cancelled: bool = field(compare=False, default=False)

    def fire(self) -> None:
        if self.cond is not None:
            with self.cond:
                self.due = True
                self.cond.notify_all()
        else:
            self.due = True
        if self.action is not None:
            threading.Thread(target=self.action, name=f"sdflow-clock-{self.what}", daemon=True).start()


@dataclass(frozen=True)
class Pending:
    """A wait in progress, for tests and diagnostics: what waits, and how long until it is due."""

    what: str
    due_in_s: float


class Timer:
    """A call scheduled with `Clock.call_later`; cancel() before it is due stops it."""

    def __init__(self, waiter: _Waiter) -> None:
        self._waiter = waiter

    def cancel(self) -> None:
        self._waiter.cancelled = True


class Clock:
    """Virtual time for the local cloud (see the module docstring). Thread-safe."""

    def __init__(self, scale: float = 1.0) -> None:
        if scale < 1:
            raise ClockError(f"time scale {scale} is not valid: use 1 (real time) or more (faster while idle)")
        self.scale = float(scale)
        self._cond = threading.Condition()
        self._wall0 = time.time()
        self._real0 = self._started_real = time.monotonic()
        self._virtual0 = 0.0  # virtual elapsed seconds at _real0
        self._busy = 0
        self._busy_since = 0.0
        self._busy_real_s = 0.0  # real seconds during which something was busy (diagnostics)
        self._heap: list[_Waiter] = []
        self._cancelled_in_heap = 0
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------ reading the time

    def _rate(self) -> float:
        return 1.0 if self._busy else self.scale

    def _elapsed(self) -> float:  # caller holds _cond
        return self._virtual0 + (time.monotonic() - self._real0) * self._rate()

    def monotonic(self) -> float:
        """Virtual seconds since the clock started (never goes back)."""
        with self._cond:
            return self._elapsed()

    def time(self) -> float:
        """Virtual seconds since the epoch, as time.time()."""
        return self._wall0 + self.monotonic()

    def now(self) -> dt.datetime:
        """Virtual time as an aware UTC datetime, as datetime.now(UTC)."""
        return dt.datetime.fromtimestamp(self.time(), dt.UTC)

    def offset_s(self) -> float:
        """How far virtual time is ahead of the wall clock (0.0 at real speed with no advance)."""
        return self.time() - time.time()

    # ------------------------------------------------------------------ moving it

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Work in progress: the clock runs at real speed until every busy block has ended."""
        self._set_busy(+1)
        try:
            yield
        finally:
            self._set_busy(-1)

    def _set_busy(self, delta: int) -> None:
        with self._cond:
            if self._busy == 0 and delta > 0:
                self._busy_since = time.monotonic()
            elif self._busy + delta == 0:
                self._busy_real_s += time.monotonic() - self._busy_since
            if self.scale == 1.0:
                self._busy += delta
                return
            self._rebase()
            self._busy += delta
            self._cond.notify_all()  # the timekeeper's next real wait changes with the rate

    def busy_share(self) -> float:
        """The share of real time since the clock started during which something was busy: where
        it is high, a scaled clock compresses little (diagnostics, benchmarks)."""
        with self._cond:
            busy = self._busy_real_s + (time.monotonic() - self._busy_since if self._busy else 0.0)
            return busy / max(1e-9, time.monotonic() - self._started_real)

    def _rebase(self) -> None:  # caller holds _cond
        now = time.monotonic()
        self._virtual0 += (now - self._real0) * self._rate()
        self._real0 = now

    def advance(self, seconds: float) -> None:
        """Jump ahead `seconds` of virtual time at once; every wait due by then ends."""
        if seconds < 0:
            raise ClockError(f"the clock only moves forward; advance({seconds}) is not possible")
        with self._cond:
            self._rebase()
            self._virtual0 += seconds
            self._cond.notify_all()

    def advance_to_next(self, *, what: str = "") -> Pending | None:
        """Jump to the earliest pending deadline (whose `what` contains `what`); returns it, or None."""
        with self._cond:
            now = self._elapsed()
            candidates = [w for w in self._heap if not w.cancelled and not w.due and what in w.what]
            if not candidates:
                return None
            first = min(candidates)
            self._rebase()
            self._virtual0 += max(0.0, first.deadline - now)
            self._cond.notify_all()
            return Pending(first.what, first.deadline - now)

    def pending(self) -> list[Pending]:
        """The waits in progress, soonest first."""
        with self._cond:
            now = self._elapsed()
            return [Pending(w.what, w.deadline - now) for w in sorted(self._heap) if not (w.cancelled or w.due)]

    # ------------------------------------------------------------------ waiting on it

    def sleep(self, seconds: float, what: str = "sleep") -> None:
        """time.sleep on virtual time."""
        if seconds <= 0:
            return
        cond = threading.Condition()
        waiter = self._schedule(seconds, what, cond=cond)
        with cond:
            while not waiter.due:
                cond.wait()

    def wait(self, event: threading.Event, timeout: float | None = None, what: str = "wait") -> bool:
        """event.wait(timeout) with the timeout on virtual time; True when the event was set."""
        if event.is_set():
            return True
        if timeout is None:
            return event.wait()
        if timeout <= 0:
            return event.is_set()
        # threading.Event keeps its flag under its own Condition (CPython's threading.py, stable
        # since 3.x): waiting on that Condition lets both set() and the timekeeper wake us.
        cond: threading.Condition = event._cond  # type: ignore[attr-defined]
        waiter = self._schedule(timeout, what, cond=cond)
        try:
            with cond:
                while not event._flag and not waiter.due:  # type: ignore[attr-defined]
                    cond.wait()
                return bool(event._flag)  # type: ignore[attr-defined]
        finally:
            self._cancel(waiter)

    def call_later(self, delay_s: float, action: Callable[[], None], what: str = "timer") -> Timer:
        """threading.Timer on virtual time: `action` runs in a thread of its own once due."""
        return Timer(self._schedule(max(0.0, delay_s), what, action=action))

    def _schedule(
        self,
        seconds: float,
        what: str,
        *,
        cond: threading.Condition | None = None,
        action: Callable[[], None] | None = None,
    ) -> _Waiter:
        with self._cond:
            waiter = _Waiter(self._elapsed() + seconds, next(self._seq), what, cond, action)
            if not self._closed:
                heapq.heappush(self._heap, waiter)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._keep_time, name="sdflow-clock", daemon=True)
                    self._thread.start()
                if self._heap[0] is waiter:
                    self._cond.notify_all()
                return waiter
        waiter.fire()  # a closed clock: due at once (outside the clock's lock, as the timekeeper fires)
        return waiter

    def _cancel(self, waiter: _Waiter) -> None:
        with self._cond:
            if waiter.due or waiter.cancelled:
                return
            waiter.cancelled = True
            self._cancelled_in_heap += 1
            # Long deadlines that ended early (a task answered long before its timeout) would
            # otherwise stay in the heap until due: compact once they are half of it.
            if self._cancelled_in_heap > 64 and self._cancelled_in_heap * 2 > len(self._heap):
                self._heap = [w for w in self._heap if not w.cancelled]
                heapq.heapify(self._heap)
                self._cancelled_in_heap = 0

    def _keep_time(self) -> None:
        while True:
            due: list[_Waiter] = []
            with self._cond:
                if self._closed:
                    return
                now = self._elapsed()
                while self._heap and (self._heap[0].deadline <= now or self._heap[0].cancelled):
                    waiter = heapq.heappop(self._heap)
                    if waiter.cancelled:
                        self._cancelled_in_heap = max(0, self._cancelled_in_heap - 1)
                    else:
                        due.append(waiter)
                if not due:
                    timeout = (self._heap[0].deadline - now) / self._rate() if self._heap else None
                    self._cond.wait(timeout)
                    continue
            for waiter in due:  # outside the clock's lock: a waiter's Condition is taken here
                waiter.fire()

    def close(self) -> None:
        """The cloud is stopping: every wait ends now, as if its time had come, and later waits
        end at once, so nothing (a held no-op job, a Retry, a shutdown joining them) blocks forever."""
        with self._cond:
            self._closed = True
            pending, self._heap = [w for w in self._heap if not (w.cancelled or w.due)], []
            self._cond.notify_all()
        for waiter in pending:
            waiter.fire()


class RealTimeClock(Clock):
    """The clock when no local cloud runs (unit tests, moto's own behaviour): its wall time is the
    wall clock's, read each time. Clock.time() adds monotonic seconds to the wall time at its start,
    which drifts from time.time() when the machine's wall clock is stepped or its monotonic clock
    pauses (a suspended VM): a process-long clock was once 130 s behind time.time()."""

    def time(self) -> float:
        return time.time()


REAL_TIME = RealTimeClock()
