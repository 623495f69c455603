"""The console's AWS clients, its small caches, and its one error type.

Every call goes to a public AWS API through boto3 (with `--endpoint-url`, to the local cloud),
with short timeouts and no SDK retries: the page polls anyway, and a stopped local cloud must
show as a message within a second or two, not after botocore's back-off."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError

T = TypeVar("T")
CLIENT_CONFIG = Config(connect_timeout=2, read_timeout=20, retries={"max_attempts": 1, "mode": "standard"})
NOT_FOUND_CODES = frozenset(
    {
        "ExecutionDoesNotExist",
        "StateMachineDoesNotExist",
        "ResourceNotFound",
        "ResourceNotFoundException",
        "ValidationException",
        "NoSuchKey",
        "NoSuchBucket",
        "404",
    }
)


class ConsoleError(Exception):
    """What the page shows in its banner: an HTTP status, a code, a message and a hint."""

    def __init__(self, status: int, code: str, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.hint = status, code, message, hint

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "hint": self.hint}}


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def translate(exc: Exception, endpoint_url: str | None) -> ConsoleError:
    """A botocore failure as the page says it."""
    where = endpoint_url or "AWS"
    if isinstance(exc, EndpointConnectionError) or (
        isinstance(exc, BotoCoreError) and "connect" in type(exc).__name__.lower()
    ):
        hint = "start it with `sdflow local up`" if endpoint_url else "check your network and AWS_REGION"
        return ConsoleError(503, "Unreachable", f"cannot reach {where}", hint)
    if isinstance(exc, ClientError):
        code = error_code(exc)
        message = exc.response.get("Error", {}).get("Message") or code
        operation = exc.operation_name
        if code in {"AccessDenied", "AccessDeniedException", "UnrecognizedClientException", "ExpiredToken"}:
            return ConsoleError(403, code, f"{operation}: {message}", "the console's credentials lack this permission")
        if code in NOT_FOUND_CODES:
            return ConsoleError(404, code, f"{operation}: {message}")
        if code in {"ThrottlingException", "Throttling", "TooManyRequestsException"}:
            return ConsoleError(429, code, f"{operation}: {message}", "the page retries on its next poll")
        return ConsoleError(502, code or "ClientError", f"{operation}: {message}")
    if isinstance(exc, BotoCoreError):
        return ConsoleError(502, type(exc).__name__, f"{where}: {exc}")
    raise exc


class Clients:
    """One client per service, built once (boto3 clients are safe to share between threads)."""

    def __init__(self, factory: Callable[..., Any], endpoint_url: str | None) -> None:
        self._factory = factory
        self.endpoint_url = endpoint_url
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.calls = 0  # every API call the console made, for its cost figures
        self.operations: collections.Counter[str] = collections.Counter()

    def __call__(self, service: str) -> Any:
        with self._lock:
            if service not in self._clients:
                client = self._factory(service, config=CLIENT_CONFIG)
                client.meta.events.register("before-call.*.*", self._count)
                self._clients[service] = client
            return self._clients[service]

    def _count(self, event_name: str = "", **_: Any) -> None:
        self.calls += 1
        self.operations[event_name.removeprefix("before-call.")] += 1


class Recent(collections.OrderedDict[str, T]):
    """A dict that keeps only its `size` most recently used entries: a console left open for
    weeks holds the histories and loss curves of the runs people look at, not of every run."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def __getitem__(self, key: str) -> T:
        self.move_to_end(key)
        return super().__getitem__(key)

    def __setitem__(self, key: str, value: T) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


class TtlCache:
    """Values computed at most once per `ttl_s` per key, however many pages poll; a value may
    be marked final (a finished run's history, a completed job's summary) and kept for good."""

    def __init__(self, ttl_s: float, max_entries: int = 512) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._values: dict[Any, tuple[float, Any]] = {}
        self._locks: dict[Any, threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, key: Any, compute: Callable[[], tuple[T, bool]]) -> T:
        """`compute` returns (value, final)."""
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:  # a second caller waits for the first one's answer instead of asking again
            now = time.monotonic()
            found = self._values.get(key)
            if found is not None and found[0] > now:
                return found[1]  # type: ignore[no-any-return, unused-ignore]
            value, final = compute()
            with self._lock:
                if len(self._values) >= self.max_entries:
                    oldest = min(self._values, key=lambda k: self._values[k][0])
                    self._values.pop(oldest, None)
                self._values[key] = (float("inf") if final else now + self.ttl_s, value)
            return value
