"""Run a Lambda function's real handler in its own worker process, as the Lambda service would.

Each function gets a small pool of warm worker processes (started lazily, reused). A worker
sees only the environment the deployed function has, plus what the Lambda runtime itself
sets (AWS_LAMBDA_FUNCTION_NAME, AWS_REGION, …), fake credentials and AWS_ENDPOINT_URL
pointing at the local cloud; its sys.path is the function's code folder and its layers, as
in /var/task and /opt/python. Nothing is shared between functions: no os.environ, no module
state, no cached boto3 clients.

Parent and worker speak JSON lines over the worker's stdin and a duplicate of its original
stdout; the handler's own prints and logs go to the worker's stderr, which is appended to a
log file per function (the local CloudWatch Logs). A handler that runs past the function's
Timeout is killed and reported as AWS reports it (errorType "Sandbox.Timedout").

The worker's side of that protocol, the handler's context and the REPORT line are in
lambda_worker.py, the file each worker process runs."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sdflow.local import lambda_worker
from sdflow.local.account import ACCOUNT_ID
from sdflow.local.clock import REAL_TIME, Clock
from sdflow.local.lambda_worker import error_payload

log = logging.getLogger(__name__)

# AWS gives the init phase (imports, module-level code) 10 s of its own; a cold start on a
# busy 2-core machine importing boto3 + Powertools + pydantic needs more.
DEFAULT_INIT_TIMEOUT_S = 60.0
# Warm workers per function. On 2 cores more workers only contend for the CPU: a 300-shard
# no-op run took 24 s with 1, 23 s with 2, 31 s with 3 and 29 s with 4 (each ~80 MB).
DEFAULT_MAX_WORKERS_PER_FUNCTION = 2
# Warm workers across all functions. Lambda recycles idle execution environments; here the
# least recently used idle worker of another function is stopped when a new one would pass this,
# which keeps a 10,000-shard run's memory flat (each worker holds ~80-100 MB). A run calls the
# template's 13 functions in turn: below one warm worker each, the least recently used one is
# always the next needed, and every call starts cold (~1 s of CPU: a no-op run cold-started 10
# of its 17 calls and took 14 s with 6; with 12 it took under 1 s once warm).
DEFAULT_MAX_WORKERS_TOTAL = 13
# Lambda also recycles an environment that has been idle for a while (minutes; AWS does not say
# how long). Here a worker idle for this long in real time is stopped at the next invocation of any
# function: a long run's early functions (validation, the run's start) do not keep ~75 MB each
# while its Map runs for an hour. A 10,000-shard no-op run peaked with 11 workers without it.
DEFAULT_IDLE_LIFETIME_S = 120.0
# A function's workers beyond its first exist for a burst (a Distributed Map's starters, its job
# events): once idle this long they are stopped at the next invocation of any function, and the
# first stays warm for DEFAULT_IDLE_LIFETIME_S. A 10,000-shard no-op run peaked at its end with
# the Map's second StartDownload and JobEvents workers still idle beside the functions that end
# the run (10 workers, ~75 MB each).
SURPLUS_IDLE_LIFETIME_S = 10.0
# How long a worker is given to exit after its stdin closes, before it is killed.
STOP_GRACE_S = 3.0
# Below this the worker keeps its own time: the wall clock and a real-speed Clock drift apart by
# milliseconds, and shifting a handler's time costs an import (time-machine) it need not pay.
CLOCK_OFFSET_MIN_S = 1.0
FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
}


class LambdaRunnerError(RuntimeError):
    """The runner itself was misused (e.g. invoked after shutdown)."""


class OutputSink(Protocol):
    """Where a worker's output lines go besides its log file (sdflow/local/services/logs.py:
    CloudWatch Logs and EMF metrics). `writer` is called once per worker, from the pool."""

    def writer(self, function_name: str, log_stream: str, log_group: str | None = None) -> Callable[[bytes], None]: ...


def log_stream_name(now: float | None = None, function_name: str = "") -> str:
    """Lambda's stream name for a new execution environment: YYYY/MM/DD/[version]<32 hex>
    ("How CloudWatch structures logs", AWS Lambda operator guide); in a custom log group
    (LoggingConfig.LogGroup) YYYY/MM/DD/<function name>[version]<32 hex>, so that functions
    sharing a group stay apart ("Configuring CloudWatch log groups", AWS Lambda developer guide)."""
    day = time.strftime("%Y/%m/%d", time.gmtime(time.time() if now is None else now))
    return f"{day}/{function_name}[$LATEST]{uuid.uuid4().hex}"


@dataclass(frozen=True)
class FunctionSpec:
    """What a worker needs to run one deployed function."""

    name: str
    arn: str
    handler: str  # "module.function", e.g. "app.lambda_handler"
    code_dir: Path
    layer_dirs: tuple[Path, ...] = ()
    environment: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 3.0
    memory_mb: int = 128
    runtime: str = "python3.11"
    # The role's STS credentials (AWS_ACCESS_KEY_ID, …) when the local cloud enforces IAM.
    credentials: Mapping[str, str] = field(default_factory=dict)
    # LoggingConfig.LogGroup; "" is Lambda's default group, /aws/lambda/<name>.
    log_group: str = ""

    def fingerprint(self) -> str:
        """Workers are reused only for an identical configuration (code, handler, env, timeout)."""
        blob = json.dumps(
            [
                self.name,
                self.handler,
                str(self.code_dir),
                [str(d) for d in self.layer_dirs],
                sorted(self.environment.items()),
                self.timeout_s,
                self.memory_mb,
                sorted(self.credentials.items()),
            ]
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class InvocationResult:
    """The response body and whether the invocation failed (Lambda's X-Amz-Function-Error)."""

    payload: bytes
    function_error: str | None = None  # "Unhandled" when the function failed

    @property
    def error_type(self) -> str | None:
        if self.function_error is None:
            return None
        try:
            return str(json.loads(self.payload).get("errorType"))
        except (ValueError, AttributeError):
            return None


def _platform_error(error_type: str, message: str) -> bytes:
    """An error of the Lambda service itself (timeout, runtime exit): AWS answers only
    {"errorType", "errorMessage"}, e.g. {"errorType": "Sandbox.Timedout", "errorMessage":
    "RequestId: <id> Error: Task timed out after 3.00 seconds"}."""
    return json.dumps({"errorType": error_type, "errorMessage": message}).encode()


class _Worker:
    """One warm worker process and the thread that reads its answers."""

    def __init__(
        self,
        spec: FunctionSpec,
        env: dict[str, str],
        python: str,
        log_path: Path,
        output: Callable[[bytes], None] | None = None,
    ) -> None:
        self.spec = spec
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [python, "-I", str(Path(lambda_worker.__file__).resolve()), "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=str(spec.code_dir),
            start_new_session=True,  # a Ctrl-C in the terminal reaches the runner, which stops workers
        )
        self.answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"lambda-reader-{spec.name}", daemon=True)
        self._reader.start()
        self._copier = threading.Thread(
            target=self._copy_output, args=(log_path, output), name=f"lambda-output-{spec.name}", daemon=True
        )
        self._copier.start()
        self.ready = False
        self.busy = False  # running an invocation (or its init) now
        self.released_at = 0.0  # time.monotonic() of its last release to the idle list

    def _copy_output(self, log_path: Path, output: Callable[[bytes], None] | None) -> None:
        # The handler's output: to the function's log file and, line by line, to the output sink.
        assert self.proc.stderr is not None
        with open(log_path, "ab", buffering=0) as log_file:
            for line in self.proc.stderr:
                log_file.write(line)
                if output is not None:
                    try:
                        output(line)
                    except Exception:  # a sink bug must not block the worker's stderr
                        log.exception("output sink failed for %s", self.spec.name)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.answers.put(json.loads(line))
            except ValueError:
                log.warning("worker of %s wrote a non-protocol line: %r", self.spec.name, line[:200])
        self.answers.put(None)  # EOF: the process is gone

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


class ArmedKill:
    """A worker kill waiting for the function's next invocation; `pid` is set once it happened."""

    def __init__(self) -> None:
        self.pid = 0
        self._event = threading.Event()

    def done(self, pid: int) -> None:
        self.pid = pid
        self._event.set()

    def wait(self, timeout_s: float) -> bool:
        return self._event.wait(timeout_s)


class _Pool:
    """Warm workers of one function configuration, at most `size` at a time."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.idle: list[_Worker] = []
        self.count = 0
        self.cond = threading.Condition()


class LambdaRunner:
    """Invokes functions in per-function worker processes; thread-safe."""

    def __init__(
        self,
        endpoint_url: str,
        region: str,
        log_dir: Path,
        *,
        python: str = sys.executable,
        max_workers_per_function: int = DEFAULT_MAX_WORKERS_PER_FUNCTION,
        max_workers_total: int | None = DEFAULT_MAX_WORKERS_TOTAL,
        idle_lifetime_s: float | None = DEFAULT_IDLE_LIFETIME_S,
        surplus_idle_lifetime_s: float | None = SURPLUS_IDLE_LIFETIME_S,
        init_timeout_s: float = DEFAULT_INIT_TIMEOUT_S,
        account_id: str = ACCOUNT_ID,
        output_sink: OutputSink | None = None,
        clock: Clock = REAL_TIME,
    ) -> None:
        self.endpoint_url = endpoint_url
        # An invocation is work: the clock runs at real speed while one runs (clock.busy), and
        # the worker tells the time as the clock does (its offset travels with each event).
        self.clock = clock
        self.region = region
        self.log_dir = Path(log_dir)
        self.python = python
        self.max_workers_per_function = max_workers_per_function
        self.max_workers_total = max_workers_total
        self.idle_lifetime_s = idle_lifetime_s
        self.surplus_idle_lifetime_s = surplus_idle_lifetime_s
        self._expiry_checked_at = time.monotonic()
        self.init_timeout_s = init_timeout_s
        self.account_id = account_id
        self.output_sink = output_sink
        self._pools: dict[str, _Pool] = {}
        self._lock = threading.Lock()
        self._closed = False
        # Busy workers too: shutdown() must not leave a worker whose handler is still running.
        self._all_workers: weakref.WeakSet[_Worker] = weakref.WeakSet()
        self.stats = {"invocations": 0, "errors": 0, "timeouts": 0, "cold_starts": 0}
        # Function name -> extra environment for its new workers (sdflow/local/faults.py).
        self.fault_env: dict[str, dict[str, str]] = {}
        # Function name -> a kill armed for its next invocation (faults.kill_lambda_worker).
        self._armed_kills: dict[str, ArmedKill] = {}

    # ------------------------------------------------------------------ environment

    def environment_for(self, spec: FunctionSpec) -> dict[str, str]:
        """Exactly what the Lambda service would give this function, pointed at the local cloud."""
        env = {
            # What the runtime itself provides.
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "LANG": "en_US.UTF-8",
            "TZ": ":UTC",
            "LAMBDA_TASK_ROOT": str(spec.code_dir),
            "_HANDLER": spec.handler,
            "AWS_EXECUTION_ENV": f"AWS_Lambda_{spec.runtime}",
            "AWS_LAMBDA_FUNCTION_NAME": spec.name,
            "AWS_LAMBDA_FUNCTION_VERSION": "$LATEST",
            "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": str(spec.memory_mb),
            "AWS_LAMBDA_FUNCTION_TIMEOUT": str(int(spec.timeout_s)),
            "AWS_LAMBDA_LOG_GROUP_NAME": spec.log_group or f"/aws/lambda/{spec.name}",
            # A new one per execution environment.
            "AWS_LAMBDA_LOG_STREAM_NAME": log_stream_name(function_name=spec.name if spec.log_group else ""),
            "AWS_LAMBDA_INITIALIZATION_TYPE": "on-demand",
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            **(spec.credentials or FAKE_CREDENTIALS),
            # The local cloud: every boto3 client in the handler talks to it, never to AWS.
            "AWS_ENDPOINT_URL": self.endpoint_url,
            # No user profile, no ~/.aws files: the function has only its own role (fake keys).
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
            # No X-Ray daemon locally; Tracer would otherwise try to send segments.
            "POWERTOOLS_TRACE_DISABLED": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
            "SDFLOW_LAMBDA_PATH": os.pathsep.join([str(spec.code_dir), *(str(d) for d in spec.layer_dirs)]),
        }
        env.update({str(k): str(v) for k, v in spec.environment.items()})
        env.update(self.fault_env.get(spec.name, {}))
        return env

    # ------------------------------------------------------------------ pool

    def _pool(self, spec: FunctionSpec) -> tuple[str, _Pool]:
        # Workers started before a fault was set (or cleared) are not reused under the new setting.
        fault = json.dumps(sorted(self.fault_env.get(spec.name, {}).items()))
        key = f"{spec.name}:{spec.fingerprint()}:{hashlib.sha256(fault.encode()).hexdigest()[:8]}"
        with self._lock:
            if self._closed:
                raise LambdaRunnerError("the Lambda runner was shut down; start the local cloud again")
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = _Pool(self.max_workers_per_function)
            return key, pool

    def _acquire(self, spec: FunctionSpec, pool: _Pool) -> _Worker:
        with pool.cond:
            while True:
                while pool.idle:
                    worker = pool.idle.pop()
                    if worker.alive():
                        return worker
                    pool.count -= 1
                if pool.count < pool.size:
                    pool.count += 1
                    break
                pool.cond.wait()
        self._recycle_idle_beyond_total(pool)
        try:
            self.stats["cold_starts"] += 1
            log_path = self.log_dir / f"{spec.name}.log"
            env = self.environment_for(spec)
            sink = self.output_sink
            stream, group = env["AWS_LAMBDA_LOG_STREAM_NAME"], env["AWS_LAMBDA_LOG_GROUP_NAME"]
            output = sink.writer(spec.name, stream, group) if sink is not None else None
            worker = _Worker(spec, env, self.python, log_path, output)
            with self._lock:
                self._all_workers.add(worker)
            return worker
        except BaseException:
            self._discard(pool, None)
            raise

    def _recycle_idle_beyond_total(self, keep: _Pool) -> None:
        """Stop the least recently released idle worker of another function while the warm
        workers (the one about to start included) are more than max_workers_total. Busy workers
        are never stopped: when every other worker is busy, the total is exceeded for a while."""
        if self.max_workers_total is None:
            return
        with self._lock:
            pools = [p for p in self._pools.values() if p is not keep]
            total = keep.count + sum(p.count for p in pools)
        victims: list[_Worker] = []
        while total > self.max_workers_total:
            candidates = [p for p in pools if p.idle]
            if not candidates:
                break
            oldest = min(candidates, key=lambda p: p.idle[0].released_at)
            with oldest.cond:
                if not oldest.idle:
                    continue
                victims.append(oldest.idle.pop(0))
                oldest.count -= 1
                oldest.cond.notify()
            total -= 1
        for victim in victims:
            victim.stop()

    def _recycle_expired(self) -> None:
        """Stop every worker idle longer than its lifetime: idle_lifetime_s for a function's last
        worker, surplus_idle_lifetime_s for the others (at most one scan a second)."""
        now = time.monotonic()
        with self._lock:
            if now - self._expiry_checked_at < 1.0:
                return
            self._expiry_checked_at = now
            pools = list(self._pools.values())
        last = now - self.idle_lifetime_s if self.idle_lifetime_s is not None else None
        surplus = now - self.surplus_idle_lifetime_s if self.surplus_idle_lifetime_s is not None else None
        victims: list[_Worker] = []
        for pool in pools:
            with pool.cond:
                while pool.idle:  # idle[0]: the longest idle
                    cutoff = surplus if pool.count > 1 else last
                    if cutoff is None or pool.idle[0].released_at >= cutoff:
                        break
                    victims.append(pool.idle.pop(0))
                    pool.count -= 1
                    pool.cond.notify()
        for victim in victims:
            victim.stop()

    def _release(self, pool: _Pool, worker: _Worker) -> None:
        with pool.cond:
            if self._closed or not worker.alive():
                pool.count -= 1
                stop = True
            else:
                worker.released_at = time.monotonic()
                pool.idle.append(worker)
                stop = False
            pool.cond.notify()
        if stop:
            worker.stop()

    def _discard(self, pool: _Pool, worker: _Worker | None) -> None:
        if worker is not None:
            worker.kill()
        with pool.cond:
            pool.count -= 1
            pool.cond.notify()

    # ------------------------------------------------------------------ invoke

    def invoke(self, spec: FunctionSpec, event: bytes | str, request_id: str | None = None) -> InvocationResult:
        """Run the handler on `event` (JSON text) and return its JSON result or Lambda's error payload."""
        request_id = request_id or str(uuid.uuid4())
        text = event.decode() if isinstance(event, bytes) else event
        _, pool = self._pool(spec)
        self.stats["invocations"] += 1
        self._recycle_expired()
        with self.clock.busy():
            return self._invoke(spec, pool, text, request_id)

    def _invoke(self, spec: FunctionSpec, pool: _Pool, text: str, request_id: str) -> InvocationResult:
        worker = self._acquire(spec, pool)
        worker.busy = True
        try:
            if not worker.ready:
                init_error = self._wait_ready(worker, request_id)
                if init_error is not None:
                    self._discard(pool, worker)
                    self.stats["errors"] += 1
                    return init_error
            result, reusable = self._run_one(worker, spec, text, request_id)
        except BaseException:
            self._discard(pool, worker)
            raise
        finally:
            worker.busy = False
        if reusable:
            self._release(pool, worker)
        else:
            self._discard(pool, worker)
        if result.function_error:
            self.stats["errors"] += 1
        return result

    def prewarm(self, spec: FunctionSpec) -> bool:
        """Start one worker and import its handler now, so the first invocation is warm
        (what provisioned concurrency does on AWS). False if the handler failed to load."""
        _, pool = self._pool(spec)
        worker = self._acquire(spec, pool)
        if not worker.ready and self._wait_ready(worker, f"prewarm-{uuid.uuid4()}") is not None:
            self._discard(pool, worker)
            return False
        self._release(pool, worker)
        return True

    def _wait_ready(self, worker: _Worker, request_id: str) -> InvocationResult | None:
        worker.send({"init": True, "handler": worker.spec.handler})
        try:
            answer = worker.answers.get(timeout=self.init_timeout_s)
        except queue.Empty:
            message = f"RequestId: {request_id} Error: init took more than {self.init_timeout_s:.0f} s"
            return InvocationResult(error_payload("Runtime.InitTimeout", message, request_id), "Unhandled")
        if answer is None:
            message = (
                f"RequestId: {request_id} Error: Runtime exited during init with status {worker.proc.wait()} "
                f"(see {self.log_dir / worker.spec.name}.log)"
            )
            return InvocationResult(error_payload("Runtime.ExitError", message, request_id), "Unhandled")
        if answer.get("error"):
            return InvocationResult(answer["error"].encode(), "Unhandled")
        worker.ready = True
        return None

    def _run_one(
        self, worker: _Worker, spec: FunctionSpec, text: str, request_id: str
    ) -> tuple[InvocationResult, bool]:
        """The invocation's result, and whether the worker can serve another one."""
        # While the invocation runs the clock runs at real speed, so the timeout below (real
        # seconds) is the same length on the clock; the worker shifts its time by the offset.
        offset_s = round(self.clock.offset_s(), 3)
        deadline_ms = int((time.time() + offset_s + spec.timeout_s) * 1000)
        request = {"event": text, "request_id": request_id, "deadline_ms": deadline_ms, "arn": spec.arn}
        if abs(offset_s) >= CLOCK_OFFSET_MIN_S:
            request["clock_offset_s"] = offset_s
        worker.send(request)
        with self._lock:
            armed = self._armed_kills.pop(spec.name, None)
        if armed is not None:  # the event is in the worker's hands: this is a mid-invocation death
            worker.kill()
            armed.done(worker.proc.pid)
        try:
            answer = worker.answers.get(timeout=spec.timeout_s)
        except queue.Empty:
            # Like AWS: the sandbox is torn down, the next invocation starts cold.
            worker.kill()
            self.stats["timeouts"] += 1
            message = f"RequestId: {request_id} Error: Task timed out after {spec.timeout_s:.2f} seconds"
            return InvocationResult(_platform_error("Sandbox.Timedout", message), "Unhandled"), False
        if answer is None:
            message = f"RequestId: {request_id} Error: Runtime exited with error: exit status {worker.proc.wait()}"
            return InvocationResult(_platform_error("Runtime.ExitError", message), "Unhandled"), False
        if answer.get("error"):
            return InvocationResult(answer["error"].encode(), "Unhandled"), True
        return InvocationResult(answer["result"].encode()), True

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        """Stop every worker: idle ones close stdin (killed after a grace period), busy ones are killed."""
        with self._lock:
            self._closed = True
            pools = list(self._pools.values())
        for pool in pools:
            with pool.cond:
                idle, pool.idle = pool.idle, []
                pool.count -= len(idle)
                pool.cond.notify_all()
            for worker in idle:
                worker.stop()
        with self._lock:
            busy = [w for w in self._all_workers if w.alive()]
        for worker in busy:  # its invocation answers Runtime.ExitError, as when a sandbox dies
            worker.kill()

    def busy_worker_pids(self, function_name: str) -> list[int]:
        """Pids of this function's workers running an invocation now (fault injection: a worker
        killed mid-invocation answers Runtime.ExitError, as a crashed Lambda sandbox does)."""
        with self._lock:
            workers = list(self._all_workers)
        return [w.proc.pid for w in workers if w.spec.name == function_name and w.busy and w.alive()]

    def arm_kill(self, function_name: str) -> ArmedKill:
        """SIGKILL the worker that takes the function's next invocation, once the event is sent to
        it. Polling for a busy worker misses invocations shorter than the poll on a loaded machine."""
        armed = ArmedKill()
        with self._lock:
            self._armed_kills[function_name] = armed
        return armed

    def disarm_kill(self, function_name: str, armed: ArmedKill) -> None:
        with self._lock:
            if self._armed_kills.get(function_name) is armed:
                del self._armed_kills[function_name]

    def worker_pids(self) -> list[int]:
        """Pids of the idle (warm) workers, for tests and diagnostics."""
        with self._lock:
            pools = list(self._pools.values())
        return [w.proc.pid for pool in pools for w in pool.idle if w.alive()]
