"""Admission by time: the serve job admits what it can finish within SageMaker's InvokeEndpoint limit.

A fixed queue length sheds the wrong load: nine 50-step requests at 1024² do not finish in 60 s,
while twenty 0.2 s requests finish in 4 s and were refused all the same (11 of 20 got 503s). The
rule here: a request is admitted when a pipeline is free, or when the work ahead of it, shared by
the pipelines, plus its own would end within the limit less a margin:

    work_ahead_s / workers + own_s <= limit_s - margin_s

Each request's cost is the load-time timing's estimate (`StepTiming.estimate_s`: its steps, images
and pixels) times `scale`, the ratio of measured to estimated service time over the model's recent
requests (an exponentially weighted mean, starting at 1: the calibration is the initial estimate).
The calibration is one warm run at load; real requests run slower under contention, faster once
kernels are cached, and the scale follows them. A request that is running counts only its
estimated remainder. The margin (10% of the limit) covers SageMaker's own time, the network and an
estimate that is short.

A refused request is told when to retry: `retry_after_s`, the seconds until enough of the work
ahead has drained for it to fit (at least 1). `max_waiting` is a guard on memory (each waiting
request holds its body), not the shedding rule.

The clock is injected so that tests can run the rule without waiting.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

MARGIN_FRACTION = 0.1
SCALE_WEIGHT = 0.3  # the newest measurement's weight in the mean: about the last five requests count
# A first request's lazy initialisation should not turn the estimate upside down: one
# measurement's ratio is clamped to these bounds (so the scale stays within them too).
MIN_RATIO = 0.1
MAX_RATIO = 10.0


class RefusedError(Exception):
    """The request would not finish within the limit behind the work already admitted."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class Ticket:
    """One admitted request: its load-time estimate, and when its generation started."""

    estimate_s: float
    started: float | None = None


class Admission:
    """The requests admitted (running and waiting) and the measured speed of the model. Not
    thread-safe: the serve job calls it from the event loop thread only."""

    def __init__(
        self,
        limit_s: float,
        workers: int,
        *,
        margin_s: float | None = None,
        max_waiting: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.limit_s = limit_s
        self.margin_s = limit_s * MARGIN_FRACTION if margin_s is None else margin_s
        self.workers = max(1, workers)
        self.max_waiting = max_waiting
        self.scale = 1.0
        self._clock = clock
        self._tickets: list[Ticket] = []

    @property
    def admitted(self) -> int:
        return len(self._tickets)

    @property
    def waiting(self) -> int:
        return sum(1 for ticket in self._tickets if ticket.started is None)

    def cost_s(self, estimate_s: float) -> float:
        """A request's expected service time: its estimate at the model's measured speed."""
        return estimate_s * self.scale

    def work_ahead_s(self) -> float:
        """Seconds of work admitted and not yet done, all pipelines together."""
        now = self._clock()
        total = 0.0
        for ticket in self._tickets:
            cost = self.cost_s(ticket.estimate_s)
            if ticket.started is not None:
                # One that has overrun its estimate is about to end: it counts nothing more.
                cost = max(0.0, cost - (now - ticket.started))
            total += cost
        return total

    def admit(self, estimate_s: float) -> Ticket:
        """A ticket for a request estimated at `estimate_s`; RefusedError when it would not fit."""
        if len(self._tickets) >= self.workers:
            self._check_fits(estimate_s)
        ticket = Ticket(estimate_s)
        self._tickets.append(ticket)
        return ticket

    def _check_fits(self, estimate_s: float) -> None:
        ahead_s = self.work_ahead_s()
        own_s = self.cost_s(estimate_s)
        if self.max_waiting is not None and self.waiting >= self.max_waiting:
            per_request = ahead_s / len(self._tickets)
            raise RefusedError(
                f"server busy: {self.waiting} requests are waiting (at most {self.max_waiting}); retry later",
                _seconds(per_request),
            )
        budget_s = self.limit_s - self.margin_s
        ends_s = ahead_s / self.workers + own_s
        if ends_s > budget_s:
            raise RefusedError(
                f"server busy: about {ahead_s / self.workers:.1f} s of work is ahead of this request "
                f"(about {own_s:.1f} s), which would end past SageMaker's {self.limit_s:g} s limit "
                f"less a {self.margin_s:g} s margin; retry later",
                _seconds(ends_s - budget_s),
            )

    def start(self, ticket: Ticket) -> None:
        """The ticket's generation begins on a pipeline."""
        ticket.started = self._clock()

    def release(self, ticket: Ticket) -> None:
        """The request ended (answered, refused downstream, dropped)."""
        self._tickets.remove(ticket)

    def record(self, estimate_s: float, elapsed_s: float) -> None:
        """A real request's service time: moves the scale toward measured / estimated."""
        if estimate_s <= 0 or elapsed_s < 0:
            return
        ratio = min(MAX_RATIO, max(MIN_RATIO, elapsed_s / estimate_s))
        self.scale += SCALE_WEIGHT * (ratio - self.scale)


def _seconds(value: float) -> int:
    """Retry-After is whole seconds (RFC 9110 delay-seconds); never 0, which invites a storm."""
    return max(1, math.ceil(value))
