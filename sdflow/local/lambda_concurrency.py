"""Lambda reserved concurrency: how many invocations of a function run at once.

A function with ReservedConcurrentExecutions N runs at most N invocations at a time. Past it,
a synchronous invocation fails with TooManyRequestsException (HTTP 429, Reason
ReservedFunctionConcurrentInvocationLimitExceeded, "Rate Exceeded."), while an asynchronous
event stays in Lambda's queue and is retried for up to 6 hours (Lambda developer guide,
"Invoke - AWS Lambda": errors and "How Lambda handles errors and retries with asynchronous
invocation"); locally it waits for a free slot. The account-level concurrency limit (1,000 by
default) is not emulated: the local machine runs far fewer workers than that anyway."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field


class ConcurrencyLimitExceeded(Exception):
    """A synchronous invocation found every reserved slot busy."""


@dataclass
class LambdaConcurrency:
    """In-flight invocations per function, for functions with reserved concurrency. Thread-safe."""

    _running: dict[str, int] = field(default_factory=dict, repr=False)
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _closed: bool = field(default=False, repr=False)

    def running(self, function: str) -> int:
        with self._cond:
            return self._running.get(function, 0)

    @contextlib.contextmanager
    def slot(self, function: str, reserved: int | None, *, wait: bool) -> Iterator[None]:
        """Hold one of `function`'s `reserved` slots for the block (None: unlimited). When all are
        busy: wait (asynchronous events) or raise ConcurrencyLimitExceeded (synchronous calls)."""
        with self._cond:
            if reserved is not None:
                while self._running.get(function, 0) >= reserved:
                    if not wait or self._closed:
                        raise ConcurrencyLimitExceeded(function)
                    self._cond.wait()
            self._running[function] = self._running.get(function, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._running[function] -= 1
                self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiting event so a stopping runtime does not hang on it."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def reserved_concurrency(fn: object) -> int | None:
    """moto keeps ReservedConcurrentExecutions as given (int or str), None when unset."""
    value = getattr(fn, "reserved_concurrency", None)
    return None if value is None or value == "" else int(str(value))
