"""Every change the local runtime makes to moto's behaviour, in one place.

moto (pinned: MOTO_VERSION) records most AWS calls faithfully but, by design, runs nothing:
Lambda answers a canned string, EventBridge rules deliver to SQS/logs only, SageMaker jobs are
"Completed" the moment they are created. The local runtime needs the real thing, so each gap
is closed by one small named function below. Each docstring names the moto file and
function it replaces or wraps, and why. tests/unit/test_moto_patches.py holds a test per
patch that fails when the pinned moto behaves differently (so an upgrade forces a review) and
a test that the patch does its job.

`install(runtime)` applies them all (idempotent; `uninstall()` restores moto); the `Runtime`
says where the work goes: a LambdaRunner for functions, a LocalSageMaker for jobs and
endpoints, a work folder for SNS messages."""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import io
import json
import logging
import re
import threading
import time
import uuid
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from sdflow.local.lambda_runner import FunctionSpec, InvocationResult, LambdaRunner

log = logging.getLogger(__name__)

MOTO_VERSION = "5.2.5"
Kind = Literal["processing", "training", "endpoint"]
DEFAULT_ACCOUNT = "123456789012"


class PatchError(RuntimeError):
    """The local runtime cannot do what was asked (e.g. a patch needs a runtime that is missing)."""


class SageMakerRuntime(Protocol):
    """What the patches need from sdflow.local.sagemaker.LocalSageMaker (see its docstring)."""

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
    """Where the patched services send their work."""

    workdir: Path
    lambda_runner: LambdaRunner | None = None
    sagemaker: SageMakerRuntime | None = None
    # Function name -> local code; functions not listed run from their deployed zip.
    code: dict[str, FunctionCode] = field(default_factory=dict)
    # Lambda retries a failed asynchronous invocation twice (after ~1 and ~2 minutes on AWS).
    async_retry_delays_s: tuple[float, ...] = (1.0, 2.0)
    _inflight: int = field(default=0, repr=False)
    _idle: threading.Condition = field(default_factory=threading.Condition, repr=False)

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
    def _async_task(self) -> Iterator[None]:
        with self._idle:
            self._inflight += 1
        try:
            yield
        finally:
            with self._idle:
                self._inflight -= 1
                self._idle.notify_all()


_runtime: Runtime | None = None
_originals: list[tuple[Any, str, Any, Any]] = []  # (owner, attribute, callable original, raw attribute)
_install_lock = threading.Lock()


def current_runtime() -> Runtime:
    if _runtime is None:
        raise PatchError("sdflow.local.patches.install(runtime) has not been called")
    return _runtime


def _iso(value: Any) -> str:
    """An EventBridge timestamp: moto keeps epoch floats, AWS sends ISO-8601 UTC."""
    if isinstance(value, (int, float)):
        value = dt.datetime.fromtimestamp(value, dt.UTC)
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return str(value)


def _epoch_ms(value: Any) -> Any:
    """SageMaker events carry the Describe* response with times as epoch milliseconds."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return int(value.timestamp() * 1000)
    if isinstance(value, dict):
        return {k: _epoch_ms(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_epoch_ms(v) for v in value]
    return value


# =============================================================================== (a) Lambda


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
    )


def _runner(runtime: Runtime) -> LambdaRunner:
    if runtime.lambda_runner is None:
        raise PatchError("the local runtime has no LambdaRunner; LocalCloud creates one")
    return runtime.lambda_runner


def invoke_function_async(fn: Any, payload: bytes) -> None:
    """An "Event" invocation: run in the background, retry like Lambda, then the DLQ."""
    runtime = current_runtime()
    spec = function_spec(runtime, fn)
    request_id = str(uuid.uuid4())

    def run() -> None:
        with runtime._async_task():
            result: InvocationResult | None = None
            for delay in (0.0, *runtime.async_retry_delays_s):
                time.sleep(delay)
                try:
                    result = _runner(runtime).invoke(spec, payload, request_id)
                except Exception:  # the runner itself failed (e.g. shut down): nothing to retry
                    log.exception("asynchronous invocation of %s could not run", spec.name)
                    return
                if result.function_error is None:
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
    return fn


# =============================================================================== (b) EventBridge


def aws_shaped_event(event: Mapping[str, Any]) -> dict[str, Any]:
    """The event as AWS delivers it: ISO-8601 `time`, no moto-only keys, S3's `etag` spelling.

    moto/s3/notifications.py _send_event_bridge_message writes `eTag` (AWS: `etag`) and an epoch
    `time`; moto/events/models.py put_events adds `ingestion-time`."""
    shaped = copy.deepcopy(dict(event))
    shaped.pop("ingestion-time", None)
    if "time" in shaped:
        shaped["time"] = _iso(shaped["time"])
    obj = shaped.get("detail", {}).get("object") if shaped.get("source") == "aws.s3" else None
    if isinstance(obj, dict) and "eTag" in obj:
        obj.setdefault("etag", obj.pop("eTag"))
    return shaped


def render_target_input(target: Mapping[str, Any], event: dict[str, Any]) -> Any:
    """What a rule target receives: its Input, InputPath or InputTransformer applied to the event."""
    if "Input" in target:
        return json.loads(target["Input"])
    if "InputPath" in target:
        return _json_path(target["InputPath"], event)
    transformer = target.get("InputTransformer")
    if not transformer:
        return event
    return apply_input_transformer(transformer.get("InputTemplate", ""), transformer.get("InputPathsMap", {}), event)


def apply_input_transformer(template: str, paths_map: Mapping[str, str], event: dict[str, Any]) -> Any:
    """EventBridge's InputTransformer: <name> outside a JSON string becomes the value as JSON
    (a string is quoted), inside a string its text. moto/events/utils.py
    EventTemplateParser.parse pastes strings unquoted, which yields invalid JSON for
    `{"key": <key>}`, so the transformer is implemented here."""
    values: dict[str, Any] = {name: _json_path(path, event) for name, path in paths_map.items()}
    values.setdefault("aws.events.event.json", event)
    values.setdefault("aws.events.event.ingestion-time", event.get("time"))
    rendered = _fill_template(template, values, quote_bare=True)
    try:
        return json.loads(rendered)
    except ValueError:
        return _fill_template(template, values, quote_bare=False)  # a plain-text template: text


def _fill_template(template: str, values: Mapping[str, Any], *, quote_bare: bool) -> str:
    out: list[str] = []
    in_string = False
    i = 0
    while i < len(template):
        char = template[i]
        if char == "\\" and in_string:
            out.append(template[i : i + 2])
            i += 2
            continue
        if char == '"':
            in_string = not in_string
        elif char == "<":
            match = re.match(r"<([A-Za-z0-9_.\-]+)>", template[i:])
            if match and match.group(1) in values:
                value = values[match.group(1)]
                text = value if isinstance(value, str) else json.dumps(value)
                if in_string:  # inside a JSON string: the text, escaped for that string
                    out.append(json.dumps(text)[1:-1])
                elif quote_bare:  # a bare JSON value: strings get their quotes
                    out.append(json.dumps(value))
                else:  # plain-text template
                    out.append(text)
                i += match.end()
                continue
        out.append(char)
        i += 1
    return "".join(out)


def _json_path(path: str, document: Any) -> Any:
    """A JSONPath of the simple form EventBridge allows in InputPath ($.a.b, $.a[0])."""
    node = document
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path.removeprefix("$")):
        if part.startswith("["):
            node = node[int(part[1:-1])]
        elif isinstance(node, dict):
            node = node.get(part)
        else:
            return None
    return node


def rule_send_to_targets(self: Any, original_event: dict[str, Any], transform_input: bool = True) -> None:
    """Wraps moto/events/models.py Rule.send_to_targets.

    moto delivers to logs / SQS / event buses / archives / API destinations only and raises
    NotImplementedError("Expr not defined for <class Rule>") for Lambda and Step Functions
    targets (inside a bare `except: pass` when the event comes from S3). Here Lambda targets
    get an asynchronous invocation and state machines a StartExecution, each with the
    target's Input / InputPath / InputTransformer applied to the AWS-shaped event; other
    targets go to moto's own code. A DISABLED rule delivers nothing."""
    if getattr(self, "state", "ENABLED") == "DISABLED" or not self.event_pattern.matches_event(original_event):
        return
    event = aws_shaped_event(original_event)
    others = []
    for target in self.targets:
        arn = str(target.get("Arn", ""))
        service = arn.split(":")[2] if arn.count(":") >= 5 else ""
        if service not in ("lambda", "states"):
            others.append(target)
            continue
        try:
            payload = render_target_input(target, event)
            if service == "lambda":
                from moto.awslambda.utils import get_backend as lambda_backend

                _, _, _, region, account, _rest = arn.split(":", 5)
                fn = lambda_backend(account, region).get_function(arn)
                invoke_function_async(fn, json.dumps(payload).encode())
            else:
                from moto.stepfunctions.responses import get_backend as sfn_backend

                _, _, _, region, account, _rest = arn.split(":", 5)
                sfn_backend(account, region).start_execution(
                    arn, name=str(uuid.uuid4()), execution_input=json.dumps(payload)
                )
        except Exception:
            # EventBridge delivery is asynchronous on AWS too: log, never fail the caller.
            log.exception("rule %s could not deliver to %s", self.name, arn)
    if others:
        saved, self.targets = self.targets, others
        try:
            _original(type(self), "send_to_targets")(self, original_event, transform_input)
        finally:
            self.targets = saved


# =============================================================================== (c) CloudFormation


def state_machine_create_from_cloudformation_json(
    cls: Any, resource_name: str, cloudformation_json: dict[str, Any], account_id: str, region_name: str, **kwargs: Any
) -> Any:
    """Replaces moto/stepfunctions/models.py StateMachine.create_from_cloudformation_json.

    moto always creates into the non-executing `stepfunctions_backends`, so with
    execute_state_machine=True the machine is invisible to StartExecution; it also ignores
    DefinitionSubstitutions, the Definition object and DefinitionS3Location. This creates the
    machine in the backend the API uses, with the substituted definition.
    LoggingConfiguration is left out on purpose: moto would write every history event to its
    CloudWatch Logs over HTTP, which costs more than the local runtime's whole orchestration."""
    from moto.stepfunctions.responses import get_backend

    properties = cloudformation_json["Properties"]
    definition = _definition_text(properties, account_id, region_name)
    for key, value in (properties.get("DefinitionSubstitutions") or {}).items():
        definition = definition.replace("${" + key + "}", str(value))
    tags = [{"key": tag["Key"], "value": tag["Value"]} for tag in properties.get("Tags", [])]
    return get_backend(account_id, region_name).create_state_machine(
        properties.get("StateMachineName", resource_name),
        definition,
        properties.get("RoleArn", ""),
        tags=tags,
        sm_type=properties.get("StateMachineType"),
    )


def _definition_text(properties: Mapping[str, Any], account_id: str, region_name: str) -> str:
    if "DefinitionString" in properties:
        return str(properties["DefinitionString"])
    if "Definition" in properties:
        return json.dumps(properties["Definition"])
    location = properties.get("DefinitionS3Location")
    if location:
        from moto.s3.models import s3_backends
        from moto.utilities.utils import get_partition

        backend = s3_backends[account_id][get_partition(region_name)]
        key = backend.get_object(location["Bucket"], location["Key"], location.get("Version"))
        if key is None:
            raise PatchError(f"DefinitionS3Location s3://{location['Bucket']}/{location['Key']} does not exist")
        return key.value.decode()
    raise PatchError("AWS::StepFunctions::StateMachine needs DefinitionString, Definition or DefinitionS3Location")


def bucket_create_from_cloudformation_json(
    cls: Any, resource_name: str, cloudformation_json: dict[str, Any], account_id: str, region_name: str, **kwargs: Any
) -> Any:
    """Wraps moto/s3/models.py FakeBucket.create_from_cloudformation_json.

    moto honours BucketEncryption and Tags only. The template's
    NotificationConfiguration.EventBridgeConfiguration (manifest uploads start runs) and
    VersioningConfiguration (a run is named after the manifest's version) matter here."""
    from moto.s3.models import s3_backends
    from moto.utilities.utils import get_partition

    bucket = _original(cls, "create_from_cloudformation_json")(
        resource_name, cloudformation_json, account_id, region_name, **kwargs
    )
    properties = cloudformation_json.get("Properties", {})
    backend = s3_backends[account_id][get_partition(region_name)]
    notification = properties.get("NotificationConfiguration") or {}
    if notification.get("EventBridgeConfiguration", {}).get("EventBridgeEnabled", True) and (
        "EventBridgeConfiguration" in notification
    ):
        backend.put_bucket_notification_configuration(bucket.name, {"EventBridgeConfiguration": {}})
    versioning = (properties.get("VersioningConfiguration") or {}).get("Status")
    if versioning:
        backend.put_bucket_versioning(bucket.name, versioning)
    return bucket


def ecr_repository_create_from_cloudformation_json(
    cls: Any, resource_name: str, cloudformation_json: dict[str, Any], account_id: str, region_name: str, **kwargs: Any
) -> Any:
    """Wraps moto/ecr/models.py Repository.create_from_cloudformation_json.

    The generated name (<stack>-<LogicalId>-<suffix>) keeps upper-case letters, which moto's
    own repository-name check then rejects; CloudFormation generates lower-case names."""
    return _original(cls, "create_from_cloudformation_json")(
        resource_name.lower(), cloudformation_json, account_id, region_name, **kwargs
    )


class _CfnResource:
    """A resource moto's CloudFormation does not model, created with the service's own backend."""

    def __init__(self, physical_id: str) -> None:
        self.physical_resource_id = physical_id

    @classmethod
    def has_cfn_attr(cls, attr: str) -> bool:
        return False

    def is_created(self) -> bool:
        return True

    @classmethod
    def delete_from_cloudformation_json(cls, *args: Any, **kwargs: Any) -> None:
        return None


class CfnBucketPolicy(_CfnResource):
    """AWS::S3::BucketPolicy: recorded, not enforced.

    moto has no CloudFormation model for it. Its put_bucket_policy enforces Principal "*"
    statements and ignores their Conditions, so the template's DenyInsecureTransport
    (Deny s3:* unless aws:SecureTransport) would deny every call to a local cloud that speaks
    HTTP. The policy is therefore only logged."""

    @classmethod
    def create_from_cloudformation_json(
        cls, resource_name: str, cloudformation_json: dict[str, Any], account_id: str, region_name: str, **kw: Any
    ) -> CfnBucketPolicy:
        bucket = cloudformation_json["Properties"].get("Bucket")
        log.info("bucket policy of %s not applied locally (moto would enforce it without its conditions)", bucket)
        return cls(resource_name)


class CfnQueuePolicy(_CfnResource):
    """AWS::SQS::QueuePolicy: moto has no CloudFormation model; set each queue's Policy attribute."""

    @classmethod
    def create_from_cloudformation_json(
        cls, resource_name: str, cloudformation_json: dict[str, Any], account_id: str, region_name: str, **kw: Any
    ) -> CfnQueuePolicy:
        from moto.sqs.models import sqs_backends

        properties = cloudformation_json["Properties"]
        backend = sqs_backends[account_id][region_name]
        for queue_url in properties.get("Queues", []):
            backend.set_queue_attributes(
                str(queue_url).rstrip("/").rsplit("/", 1)[-1], {"Policy": json.dumps(properties["PolicyDocument"])}
            )
        return cls(resource_name)


class CfnSchedule(_CfnResource):
    """AWS::Scheduler::Schedule: moto has no CloudFormation model; create it in moto's Scheduler.

    The schedule is listed and described like on AWS; moto does not fire schedules (the local
    cloud's `fire_schedules` does, on demand)."""

    @classmethod
    def create_from_cloudformation_json(
        cls, resource_name: str, cloudformation_json: dict[str, Any], account_id: str, region_name: str, **kw: Any
    ) -> CfnSchedule:
        from moto.scheduler.models import scheduler_backends

        p = cloudformation_json["Properties"]
        schedule = scheduler_backends[account_id][region_name].create_schedule(
            description=p.get("Description", ""),
            end_date=p.get("EndDate"),
            flexible_time_window=p.get("FlexibleTimeWindow", {"Mode": "OFF"}),
            group_name=p.get("GroupName"),
            kms_key_arn=p.get("KmsKeyArn"),
            name=p.get("Name", resource_name),
            schedule_expression=p["ScheduleExpression"],
            schedule_expression_timezone=p.get("ScheduleExpressionTimezone"),
            start_date=p.get("StartDate"),
            state=p.get("State", "ENABLED"),
            target=p["Target"],
            action_after_completion=p.get("ActionAfterCompletion"),
        )
        return cls(schedule.arn)


EXTRA_CFN_MODELS: dict[str, type[_CfnResource]] = {
    "AWS::S3::BucketPolicy": CfnBucketPolicy,
    "AWS::SQS::QueuePolicy": CfnQueuePolicy,
    "AWS::Scheduler::Schedule": CfnSchedule,
}


def cfn_resource_class_from_type(resource_type: str) -> Any:
    """Wraps moto/cloudformation/parsing.py resource_class_from_type: adds EXTRA_CFN_MODELS.

    moto skips resource types it does not model (with a warning) and the stack still
    completes; the types above are ones the template uses whose effect the local runtime needs
    or that a user may list (schedules)."""
    extra = EXTRA_CFN_MODELS.get(resource_type)
    if extra is not None:
        return extra
    import moto.cloudformation.parsing as parsing

    return _original(parsing, "resource_class_from_type")(resource_type)


# =============================================================================== (d) Step Functions


def sfn_send_task_failure(self: Any) -> Any:
    """Replaces moto/stepfunctions/responses.py StepFunctionResponse.send_task_failure.

    moto reads `error` only and drops `cause`, so the failure notification would lose the
    SageMaker FailureReason job_events puts there."""
    from moto.core.responses import EmptyResult

    self.stepfunction_backend.send_task_failure(
        self._get_param("taskToken"), error=self._get_param("error"), cause=self._get_param("cause")
    )
    return EmptyResult()


def sfn_start_execution(
    self: Any, state_machine_arn: str, name: str | None = None, execution_input: Any = None, trace_header: Any = None
) -> Any:
    """Wraps moto/stepfunctions/parser/models.py StepFunctionsParserBackend.start_execution.

    Without a name moto builds the ARN "<machine>:None" (every unnamed start collides with the
    first); AWS generates a UUID."""
    return _original(type(self), "start_execution")(
        self, state_machine_arn, name or str(uuid.uuid4()), execution_input, trace_header
    )


def sfn_reflect_execution_status(self: Any) -> None:
    """Replaces moto/stepfunctions/parser/backend/execution.py
    BaseExecutionWorkerCommunication._reflect_execution_status.

    moto sets the status first and the output / error / cause after it, so a client polling
    DescribeExecution can see SUCCEEDED without output (or FAILED without error). Here the
    results are set first and the status last."""
    from moto.stepfunctions.parser.api import ExecutionStatus
    from moto.stepfunctions.parser.asl.eval.program_state import (
        ProgramEnded,
        ProgramError,
        ProgramStopped,
        ProgramTimedOut,
    )

    execution = self.execution
    state = execution.exec_worker.env.program_state()
    execution.stop_date = dt.datetime.now(tz=dt.UTC)
    if isinstance(state, ProgramEnded):
        execution.output = execution.exec_worker.env.states.get_input()
        execution.exec_status = ExecutionStatus.SUCCEEDED
    elif isinstance(state, ProgramStopped):
        execution.exec_status = ExecutionStatus.ABORTED
    elif isinstance(state, ProgramError):
        details = state.error or {}
        execution.error = details.get("error")
        execution.cause = details.get("cause")
        execution.exec_status = ExecutionStatus.FAILED
    elif isinstance(state, ProgramTimedOut):
        execution.exec_status = ExecutionStatus.TIMED_OUT
    else:
        raise RuntimeWarning(f"Execution ended with unsupported ProgramState type '{type(state)}'.")


# =============================================================================== (g) SFN client cache

_client_cache: dict[tuple[str, str, str], Any] = {}
_client_cache_lock = threading.Lock()


def sfn_boto_client_for(region: str, service: str, state_credentials: Any = None) -> Any:
    """Wraps moto/stepfunctions/parser/asl/utils/boto_client.py boto_client_for.

    The interpreter builds a new boto3 client for every task (~30 ms of CPU each); one client
    per (port, region, service) is reused, which made Lambda tasks ~3x faster in the probes.
    boto3 clients are thread-safe; creating them is not, hence the lock."""
    import moto.stepfunctions.parser.asl.utils.boto_client as boto_client
    from moto.core.models import botocore_stubber
    from moto.settings import moto_server_port

    if botocore_stubber.enabled or state_credentials:  # in-process mock or assumed role: no caching
        return _original(boto_client, "boto_client_for")(region, service, state_credentials)
    key = (moto_server_port(), region, service)
    with _client_cache_lock:
        client = _client_cache.get(key)
        if client is None:
            client = _client_cache[key] = _original(boto_client, "boto_client_for")(region, service)
    return client


def _import_interpreter_modules() -> None:
    import importlib
    import pkgutil

    import moto.stepfunctions.parser.asl as asl

    for module in pkgutil.walk_packages(asl.__path__, asl.__name__ + "."):
        with contextlib.suppress(Exception):
            importlib.import_module(module.name)


def _modules_importing_boto_client_for() -> list[Any]:
    """Every interpreter module that did `from ...boto_client import boto_client_for`."""
    import sys

    import moto.stepfunctions.parser.asl.utils.boto_client as boto_client

    original = _original(boto_client, "boto_client_for")
    return [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("moto.stepfunctions.parser") and getattr(module, "boto_client_for", None) is original
    ]


# =============================================================================== (e) SageMaker

_sagemaker_where: dict[tuple[Kind, str], tuple[str, str]] = {}
_recorded_requests: dict[tuple[str, str, str], dict[str, Any]] = {}  # (account, "model"/"config", name) -> request


def _request(response: Any) -> dict[str, Any]:
    """The request exactly as the caller sent it (PascalCase, as boto3 passed it)."""
    return dict(json.loads(response.body or "{}"))


def _sagemaker(runtime: Runtime) -> SageMakerRuntime | None:
    return runtime.sagemaker


def sagemaker_create_processing_job(self: Any) -> Any:
    """Wraps moto/sagemaker/responses.py SageMakerResponse.create_processing_job.

    moto records the job as Completed at once and runs nothing. Here a duplicate name is
    refused as on AWS (ResourceInUse), the job is recorded InProgress and handed to
    LocalSageMaker.run_processing_job; its status changes come back through
    SageMakerStatusPublisher."""
    request = _request(self)
    name = request.get("ProcessingJobName", "")
    backend = self.sagemaker_backend
    if name in backend.processing_jobs:
        from moto.sagemaker.exceptions import ResourceInUseException

        raise ResourceInUseException(
            f"Job name must be unique within an AWS account and region, and a job with this name already "
            f"exists ({backend.processing_jobs[name].arn})"
        )
    result = _original(type(self), "create_processing_job")(self)
    sagemaker = _sagemaker(current_runtime())
    if sagemaker is not None:
        job = backend.processing_jobs[name]
        job.processing_job_status = "InProgress"
        job.processing_end_time = None
        _sagemaker_where[("processing", name)] = (self.current_account, self.region)
        sagemaker.run_processing_job(request)
    return result


def sagemaker_create_training_job(self: Any) -> Any:
    """Wraps moto/sagemaker/responses.py SageMakerResponse.create_training_job.

    As create_processing_job: ResourceInUse for a duplicate name, InProgress / Starting with no
    artifacts, end time or metrics until LocalSageMaker reports them, then
    LocalSageMaker.run_training_job."""
    request = _request(self)
    name = request.get("TrainingJobName", "")
    backend = self.sagemaker_backend
    if name in backend.training_jobs:
        from moto.sagemaker.exceptions import ResourceInUseException

        raise ResourceInUseException(
            f"Training job names must be unique within an AWS account and region, and a training job with this "
            f"name already exists ({backend.training_jobs[name].arn})"
        )
    result = _original(type(self), "create_training_job")(self)
    sagemaker = _sagemaker(current_runtime())
    if sagemaker is not None:
        job = backend.training_jobs[name]
        job.training_job_status = "InProgress"
        job.secondary_status = "Starting"
        job.training_end_time = None
        job.training_start_time = None
        job.model_artifacts = None
        job.final_metric_data_list = None
        job.secondary_status_transitions = []
        if "MetricDefinitions" in (request.get("AlgorithmSpecification") or {}):
            # moto overwrites the caller's MetricDefinitions with its own sample.
            job.algorithm_specification["MetricDefinitions"] = request["AlgorithmSpecification"]["MetricDefinitions"]
        _sagemaker_where[("training", name)] = (self.current_account, self.region)
        sagemaker.run_training_job(request)
    return result


def sagemaker_stop_processing_job(self: Any) -> Any:
    """Wraps moto/sagemaker/responses.py SageMakerResponse.stop_processing_job.

    moto flips the status to Stopped; here the job goes Stopping and LocalSageMaker stops its
    processes (the final Stopped comes from the listener)."""
    from moto.core.responses import EmptyResult

    name = self._get_param("ProcessingJobName")
    job = _job_or_error(self.sagemaker_backend.processing_jobs, name, "processing job", self)
    sagemaker = _sagemaker(current_runtime())
    if sagemaker is None:
        return _original(type(self), "stop_processing_job")(self)
    _refuse_unless_in_progress(job.processing_job_status, name)
    job.processing_job_status = "Stopping"
    sagemaker.stop_job("processing", name)
    return EmptyResult()


def sagemaker_stop_training_job(self: Any) -> Any:
    """Adds SageMakerResponse.stop_training_job (moto 5.2.5 has none: NotImplemented)."""
    from moto.core.responses import EmptyResult

    name = self._get_param("TrainingJobName")
    job = _job_or_error(self.sagemaker_backend.training_jobs, name, "training job", self)
    _refuse_unless_in_progress(job.training_job_status, name)
    job.training_job_status = "Stopping"
    job.secondary_status = "Stopping"
    sagemaker = _sagemaker(current_runtime())
    if sagemaker is not None:
        sagemaker.stop_job("training", name)
    else:
        job.training_job_status = job.secondary_status = "Stopped"
    return EmptyResult()


def _job_or_error(jobs: Mapping[str, Any], name: str, what: str, response: Any) -> Any:
    from moto.sagemaker.exceptions import ValidationError

    if name not in jobs:
        kind = what.replace(" ", "-")
        arn = f"arn:aws:sagemaker:{response.region}:{response.current_account}:{kind}/{name}"
        raise ValidationError(message=f"Could not find {what} '{arn}'.")
    return jobs[name]


def _refuse_unless_in_progress(status: str, name: str) -> None:
    from moto.sagemaker.exceptions import ValidationError

    if status != "InProgress":
        raise ValidationError(message=f"The job {name} is not in progress (status {status}); it cannot be stopped.")


def sagemaker_create_model(self: Any) -> Any:
    """Wraps SageMakerResponse.create_model to keep the request (LocalSageMaker.deploy_endpoint needs it)."""
    request = _request(self)
    result = _original(type(self), "create_model")(self)
    _recorded_requests[(self.current_account, "model", request.get("ModelName", ""))] = request
    return result


def sagemaker_create_endpoint_config(self: Any) -> Any:
    """Wraps SageMakerResponse.create_endpoint_config to keep the request (for deploy_endpoint)."""
    request = _request(self)
    result = _original(type(self), "create_endpoint_config")(self)
    _recorded_requests[(self.current_account, "config", request.get("EndpointConfigName", ""))] = request
    return result


def _endpoint_deployment(response: Any, config_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(CreateEndpointConfig request, CreateModel request of its first variant)."""
    from moto.sagemaker.exceptions import ValidationError

    account, backend = response.current_account, response.sagemaker_backend
    config = _recorded_requests.get((account, "config", config_name))
    if config is None:
        if config_name not in backend.endpoint_configs:
            arn = f"arn:aws:sagemaker:{response.region}:{account}:endpoint-config/{config_name}"
            raise ValidationError(message=f"Could not find endpoint configuration '{arn}'.")
        config = _strip_describe(backend.describe_endpoint_config(config_name))
    variants = config.get("ProductionVariants") or []
    model_name = variants[0].get("ModelName", "") if variants else ""
    model = _recorded_requests.get((account, "model", model_name))
    if model is None:
        if model_name not in backend._models:
            raise ValidationError(message=f'Could not find model "{model_name}".')
        model = _strip_describe(backend.describe_model(model_name))
    return config, model


def _strip_describe(described: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in described.items() if not k.endswith(("Arn", "Time"))}


def sagemaker_create_endpoint(self: Any) -> Any:
    """Wraps moto/sagemaker/responses.py SageMakerResponse.create_endpoint.

    moto creates the endpoint InService at once; here it is Creating and LocalSageMaker starts
    a serving process for the config's model (InService / Failed come from the listener)."""
    from moto.sagemaker.exceptions import ResourceInUseException

    name = self._get_param("EndpointName")
    if name in self.sagemaker_backend.endpoints:
        arn = self.sagemaker_backend.endpoints[name].arn
        raise ResourceInUseException(f'Cannot create already existing endpoint "{arn}".')
    config, model = _endpoint_deployment(self, self._get_param("EndpointConfigName"))
    result = _original(type(self), "create_endpoint")(self)
    sagemaker = _sagemaker(current_runtime())
    if sagemaker is not None:
        endpoint = self.sagemaker_backend.endpoints[name]
        endpoint.endpoint_status = "Creating"
        _sagemaker_where[("endpoint", name)] = (self.current_account, self.region)
        sagemaker.deploy_endpoint(name, config, model)
    return result


def sagemaker_update_endpoint(self: Any) -> Any:
    """Adds SageMakerResponse.update_endpoint (moto 5.2.5 has none).

    As on AWS: only an InService (or Failed) endpoint can be updated; it goes Updating and keeps
    serving its current config until LocalSageMaker reports InService with the new
    EndpointConfigName (or rolls back)."""
    from moto.core.responses import ActionResult
    from moto.sagemaker.exceptions import ValidationError

    name = self._get_param("EndpointName")
    config_name = self._get_param("EndpointConfigName")
    endpoint = self.sagemaker_backend.endpoints.get(name)
    if endpoint is None:
        arn = f"arn:aws:sagemaker:{self.region}:{self.current_account}:endpoint/{name}"
        raise ValidationError(message=f"Could not find endpoint '{arn}'.")
    if endpoint.endpoint_status not in ("InService", "Failed"):
        raise ValidationError(message=f"Cannot update in-progress endpoint '{endpoint.arn}'.")
    config, model = _endpoint_deployment(self, config_name)
    endpoint.endpoint_status = "Updating"
    endpoint.last_modified_time = dt.datetime.now(dt.UTC)
    sagemaker = _sagemaker(current_runtime())
    _sagemaker_where[("endpoint", name)] = (self.current_account, self.region)
    if sagemaker is not None:
        sagemaker.deploy_endpoint(name, config, model)
    else:
        endpoint.endpoint_config_name = config_name
        endpoint.endpoint_status = "InService"
    return ActionResult({"EndpointArn": endpoint.arn})


def sagemaker_runtime_invoke_endpoint(self: Any) -> Any:
    """Wraps moto/sagemakerruntime/responses.py SageMakerRuntimeResponse.invoke_endpoint.

    moto answers placeholders; here the request goes to the endpoint's local serving process.
    A missing endpoint is a ValidationError as on AWS; a failing model a ModelError (424)."""
    sagemaker = _sagemaker(current_runtime())
    if sagemaker is None:
        return _original(type(self), "invoke_endpoint")(self)
    from urllib.parse import unquote

    from moto.sagemaker.models import sagemaker_backends

    match = re.search(r"/endpoints/([^/]+)/invocations", self.path)
    name = unquote(match.group(1)) if match else ""
    endpoint = sagemaker_backends[self.current_account][self.region].endpoints.get(name)
    if endpoint is None or endpoint.endpoint_status not in ("InService", "Updating"):
        status = "not found" if endpoint is None else f"not in service ({endpoint.endpoint_status})"
        body = {"__type": "ValidationError", "message": f"Endpoint {name} of account {self.current_account} {status}."}
        return 400, {"Content-Type": "application/json"}, json.dumps(body)
    content_type = self.headers.get("Content-Type") or "application/json"
    accept = self.headers.get("Accept") or "*/*"
    body_bytes = self.body if isinstance(self.body, bytes) else (self.body or "").encode()
    try:
        answer, answer_type = sagemaker.invoke_endpoint(name, body_bytes, content_type, accept)
    except Exception as exc:
        body = {"__type": "ModelError", "message": f"Received server error from model: {exc}"}
        return 424, {"Content-Type": "application/json"}, json.dumps(body)
    return 200, {"Content-Type": answer_type, "x-Amzn-Invoked-Production-Variant": "AllTraffic"}, answer


ENDPOINT_EVENT_STATUS = {
    "OutOfService": "OUT_OF_SERVICE",
    "Creating": "CREATING",
    "Updating": "UPDATING",
    "SystemUpdating": "SYSTEM_UPDATING",
    "RollingBack": "ROLLING_BACK",
    "InService": "IN_SERVICE",
    "Deleting": "DELETING",
    "Failed": "FAILED",
    "UpdateRollbackFailed": "UPDATE_ROLLBACK_FAILED",
}
DETAIL_TYPES: dict[Kind, str] = {
    "processing": "SageMaker Processing Job State Change",
    "training": "SageMaker Training Job State Change",
    "endpoint": "SageMaker Endpoint State Change",
}


class SageMakerStatusPublisher:
    """The StatusListener LocalSageMaker reports to: updates moto's job / endpoint objects (so
    Describe* answers the real status, failure reason, artifacts, metrics, config) and puts the
    AWS-shaped "SageMaker … State Change" event on the default bus, where the template's rules
    deliver it to job_events."""

    def __init__(self, account_id: str = DEFAULT_ACCOUNT, region: str = "us-east-1") -> None:
        self.account_id = account_id
        self.region = region
        self.lock = threading.Lock()
        self.published: list[dict[str, Any]] = []  # the events sent, for diagnostics and tests

    def job_status_changed(self, kind: Kind, name: str, status: str, fields: dict[str, Any]) -> None:
        from moto.sagemaker.models import sagemaker_backends

        account, region = _sagemaker_where.get((kind, name), (self.account_id, self.region))
        backend = sagemaker_backends[account][region]
        with self.lock:
            if kind == "processing":
                detail = self._update_processing(backend, name, status, fields)
            elif kind == "training":
                detail = self._update_training(backend, name, status, fields)
            elif kind == "endpoint":
                detail = self._update_endpoint(backend, name, status, fields)
            else:
                raise PatchError(f"unknown SageMaker resource kind {kind!r}")
            if detail is None:
                log.warning("status %s for unknown SageMaker %s %s ignored", status, kind, name)
                return
            event = {
                "Source": "aws.sagemaker",
                "DetailType": DETAIL_TYPES[kind],
                "Detail": json.dumps(_epoch_ms(detail), default=str),
                "Resources": [detail.get("ProcessingJobArn") or detail.get("TrainingJobArn") or detail["EndpointArn"]],
            }
            self.published.append(event)
        from moto.events.models import events_backends

        events_backends[account][region].put_events([event])

    @staticmethod
    def _update_processing(backend: Any, name: str, status: str, fields: Mapping[str, Any]) -> dict[str, Any] | None:
        job = backend.processing_jobs.get(name)
        if job is None:
            return None
        job.processing_job_status = status
        for key, attribute in (
            ("FailureReason", "failure_reason"),
            ("ExitMessage", "exit_message"),
            ("ProcessingStartTime", "processing_start_time"),
            ("ProcessingEndTime", "processing_end_time"),
        ):
            if key in fields:
                setattr(job, attribute, fields[key])
        job.last_modified_time = dt.datetime.now(dt.UTC)
        return dict(backend.describe_processing_job(name))

    @staticmethod
    def _update_training(backend: Any, name: str, status: str, fields: Mapping[str, Any]) -> dict[str, Any] | None:
        job = backend.training_jobs.get(name)
        if job is None:
            return None
        now = dt.datetime.now(dt.UTC)
        job.training_job_status = status
        secondary = fields.get("SecondaryStatus") or {"InProgress": "Training"}.get(status, status)
        if secondary != job.secondary_status:
            for transition in job.secondary_status_transitions:
                transition.setdefault("EndTime", now)
            job.secondary_status_transitions.append({"Status": secondary, "StartTime": now})
        job.secondary_status = secondary
        for key, attribute in (
            ("FailureReason", "failure_reason"),
            ("ModelArtifacts", "model_artifacts"),
            ("FinalMetricDataList", "final_metric_data_list"),
            ("TrainingStartTime", "training_start_time"),
            ("TrainingEndTime", "training_end_time"),
            ("BillableTimeInSeconds", "billable_time_in_seconds"),
        ):
            if key in fields:
                setattr(job, attribute, fields[key])
        job.last_modified_time = now
        return dict(backend.describe_training_job(name))

    @staticmethod
    def _update_endpoint(backend: Any, name: str, status: str, fields: Mapping[str, Any]) -> dict[str, Any] | None:
        endpoint = backend.endpoints.get(name)
        if endpoint is None:
            return None
        endpoint.endpoint_status = status
        if fields.get("EndpointConfigName"):
            endpoint.endpoint_config_name = fields["EndpointConfigName"]
        # Failed says why; InService after a rolled-back update says why too; otherwise none.
        endpoint.failure_reason = fields.get("FailureReason")
        endpoint.last_modified_time = dt.datetime.now(dt.UTC)
        detail = dict(backend.describe_endpoint(name))
        detail["EndpointStatus"] = ENDPOINT_EVENT_STATUS.get(status, status.upper())
        return detail


# =============================================================================== (f) SNS

_sns_lock = threading.Lock()


def sns_topic_publish(
    self: Any,
    message: str,
    subject: str | None = None,
    message_attributes: dict[str, Any] | None = None,
    group_id: str | None = None,
    deduplication_id: str | None = None,
    message_structure: str | None = None,
) -> str:
    """Wraps moto/sns/models.py Topic.publish (every publish path: API, Step Functions, S3).

    moto keeps messages in memory only for subscriptions; locally there is nobody to e-mail, so
    each message is also appended to <workdir>/sns/<topic name>.jsonl, where the CLI and the
    user read it."""
    message_id = _original(type(self), "publish")(
        self, message, subject, message_attributes, group_id, deduplication_id, message_structure
    )
    runtime = _runtime
    if runtime is not None:
        record = {
            "message_id": message_id,
            "topic_arn": self.arn,
            "subject": subject,
            "message": message,
            "attributes": {
                key: value.get("Value", value.get("StringValue")) if isinstance(value, dict) else value
                for key, value in (message_attributes or {}).items()
            },
            "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
        }
        with _sns_lock:
            runtime.sns_dir.mkdir(parents=True, exist_ok=True)
            with open(runtime.sns_dir / f"{self.name}.jsonl", "a", encoding="utf-8") as out:
                out.write(json.dumps(record) + "\n")
    return str(message_id)


def read_sns_messages(workdir: Path, topic_name: str | None = None) -> list[dict[str, Any]]:
    """The messages published so far (one topic, or all), oldest first."""
    folder = Path(workdir) / "sns"
    files = [folder / f"{topic_name}.jsonl"] if topic_name else sorted(folder.glob("*.jsonl"))
    messages: list[dict[str, Any]] = []
    for path in files:
        if path.exists():
            messages += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return sorted(messages, key=lambda m: m["timestamp"])


# =============================================================================== install


def _original(owner: Any, attribute: str) -> Any:
    """moto's own implementation of a patched attribute (the attribute itself when unpatched)."""
    for klass in (owner, *getattr(owner, "__mro__", ())[1:]):  # a subclass reaches its parent's patch
        for patched_owner, name, original, _raw in _originals:
            if patched_owner is klass and name == attribute:
                return original
    return getattr(owner, attribute)


_MISSING = object()


def _patch(owner: Any, attribute: str, new: Any) -> None:
    # Keep both the callable original (classmethods bound) and the raw attribute to restore.
    raw = vars(owner).get(attribute, _MISSING) if isinstance(owner, type) else getattr(owner, attribute, _MISSING)
    _originals.append((owner, attribute, getattr(owner, attribute, None), raw))
    setattr(owner, attribute, new)


def _patch_list() -> list[tuple[Any, str, Any]]:
    import moto.cloudformation.parsing as cfn_parsing
    import moto.stepfunctions.parser.asl.utils.boto_client as boto_client
    from moto.awslambda.models import LambdaFunction
    from moto.awslambda_simple.models import LambdaSimpleBackend
    from moto.ecr.models import Repository
    from moto.events.models import Rule
    from moto.s3.models import FakeBucket
    from moto.sagemaker.responses import SageMakerResponse
    from moto.sagemakerruntime.responses import SageMakerRuntimeResponse
    from moto.sns.models import Topic
    from moto.stepfunctions.models import StateMachine
    from moto.stepfunctions.parser.backend.execution import BaseExecutionWorkerCommunication
    from moto.stepfunctions.parser.models import StepFunctionsParserBackend
    from moto.stepfunctions.responses import StepFunctionResponse

    patches: list[tuple[Any, str, Any]] = [
        (LambdaSimpleBackend, "invoke", lambda_invoke),
        (LambdaFunction, "create_from_cloudformation_json", classmethod(lambda_create_from_cloudformation_json)),
        (Rule, "send_to_targets", rule_send_to_targets),
        (StateMachine, "create_from_cloudformation_json", classmethod(state_machine_create_from_cloudformation_json)),
        (FakeBucket, "create_from_cloudformation_json", classmethod(bucket_create_from_cloudformation_json)),
        (Repository, "create_from_cloudformation_json", classmethod(ecr_repository_create_from_cloudformation_json)),
        (cfn_parsing, "resource_class_from_type", cfn_resource_class_from_type),
        (StepFunctionResponse, "send_task_failure", sfn_send_task_failure),
        (StepFunctionsParserBackend, "start_execution", sfn_start_execution),
        (BaseExecutionWorkerCommunication, "_reflect_execution_status", sfn_reflect_execution_status),
        (SageMakerResponse, "create_processing_job", sagemaker_create_processing_job),
        (SageMakerResponse, "create_training_job", sagemaker_create_training_job),
        (SageMakerResponse, "stop_processing_job", sagemaker_stop_processing_job),
        (SageMakerResponse, "stop_training_job", sagemaker_stop_training_job),
        (SageMakerResponse, "create_model", sagemaker_create_model),
        (SageMakerResponse, "create_endpoint_config", sagemaker_create_endpoint_config),
        (SageMakerResponse, "create_endpoint", sagemaker_create_endpoint),
        (SageMakerResponse, "update_endpoint", sagemaker_update_endpoint),
        (SageMakerRuntimeResponse, "invoke_endpoint", sagemaker_runtime_invoke_endpoint),
        (Topic, "publish", sns_topic_publish),
    ]
    patches.append((boto_client, "boto_client_for", sfn_boto_client_for))
    return patches


def install(runtime: Runtime) -> None:
    """Apply every patch (once) and send work to `runtime` (replacing any earlier runtime)."""
    global _runtime
    with _install_lock:
        _runtime = runtime
        if _originals:
            return
        # Import every interpreter module first, so their `from … import boto_client_for` copies exist.
        _import_interpreter_modules()
        for owner, attribute, new in _patch_list():
            _patch(owner, attribute, new)
        import moto.stepfunctions.parser.asl.utils.boto_client as boto_client

        for module in _modules_importing_boto_client_for():
            if module is not boto_client:
                _patch(module, "boto_client_for", sfn_boto_client_for)


def uninstall() -> None:
    """Restore moto's own behaviour (tests; a process that stops its local cloud)."""
    global _runtime
    with _install_lock:
        while _originals:
            owner, attribute, _original_callable, raw = _originals.pop()
            if raw is _MISSING:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, raw)
        _runtime = None
        _client_cache.clear()
        _sagemaker_where.clear()
        _recorded_requests.clear()


def installed() -> bool:
    return bool(_originals)


@contextlib.contextmanager
def patched(runtime: Runtime) -> Iterator[Runtime]:
    """install(runtime) for the duration of a block (tests)."""
    install(runtime)
    try:
        yield runtime
    finally:
        uninstall()
