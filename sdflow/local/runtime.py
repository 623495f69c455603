"""The local runtime's state: where the patched services send their work, and what they remember.

moto calls the patched functions (patching.PATCH_MODULES) without any context of ours, so the one
`Runtime` in force is reached through `current_runtime()`; everything the services keep between
calls (which account a job belongs to, the requests behind an endpoint, cached clients) lives on
that object, not in module globals, so a stopped cloud leaves nothing behind."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from sdflow.local.clock import REAL_TIME, Clock
from sdflow.local.lambda_concurrency import LambdaConcurrency
from sdflow.local.lambda_runner import LambdaRunner
from sdflow.local.sagemaker.quotas import SageMakerQuotas

MOTO_VERSION = "5.2.5"
Kind = Literal["processing", "training", "endpoint"]


class PatchError(RuntimeError):
    """The local runtime cannot do what was asked: a patch needs a runtime that is missing, or a
    patch cannot be applied as declared (moto lacks its target, two modules' wraps are unordered)."""


class SageMakerEngine(Protocol):
    """The local SageMaker engine: what the patches need from sdflow.local.sagemaker.engine.LocalSageMaker
    (see its docstring) or sdflow.local.sagemaker.noop.NoOpSageMaker."""

    def run_processing_job(self, request: dict[str, Any]) -> None: ...
    def run_training_job(self, request: dict[str, Any]) -> None: ...
    def deploy_endpoint(self, endpoint_name: str, endpoint_config: dict[str, Any], model: dict[str, Any]) -> None: ...
    def invoke_endpoint(self, endpoint_name: str, body: bytes, content_type: str, accept: str) -> tuple[bytes, str]: ...
    def stop_job(self, kind: Kind, name: str) -> None: ...


@dataclass(frozen=True)
class FunctionCode:
    """Where a function's code lives on this machine (its CodeUri and its layers' ContentUri)."""

    code_dir: Path
    layer_dirs: tuple[Path, ...] = ()


@dataclass
class Runtime:
    """Where the patched services send their work, and the state they keep between calls."""

    workdir: Path
    lambda_runner: LambdaRunner | None = None
    # The one clock every waiting part reads (sdflow/local/clock.py): real time unless scaled.
    clock: Clock = field(default_factory=Clock)
    sagemaker: SageMakerEngine | None = None
    # Function name -> local code; functions not listed run from their deployed zip.
    code: dict[str, FunctionCode] = field(default_factory=dict)
    # Lambda retries a failed asynchronous invocation twice (after ~1 and ~2 minutes on AWS).
    async_retry_delays_s: tuple[float, ...] = (1.0, 2.0)
    # SageMaker: (kind, name) -> (account, region) of the resource, for the status publisher.
    sagemaker_where: dict[tuple[Kind, str], tuple[str, str]] = field(default_factory=dict)
    # SageMaker: (account, "model" | "config", name) -> the Create* request as the caller sent it.
    recorded_requests: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    # Step Functions: one boto3 client per (port, region, service) for the interpreter's tasks.
    sfn_clients: dict[tuple[str, str, str], Any] = field(default_factory=dict)
    # The one boto3 session those clients come from (made under sfn_clients_lock): a session reads
    # each service's model once for all its clients, where a session per client (one per role and
    # service) read it again for each, ~20 MB of the cloud process in a 2,000-shard run.
    sfn_session: Any = None
    sfn_clients_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    sns_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # moto server: host -> backend name, computed once per host (services/moto_server.py).
    moto_routes: dict[str | None, Any] = field(default_factory=dict)
    # Step Functions: state transitions (state entries and retry attempts, as AWS counts them),
    # Distributed Map children included (stepfunctions/limits.py).
    sfn_transitions: int = 0
    sfn_transitions_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # SageMaker: instance quotas in use and the Create* rate limit (sagemaker/quotas.py).
    sagemaker_quotas: SageMakerQuotas = field(default_factory=SageMakerQuotas)
    # Lambda: invocations in flight per function with reserved concurrency (services/awslambda_limits.py).
    lambda_concurrency: LambdaConcurrency = field(default_factory=LambdaConcurrency)
    # Lambda: the account's "Concurrent executions" quota, which reservations must leave room in
    # (services/awslambda_limits.py check_reservation).
    lambda_account_concurrency: int = 1_000
    # IAM: the roles' credentials and policies (services/iam.py IamEnforcer); None: not enforced.
    iam: Any = None
    # Every API call the local cloud served, by (IAM service prefix, operation) (services/iam.py).
    api_calls: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    api_calls_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # Fault injection (sdflow/local/faults.py): CreateTrainingJob calls still to fail for capacity.
    training_capacity_failures: int = 0
    # Fault injection: (IAM service prefix, operation) -> [error code, message, HTTP status, calls
    # still to fail] (faults.fail_api_calls; answered by services/iam.py's request hook).
    api_errors: dict[tuple[str, str], list[Any]] = field(default_factory=dict)
    # Fault injection: execution ARNs whose end (status change to anything but RUNNING) is never
    # delivered to EventBridge (faults.drop_end_event).
    dropped_end_events: set[str] = field(default_factory=set)
    faults_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # Set by LocalCloud.stop() before it shuts the workers down: background work that ends
    # because of it (an asynchronous invocation in flight) ends quietly, not as a failure.
    stopping: bool = False
    _inflight: int = field(default=0, repr=False)
    _idle: threading.Condition = field(default_factory=threading.Condition, repr=False)

    def drops_status_event(self, execution_arn: str, status: str) -> bool:
        with self.faults_lock:
            return status != "RUNNING" and execution_arn in self.dropped_end_events

    def __post_init__(self) -> None:
        # One clock: the runner marks invocations busy on it and tells the workers its offset.
        if self.lambda_runner is not None and hasattr(self.lambda_runner, "clock"):
            self.lambda_runner.clock = self.clock

    @property
    def sns_dir(self) -> Path:
        return self.workdir / "sns"

    def register_code(self, function_name: str, code_dir: Path, layer_dirs: tuple[Path, ...] = ()) -> None:
        self.code[function_name] = FunctionCode(Path(code_dir), tuple(Path(d) for d in layer_dirs))

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Wait until no asynchronous invocation is running; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._inflight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    @contextlib.contextmanager
    def async_task(self) -> Iterator[None]:
        """Counts a background task (an asynchronous invocation) for wait_idle()."""
        with self._idle:
            self._inflight += 1
        try:
            yield
        finally:
            with self._idle:
                self._inflight -= 1
                self._idle.notify_all()


_current: Runtime | None = None


def current_runtime() -> Runtime:
    if _current is None:
        raise PatchError("sdflow.local.patching.install(runtime) has not been called")
    return _current


def current_clock() -> Clock:
    """The clock of the runtime in force, or real time when the patches run without one."""
    return _current.clock if _current is not None else REAL_TIME


def runtime_or_none() -> Runtime | None:
    """The runtime in force, or None when the patches run without one (moto's own behaviour then)."""
    return _current


def set_current(runtime: Runtime | None) -> None:
    global _current
    _current = runtime
