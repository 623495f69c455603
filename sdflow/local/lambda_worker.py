"""The worker side of the local Lambda runtime: the process that imports a function's handler
and runs its invocations (sdflow/local/lambda_runner.py starts it and speaks to it).

It runs as `python -I lambda_worker.py --worker`: isolated, with only the function's code and
layers on sys.path, so this file imports the standard library only (botocore lazily, for the
crash fault; time-machine lazily, when the local cloud's clock is ahead of this machine's).

Parent and worker speak JSON lines over the worker's stdin and a duplicate of its original
stdout; the handler's own prints and logs go to stderr, with Lambda's START/END/REPORT lines."""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def error_payload(error_type: str, message: str, request_id: str, stack: list[str] | None = None) -> bytes:
    body: dict[str, Any] = {"errorMessage": message, "errorType": error_type, "requestId": request_id}
    body["stackTrace"] = stack or []
    return json.dumps(body).encode()


class LambdaContext:
    """The context object the Python runtime passes to a handler."""

    def __init__(self, request_id: str, deadline_ms: int, arn: str) -> None:
        self.function_name = os.environ.get("AWS_LAMBDA_FUNCTION_NAME", "")
        self.function_version = os.environ.get("AWS_LAMBDA_FUNCTION_VERSION", "$LATEST")
        self.invoked_function_arn = arn
        self.memory_limit_in_mb = int(os.environ.get("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "128"))
        self.aws_request_id = request_id
        self.log_group_name = os.environ.get("AWS_LAMBDA_LOG_GROUP_NAME", "")
        self.log_stream_name = os.environ.get("AWS_LAMBDA_LOG_STREAM_NAME", "")
        self.identity = None
        self.client_context = None
        self._deadline_ms = deadline_ms

    def get_remaining_time_in_millis(self) -> int:
        return max(0, self._deadline_ms - int(time.time() * 1000))


def _format_exception(exc: BaseException, request_id: str) -> str:
    # The first frame is this runner's call into the handler; AWS shows the handler's frames only.
    stack = traceback.format_list(traceback.extract_tb(exc.__traceback__)[1:])
    return error_payload(type(exc).__name__, str(exc), request_id, stack).decode()


def report_line(request_id: str, duration_ms: float, memory_mb: int, init_ms: float | None = None) -> str:
    """Lambda's REPORT line: tab-separated, billed duration rounded up to the millisecond (Lambda
    bills per 1 ms), Max Memory Used from the worker's peak RSS, Init Duration after a cold start."""
    import math
    import resource

    used_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # KiB on Linux
    line = (
        f"REPORT RequestId: {request_id}\tDuration: {duration_ms:.2f} ms\tBilled Duration: "
        f"{max(1, math.ceil(duration_ms))} ms\tMemory Size: {memory_mb} MB\tMax Memory Used: {used_mb} MB\t"
    )
    if init_ms is not None:
        line += f"Init Duration: {init_ms:.2f} ms\t"
    return line


EXIT_AFTER_ENV = "SDFLOW_FAULT_EXIT_AFTER"  # "<service>.<Operation>", e.g. "sagemaker.CreateProcessingJob"
EXIT_TIMES_ENV = "SDFLOW_FAULT_EXIT_TIMES"  # how many invocations crash, across all workers
EXIT_CLAIMS_ENV = "SDFLOW_FAULT_EXIT_CLAIMS"  # a folder: one file per crash already done


def _claim_crash(claims: Path, times: int) -> bool:
    """One of the `times` crashes, claimed atomically across worker processes (O_EXCL files)."""
    claims.mkdir(parents=True, exist_ok=True)
    for i in range(times):
        try:
            os.close(os.open(claims / str(i), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        return True
    return False


def install_exit_after(target: str, claims: Path, times: int) -> None:
    """Fault injection (sdflow/local/faults.py): the process exits (status 1, no answer) right after
    a successful boto3 call of `target`, so the invocation fails with Runtime.ExitError after the
    call's side effect, as a Lambda sandbox that crashes there. Wraps botocore's BaseClient, so
    every client of every session in the worker is covered."""
    import botocore.client

    service, _, operation = target.partition(".")
    client_class: Any = botocore.client.BaseClient
    call = client_class._make_api_call

    def make_api_call(client: Any, operation_name: str, api_params: Any) -> Any:
        result = call(client, operation_name, api_params)
        if (
            operation_name == operation
            and client.meta.service_model.service_name == service
            and _claim_crash(claims, times)
        ):
            print(f"sdflow fault: exiting after {target}", file=sys.stderr, flush=True)
            os._exit(1)
        return result

    client_class._make_api_call = make_api_call


@contextlib.contextmanager
def shifted_time(offset_s: float) -> Iterator[None]:
    """Run the handler on the local cloud's clock (sdflow/local/clock.py): `offset_s` ahead of
    this machine's. time-machine moves time.time(), datetime.now() and their C-level callers
    alike, so a default argument bound to time.time (token_store's clock) moves too; the
    local cloud's venv has it, and it is imported only when the clock is ahead."""
    if not offset_s:
        yield
        return
    import time_machine

    with time_machine.travel(time.time() + offset_s, tick=True):
        yield


def _worker_main() -> None:  # pragma: no cover - runs in the worker process
    # Keep the protocol on the original stdout; anything the handler prints goes to stderr (the log).
    protocol: IO[str] = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for entry in reversed(os.environ.get("SDFLOW_LAMBDA_PATH", "").split(os.pathsep)):
        if entry:
            sys.path.insert(0, entry)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    if os.environ.get(EXIT_AFTER_ENV):
        exit_claims = Path(os.environ[EXIT_CLAIMS_ENV])
        install_exit_after(os.environ[EXIT_AFTER_ENV], exit_claims, int(os.environ.get(EXIT_TIMES_ENV, "1")))
    handler: Any = None
    init_ms: float | None = None
    memory_mb = int(os.environ.get("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "128"))

    def answer(message: dict[str, Any]) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    for line in sys.stdin:
        request = json.loads(line)
        if request.get("init"):
            module_name, _, function_name = request["handler"].rpartition(".")
            init_started = time.monotonic()
            try:
                handler = getattr(importlib.import_module(module_name), function_name)
            except Exception as exc:
                message = f"Unable to import module '{module_name}': {exc}"
                payload = error_payload("Runtime.ImportModuleError", message, "init").decode()
                answer({"error": payload})
                return
            init_ms = (time.monotonic() - init_started) * 1000
            answer({"ready": True})
            continue
        request_id = request["request_id"]
        context = LambdaContext(request_id, request["deadline_ms"], request.get("arn", ""))
        print(f"START RequestId: {request_id} Version: $LATEST", file=sys.stderr, flush=True)
        started = time.monotonic()
        try:
            event = json.loads(request["event"]) if request["event"] else {}
            with shifted_time(float(request.get("clock_offset_s", 0.0))):
                result = handler(event, context)
        except Exception as exc:
            traceback.print_exc()
            answer({"error": _format_exception(exc, request_id)})
        else:
            try:
                answer({"result": json.dumps(result)})
            except (TypeError, ValueError) as exc:
                message = f"Unable to marshal response: {exc}"
                answer({"error": error_payload("Runtime.MarshalError", message, request_id).decode()})
        elapsed_ms = (time.monotonic() - started) * 1000
        print(f"END RequestId: {request_id}", file=sys.stderr)
        print(report_line(request_id, elapsed_ms, memory_mb, init_ms), file=sys.stderr, flush=True)
        init_ms = None  # reported once, on the cold start's first invocation


if __name__ == "__main__":
    if "--worker" in sys.argv:
        _worker_main()
