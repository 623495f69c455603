"""Step Functions: moto's interpreter (LocalStack's) made to keep AWS's semantics where the pipeline relies on them."""

from __future__ import annotations

import functools
import json
import threading
import uuid
from typing import Any

from sdflow.local.patching import Patch, replace, wrap
from sdflow.local.runtime import current_clock, runtime_or_none
from sdflow.local.stepfunctions.interpreter import import_interpreter_modules, interpreter_modules_importing

# The nesting depth AWS's JSON parser (Jackson's StreamReadConstraints) accepts by default.
MAX_INPUT_NESTING = 1000


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
    inner: Any,
    self: Any,
    state_machine_arn: str,
    name: str | None = None,
    execution_input: Any = None,
    trace_header: Any = None,
) -> Any:
    """Wraps moto/stepfunctions/parser/models.py StepFunctionsParserBackend.start_execution.

    Without a name moto builds the ARN "<machine>:None" (every unnamed start collides with the
    first); AWS generates a UUID. An input over 256 KiB is refused at the API, as AWS's model
    constraint on `input` does, before the state machine is even looked up."""
    check_execution_input(execution_input)
    return inner(self, state_machine_arn, name or str(uuid.uuid4()), execution_input, trace_header)


def check_execution_input(execution_input: Any) -> None:
    """StartExecution's `input`: "Length Constraints: Maximum length of 262144" bytes in UTF-8
    (API reference); AWS answers ValidationException with this message (as observed on AWS)."""
    from moto.stepfunctions.exceptions import ValidationException

    from sdflow.local.stepfunctions.limits import MAX_PAYLOAD_BYTES

    if isinstance(execution_input, str) and len(execution_input.encode("utf-8")) > MAX_PAYLOAD_BYTES:
        raise ValidationException(
            "1 validation error detected: Value at 'input' failed to satisfy constraint: "
            f"Member must have size less than or equal to {MAX_PAYLOAD_BYTES} bytes in UTF-8 encoding"
        )
    if isinstance(execution_input, str):
        check_execution_json(execution_input)


def check_execution_json(execution_input: str) -> None:
    """API reference, StartExecution errors: InvalidExecutionInput, "The provided JSON input data is
    not valid" (HTTP 400), worded "Invalid State Machine Execution Input: '<parser's reason>'" as AWS
    words it. moto's parser backend raises LocalStack's exception instead, which reaches the client
    as a 400 without an error code. The nesting bound is the one AWS's JSON parser (Jackson,
    StreamReadConstraints) applies by default; AWS documents none, and past Python's recursion
    limit json.loads would fail with a RecursionError rather than a reason."""
    from moto.stepfunctions.exceptions import InvalidExecutionInput

    # Fewer brackets than the bound cannot nest past it: most inputs skip the character scan.
    brackets = execution_input.count("[") + execution_input.count("{")
    depth = json_nesting_depth(execution_input) if brackets > MAX_INPUT_NESTING else 0
    if depth > MAX_INPUT_NESTING:
        raise InvalidExecutionInput(
            f"Invalid State Machine Execution Input: 'Document nesting depth ({depth}) exceeds the maximum "
            f"allowed ({MAX_INPUT_NESTING})'"
        )
    try:
        json.loads(execution_input)
    except ValueError as invalid:
        raise InvalidExecutionInput(f"Invalid State Machine Execution Input: '{invalid}'") from None


def json_nesting_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in `text`, brackets inside strings not counted;
    counted without recursion, so any depth is measured."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


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
    execution.stop_date = current_clock().now()
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


def sfn_boto_client_for(inner: Any, region: str, service: str, state_credentials: Any = None) -> Any:
    """Wraps moto/stepfunctions/parser/asl/utils/boto_client.py boto_client_for.

    The interpreter builds a new boto3 client for every task (~30 ms of CPU each); one client
    per (port, region, service) is reused, which made Lambda tasks ~3x faster in the probes.
    boto3 clients are thread-safe; creating them is not, hence the lock."""
    from moto.core.models import botocore_stubber
    from moto.settings import moto_server_port

    from sdflow.local.services import iam

    # Step Functions calls integrated services as the state machine's role (enforced by services/iam.py).
    as_role = iam.interpreter_client(region, service, state_credentials)
    if as_role is not None:
        return as_role
    if botocore_stubber.enabled or state_credentials:  # in-process mock or assumed role: no caching
        return inner(region, service, state_credentials)
    runtime = runtime_or_none()
    if runtime is None:
        return inner(region, service, state_credentials)
    key = (moto_server_port(), region, service)
    with runtime.sfn_clients_lock:
        client = runtime.sfn_clients.get(key)
        if client is None:
            client = runtime.sfn_clients[key] = inner(region, service)
    return client


@functools.lru_cache(maxsize=4096)
def cached_jsonpath_ext_parse(path: str) -> Any:
    """Replaces `parse` in moto/stepfunctions/parser/asl/utils/json_path.py (jsonpath_ng.ext.parse).

    moto parses every JSONPath again on every evaluation, and jsonpath_ng builds a new ply
    parser each time: in a 300-shard run that was a tenth of the interpreter's CPU. A state
    machine has a few dozen distinct paths; a parsed path is only read by find(), so one
    parsed object per path string is shared by every thread."""
    from jsonpath_ng.ext import parse

    return parse(path)


@functools.lru_cache(maxsize=4096)
def cached_jsonpath_parse(path: str) -> Any:
    """Replaces `parse` in moto/stepfunctions/parser/asl/component/common/path/result_path.py
    (jsonpath_ng.parse), for the same reason as cached_jsonpath_ext_parse."""
    from jsonpath_ng import parse

    return parse(path)


class LiveThreads(list[Any]):
    """Replaces moto/stepfunctions/parser/utils.py TMP_THREADS (the list and every interpreter
    module's copy of it): LocalStack, whose interpreter moto copied, keeps every thread it starts
    there to stop them at its shutdown; moto appends every execution's, Map iteration's and task
    token wait's thread and never removes one. Nothing reads the list, so finished threads
    accumulate: about 2.4 a shard, ~2 KB each with their Event, Condition and locks (24,000 after
    a 10,000-shard run). This list drops the finished ones as it grows."""

    PRUNE_EVERY = 256

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._appended = 0

    def append(self, thread: Any) -> None:
        with self._lock:
            super().append(thread)
            self._appended += 1
            if self._appended % self.PRUNE_EVERY == 0:
                self[:] = [t for t in self if t.is_alive()]


def patches() -> list[Patch]:
    import moto.stepfunctions.parser.asl.component.common.path.result_path as result_path
    import moto.stepfunctions.parser.asl.utils.boto_client as boto_client
    import moto.stepfunctions.parser.asl.utils.json_path as json_path
    import moto.stepfunctions.parser.utils as parser_utils
    from moto.stepfunctions.parser.backend.execution import BaseExecutionWorkerCommunication
    from moto.stepfunctions.parser.models import StepFunctionsParserBackend
    from moto.stepfunctions.responses import StepFunctionResponse

    # Every interpreter module must be imported first, so its `from … import boto_client_for` copy exists.
    import_interpreter_modules()
    threads = LiveThreads()
    return [
        replace(parser_utils, "TMP_THREADS", threads),
        *(
            replace(module, "TMP_THREADS", threads)
            for module in interpreter_modules_importing(parser_utils, "TMP_THREADS")
        ),
        replace(StepFunctionResponse, "send_task_failure", sfn_send_task_failure),
        wrap(StepFunctionsParserBackend, "start_execution", sfn_start_execution),
        replace(BaseExecutionWorkerCommunication, "_reflect_execution_status", sfn_reflect_execution_status),
        wrap(boto_client, "boto_client_for", sfn_boto_client_for),
        replace(json_path, "parse", cached_jsonpath_ext_parse),
        replace(result_path, "parse", cached_jsonpath_parse),
        *(
            wrap(module, "boto_client_for", sfn_boto_client_for)
            for module in interpreter_modules_importing(boto_client, "boto_client_for")
        ),
    ]
