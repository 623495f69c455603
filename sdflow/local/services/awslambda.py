"""Lambda: real handlers in worker processes, asynchronous invocations with retries and a DLQ."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import threading
import uuid
import zipfile
from pathlib import Path
from typing import Any

from sdflow.local.lambda_concurrency import reserved_concurrency
from sdflow.local.lambda_runner import FunctionSpec, InvocationResult, LambdaRunner
from sdflow.local.patching import Patch, replace
from sdflow.local.runtime import FunctionCode, PatchError, Runtime, current_runtime
from sdflow.local.services.awslambda_limits import concurrency_key

log = logging.getLogger(__name__)


def _function_code(runtime: Runtime, fn: Any) -> FunctionCode:
    """The registered source folders, else the deployed zip and layers extracted once."""
    if fn.function_name in runtime.code:
        return runtime.code[fn.function_name]
    from moto.awslambda.utils import get_backend

    cache = runtime.workdir / "lambda-code"

    def extract(code_bytes: bytes, sha: str) -> Path:
        target = cache / re.sub(r"[^0-9A-Za-z]", "_", sha)[:64]
        if not target.is_dir():
            tmp = target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex}")
            zipfile.ZipFile(io.BytesIO(code_bytes)).extractall(tmp)
            with contextlib.suppress(OSError):  # another thread won the race: its copy is identical
                tmp.rename(target)
        return target

    if not getattr(fn, "code_bytes", b""):
        raise PatchError(f"function {fn.function_name} has no code to run locally (no zip, no registered folder)")
    code_dir = extract(fn.code_bytes, fn.code_sha_256)
    layers = []
    backend = get_backend(fn.account_id, fn.region)
    for layer in fn.layers or []:
        version = backend.layers_versions_by_arn(layer["Arn"])
        if version is None:
            raise PatchError(f"layer {layer['Arn']} of function {fn.function_name} does not exist")
        root = extract(version.code_bytes, version.code_sha_256)
        # A layer's Python code lives under python/ (on Lambda: /opt/python).
        layers.append(root / "python" if (root / "python").is_dir() else root)
    return FunctionCode(code_dir, tuple(layers))


def function_spec(runtime: Runtime, fn: Any) -> FunctionSpec:
    """A FunctionSpec from moto's deployed function: its env, timeout, memory and code."""
    code = _function_code(runtime, fn)
    return FunctionSpec(
        name=fn.function_name,
        arn=fn.function_arn,
        handler=fn.handler or "app.lambda_handler",
        code_dir=code.code_dir,
        layer_dirs=code.layer_dirs,
        environment=dict(fn.environment_vars or {}),
        timeout_s=float(fn.timeout or 3),
        memory_mb=int(fn.memory_size or 128),
        runtime=fn.run_time or "python3.11",
        # Lambda runs the handler with its execution role's session, named after the function.
        credentials=runtime.iam.credentials_for_role(fn.role, fn.function_name) if runtime.iam and fn.role else {},
        log_group=str((getattr(fn, "logging_config", None) or {}).get("LogGroup") or ""),
    )


def _runner(runtime: Runtime) -> LambdaRunner:
    if runtime.lambda_runner is None:
        raise PatchError("the local runtime has no LambdaRunner; LocalCloud creates one")
    return runtime.lambda_runner


def async_retries(fn: Any) -> int:
    """The function's EventInvokeConfig MaximumRetryAttempts (0 to 2); Lambda's 2 without one."""
    configs = getattr(fn, "event_invoke_config", None) or []
    return int(configs[-1].config.get("MaximumRetryAttempts", 2)) if configs else 2


def invoke_function_async(fn: Any, payload: bytes) -> None:
    """An "Event" invocation: run in the background, retry like Lambda, then the DLQ."""
    runtime = current_runtime()
    spec = function_spec(runtime, fn)
    request_id = str(uuid.uuid4())

    def run() -> None:
        with runtime.async_task():
            result: InvocationResult | None = None
            for delay in (0.0, *runtime.async_retry_delays_s[: async_retries(fn)]):
                runtime.clock.sleep(delay, what=f"Lambda asynchronous retry of {spec.name}")
                try:
                    # Past reserved concurrency the event stays queued (sdflow/local/lambda_concurrency.py).
                    with runtime.lambda_concurrency.slot(concurrency_key(fn), reserved_concurrency(fn), wait=True):
                        result = _runner(runtime).invoke(spec, payload, request_id)
                except Exception:  # the runner itself failed (e.g. shut down): nothing to retry
                    if runtime.stopping:  # the local cloud shut the runner down: a normal end
                        log.info("asynchronous invocation of %s dropped: the local cloud is stopping", spec.name)
                    else:
                        log.exception("asynchronous invocation of %s could not run", spec.name)
                    return
                if result.function_error is None:
                    return
                if runtime.stopping:  # its worker was ended by the stop, not by the function
                    log.info("asynchronous invocation of %s dropped: the local cloud is stopping", spec.name)
                    return
                log.warning("asynchronous invocation of %s failed: %s", spec.name, result.payload[:500])
            _send_to_dead_letter_queue(fn, payload, result, request_id)

    threading.Thread(target=run, name=f"lambda-async-{spec.name}", daemon=True).start()


def _send_to_dead_letter_queue(fn: Any, payload: bytes, result: InvocationResult | None, request_id: str) -> None:
    target = (getattr(fn, "dead_letter_config", None) or {}).get("TargetArn")
    if not target or not target.startswith("arn:aws:sqs:"):
        return
    from moto.sqs.models import sqs_backends

    _, _, _, region, account, queue = target.split(":", 5)
    error = json.loads(result.payload) if result else {}
    attributes = {
        "RequestID": {"DataType": "String", "StringValue": request_id},
        "ErrorCode": {"DataType": "Number", "StringValue": "200"},
        "ErrorMessage": {"DataType": "String", "StringValue": str(error.get("errorMessage", ""))[:1000]},
    }
    sqs_backends[account][region].send_message(queue, payload.decode(), message_attributes=attributes)
    log.warning("event for %s moved to its dead-letter queue %s", fn.function_name, queue)


def lambda_invoke(
    self: Any, function_name: str, qualifier: str | None, body: Any, headers: Any, response_headers: dict[str, Any]
) -> bytes:
    """Replaces moto/awslambda_simple/models.py LambdaSimpleBackend.invoke.

    The no-Docker backend ({"lambda": {"use_docker": False}}) answers a canned string; this runs
    the function's real handler in its own worker process (sdflow.local.lambda_runner). An
    unhandled exception becomes Lambda's error payload ({"errorType": <class name>,
    "errorMessage", "stackTrace"}) with X-Amz-Function-Error, which is what Step Functions'
    Retry/Catch match on. "Event" invocations return at once and run in the background."""
    fn = self.get_function(function_name, qualifier)  # ResourceNotFoundException like AWS
    payload = body if isinstance(body, bytes) else (body or "").encode()
    invocation_type = (headers or {}).get("X-Amz-Invocation-Type") or "RequestResponse"
    if invocation_type == "DryRun":
        return b""
    if invocation_type == "Event":
        invoke_function_async(fn, payload)
        return b""
    runtime = current_runtime()
    result = _runner(runtime).invoke(function_spec(runtime, fn), payload)
    if result.function_error:
        response_headers["x-amz-function-error"] = result.function_error
    response_headers["Content-Length"] = str(len(result.payload))
    return result.payload


def lambda_create_from_cloudformation_json(
    cls: Any, resource_name: str, cloudformation_json: dict[str, Any], account_id: str, region_name: str, **kwargs: Any
) -> Any:
    """Wraps moto/awslambda/models.py LambdaFunction.create_from_cloudformation_json.

    moto passes only Description/MemorySize/Timeout/Environment/… to create_function and drops
    Layers, TracingConfig, Architectures, Tags and DeadLetterConfig; the runner needs the layers
    (sys.path) and the DLQ (failed asynchronous invocations)."""
    properties = cloudformation_json["Properties"]
    spec: dict[str, Any] = {
        "Code": properties["Code"],
        "FunctionName": properties.get("FunctionName", resource_name),
        "Handler": properties.get("Handler"),
        "Role": properties["Role"],
        "Runtime": properties.get("Runtime"),
    }
    for name in (
        "Description",
        "MemorySize",
        "Publish",
        "Timeout",
        "VpcConfig",
        "Environment",
        "ReservedConcurrentExecutions",
        "Layers",
        "TracingConfig",
        "Architectures",
        "EphemeralStorage",
    ):
        if name in properties:
            spec[name] = properties[name]
    if "Layers" in spec:
        # moto resolves {"Ref": <LayerVersion>} to the model object (it has no physical_resource_id).
        spec["Layers"] = [getattr(layer, "arn", layer) for layer in spec["Layers"]]
    if isinstance(properties.get("Tags"), list):
        spec["Tags"] = {tag["Key"]: tag["Value"] for tag in properties["Tags"]}
    from moto.awslambda.utils import get_backend

    fn = get_backend(account_id, region_name).create_function(spec)
    # Not a LambdaFunction attribute in moto: the async path reads it with getattr.
    setattr(fn, "dead_letter_config", properties.get("DeadLetterConfig"))  # noqa: B010
    # moto drops LoggingConfig too; its LogGroup is where the function's output goes (services/logs.py).
    setattr(fn, "logging_config", properties.get("LoggingConfig"))  # noqa: B010
    return fn


def patches() -> list[Patch]:
    from moto.awslambda.models import LambdaFunction
    from moto.awslambda_simple.models import LambdaSimpleBackend

    return [
        replace(LambdaSimpleBackend, "invoke", lambda_invoke),
        replace(LambdaFunction, "create_from_cloudformation_json", classmethod(lambda_create_from_cloudformation_json)),
    ]
