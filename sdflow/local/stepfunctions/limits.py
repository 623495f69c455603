"""Step Functions: AWS's payload limit and terminal errors in moto's interpreter.

AWS's rules (https://docs.aws.amazon.com/step-functions/latest/dg/service-quotas.html and
https://docs.aws.amazon.com/step-functions/latest/dg/concepts-error-handling.html):
- "Maximum input or output size for a task, state, or execution: 256 KiB of data as a UTF-8
  encoded string" (the API reference's "Maximum length of 262144" bytes). It applies to input
  data when scheduling a task, entering a state or starting an execution, and to every output.
- States.DataLimitExceeded is reported when a connector's output, a state's output, or a
  state's input after Parameters processing is larger than that quota; cause as AWS words it:
  "The state/task '<name>' returned a result with a size exceeding the maximum number of bytes
  service limit."
- "The States.ALL error type ... can't catch the States.DataLimitExceeded terminal error or
  Runtime error types." (nor retry them: they are terminal).

moto 5.2.5 measures with `json.dumps`'s default separators and ASCII escapes (a larger size
than AWS's compact UTF-8), checks state output and task results but neither a state's input,
a task's Parameters nor a Map's collected results, and lets States.ALL catch both terminal
errors. The state-transition counter (Runtime.sfn_transitions) lives here too, because it
hooks the same state-entry path."""

from __future__ import annotations

import json
from typing import Any

from sdflow.local.patching import Patch, replace, wrap
from sdflow.local.runtime import runtime_or_none
from sdflow.local.stepfunctions.interpreter import interpreter_modules_importing, states_failure

MAX_PAYLOAD_BYTES = 262_144
DATA_LIMIT_EXCEEDED = "States.DataLimitExceeded"
# Terminal: States.ALL in a Retrier or Catcher does not match them (named explicitly, they do).
TERMINAL_ERRORS = frozenset({DATA_LIMIT_EXCEEDED, "States.Runtime"})


def _utf8_exceeds(text: str) -> bool:
    """True when `text` is more than MAX_PAYLOAD_BYTES in UTF-8 (encodes only near the limit)."""
    if len(text) > MAX_PAYLOAD_BYTES:  # every character is at least one byte
        return True
    if len(text) * 4 <= MAX_PAYLOAD_BYTES:  # every character is at most four bytes
        return False
    return len(text.encode("utf-8")) > MAX_PAYLOAD_BYTES


def payload_text(value: Any) -> str:
    """The JSON text AWS measures: compact, non-ASCII characters left as UTF-8."""
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)


def sfn_is_within_size_quota(value: Any) -> bool:
    """Replaces moto/stepfunctions/parser/quotas.py is_within_size_quota (and its imported copies).

    moto serialises with ", " / ": " and \\uXXXX escapes and refuses exactly 262,144 bytes; AWS
    measures the compact UTF-8 text and allows up to 262,144 bytes."""
    return not _utf8_exceeds(payload_text(value))


def data_limit_exceeded(env: Any, name: str) -> Exception:
    """The FailureEventException AWS's States.DataLimitExceeded becomes in moto's interpreter."""
    from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name_type import (
        StatesErrorNameType,
    )

    cause = (
        f"The state/task '{name}' returned a result with a size exceeding the maximum number of bytes service limit."
    )
    return states_failure(env, StatesErrorNameType.StatesStatesDataLimitExceeded, cause)


def sfn_state_entered_event_details(inner: Any, self: Any, env: Any) -> Any:
    """Wraps moto's CommonStateField._get_state_entered_event_details (state.py).

    Every state entry already serialises its input (compactly) for the StateEntered event; the
    limit on "input data when entering a state" is checked on that same text, so it costs no
    second serialisation. It also counts the entry as one state transition."""

    details = inner(self, env)
    count_transition()
    if _utf8_exceeds(details.get("input") or ""):
        raise data_limit_exceeded(env, self.name)
    return details


def sfn_before_task_execution(
    inner: Any, self: Any, env: Any, resource_runtime_part: Any, raw_parameters: Any, state_credentials: Any
) -> None:
    """Wraps moto's StateTaskService._before_eval_execution (state_task_service.py).

    AWS: "the input of a state is larger than the payload size quota after Parameters
    processing" is States.DataLimitExceeded; moto never measures a task's Parameters."""

    if not sfn_is_within_size_quota(raw_parameters):
        raise data_limit_exceeded(env, self.name)
    inner(self, env, resource_runtime_part, raw_parameters, state_credentials)


def check_map_result(env: Any, map_state: Any) -> None:
    """A Map without ResultWriter collects every iteration's output into its result, before
    ResultSelector / ResultPath (so even `ResultPath: null` does not stop it: aws-cdk#24799); that
    array is a connector output subject to the 256 KiB quota."""
    if map_state.result_writer is None and env.stack and not sfn_is_within_size_quota(env.stack[-1]):
        raise data_limit_exceeded(env, map_state.name)


def sfn_error_equals(inner: Any, self: Any, env: Any) -> None:
    """Wraps moto's ErrorEqualsDecl._eval_body (error_equals_decl.py): States.ALL matches every
    error except the terminal ones (TERMINAL_ERRORS); naming one explicitly still matches it."""

    error_name = env.stack[-1]
    names = {name.error_name for name in self.error_names}
    if "States.ALL" in names and getattr(error_name, "error_name", None) in TERMINAL_ERRORS:
        env.stack.pop()
        env.stack.append(False)
        return
    inner(self, env)


def sfn_handle_retry(inner: Any, self: Any, env: Any, failure_event: Any) -> Any:
    """Wraps moto's ExecutionState._handle_retry: AWS counts every retry attempt as a state
    transition ("including retries", Step Functions pricing), so the counter does too."""
    from moto.stepfunctions.parser.asl.component.common.retry.retry_outcome import RetryOutcome

    outcome = inner(self, env, failure_event)
    if outcome == RetryOutcome.CanRetry:
        count_transition()
    return outcome


def sfn_propagated_error_name(error_name: Any) -> Any:
    """Replaces the `CustomErrorName` an inline Map iteration / Parallel branch gives its error.

    moto wraps a failed iteration's or branch's error in CustomErrorName, which refuses names
    starting with "States.", so a States.DataLimitExceeded (or States.Timeout …) raised inside
    became States.Runtime at the Map / Parallel. AWS propagates the error name unchanged."""
    from moto.stepfunctions.parser.asl.component.common.error_name.custom_error_name import CustomErrorName
    from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name import StatesErrorName

    name = str(error_name)
    if name.startswith("States."):
        try:
            return StatesErrorName.from_name(name)
        except ValueError:
            pass  # an unknown States.* name: let CustomErrorName refuse it as before
    return CustomErrorName(error_name=error_name)


def _passing_failure_events(owner: type) -> Any:
    """A wrapper of `owner._from_error` that keeps the interpreter's own FailureEventException.

    Several service integrations (DynamoDB, API Gateway, …) turn every non-ClientError into
    their service's generic error, so a States.DataLimitExceeded raised inside the task would
    reach the Retry/Catch as "DynamoDB.AmazonDynamoDBException"."""

    def sfn_from_error(inner: Any, self: Any, env: Any, ex: Exception) -> Any:
        from moto.stepfunctions.parser.asl.component.common.error_name.failure_event import FailureEventException

        if isinstance(ex, FailureEventException):
            return ex.failure_event
        return inner(self, env, ex)

    return sfn_from_error


def _task_classes_with_own_from_error() -> list[type]:
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.state_task import StateTask

    found: list[type] = []
    pending = list(StateTask.__subclasses__())
    while pending:
        klass = pending.pop()
        pending += klass.__subclasses__()
        if "_from_error" in vars(klass) and klass not in found:
            found.append(klass)
    return found


def count_transition() -> None:
    runtime = runtime_or_none()
    if runtime is not None:
        with runtime.sfn_transitions_lock:
            runtime.sfn_transitions += 1


def patches() -> list[Patch]:
    import moto.stepfunctions.parser.quotas as quotas
    from moto.stepfunctions.parser.asl.component.common.error_name.error_equals_decl import ErrorEqualsDecl
    from moto.stepfunctions.parser.asl.component.state.exec.execute_state import ExecutionState
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service import (
        StateTaskService,
    )
    from moto.stepfunctions.parser.asl.component.state.state import CommonStateField

    from sdflow.local.stepfunctions.interpreter import import_interpreter_modules

    import_interpreter_modules()
    import moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.iteration_worker as iteration_worker
    import moto.stepfunctions.parser.asl.component.state.exec.state_parallel.branches_decl as branches_decl

    return [
        replace(iteration_worker, "CustomErrorName", sfn_propagated_error_name),
        replace(branches_decl, "CustomErrorName", sfn_propagated_error_name),
        replace(quotas, "is_within_size_quota", sfn_is_within_size_quota),
        *(
            replace(module, "is_within_size_quota", sfn_is_within_size_quota)
            for module in interpreter_modules_importing(quotas, "is_within_size_quota")
        ),
        wrap(CommonStateField, "_get_state_entered_event_details", sfn_state_entered_event_details),
        wrap(StateTaskService, "_before_eval_execution", sfn_before_task_execution),
        wrap(ErrorEqualsDecl, "_eval_body", sfn_error_equals),
        wrap(ExecutionState, "_handle_retry", sfn_handle_retry),
        *(wrap(klass, "_from_error", _passing_failure_events(klass)) for klass in _task_classes_with_own_from_error()),
    ]
