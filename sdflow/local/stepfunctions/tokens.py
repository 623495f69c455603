"""Step Functions: a task token per attempt of a `.waitForTaskToken` task, dead once the attempt ends.

AWS generates a task token "in the context object when a workflow enters a task state"
(SendTaskSuccess API reference) and every Retry attempt enters the task anew, so each attempt
has its own token; a token whose task has ended is answered TaskTimedOut, "The task token has
either expired or the task associated with the token has already been closed", with the message
AWS sends: "Task Timed Out: 'Provided task does not exist anymore'". A token Step Functions never
issued is InvalidToken.

moto 5.2.5 makes the token once per state entry, so a retried attempt waits on the first
attempt's token, whose stored failure answers at once: the retry "fails" instantly with the old
error. Its endpoints are never closed either, so a late SendTaskSuccess on a finished attempt is
accepted silently (and send_task_success looks only at RUNNING executions)."""

from __future__ import annotations

from typing import Any

from moto.core.exceptions import AWSError

from sdflow.local import moto_logging
from sdflow.local.patching import Patch, replace, wrap

TASK_TIMED_OUT_MESSAGE = "Task Timed Out: 'Provided task does not exist anymore'"


class TaskTimedOut(AWSError):
    """moto's own TaskTimedOut (parser/api.py) sets `code`, which AWSError ignores: it answers an
    empty error code."""

    TYPE = "TaskTimedOut"
    STATUS = 400


def _waits_for_task_token(state: Any) -> bool:
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.resource import ResourceCondition

    return getattr(state.resource, "condition", None) == ResourceCondition.WaitForTaskToken


def _closed_attempt() -> Any:
    from moto.stepfunctions.parser.asl.eval.callback.callback import CallbackConsumerError

    class AttemptEnded(CallbackConsumerError):
        """The attempt that owned the token ended (succeeded, failed, timed out)."""

    return AttemptEnded()


def sfn_callback_attempt(inner: Any, self: Any, env: Any) -> None:
    """Wraps moto's ExecutionState._evaluate_with_timeout for StateTaskServiceCallback (one
    attempt of the task, run by the Retry loop): a retried attempt gets a fresh token, and every
    attempt's token is closed when the attempt ends, timeouts included (this runs on the state's
    own thread, not on the attempt's worker thread that may still be waiting)."""

    attempt = inner
    if not _waits_for_task_token(self):
        attempt(self, env)
        return
    context = env.states.context_object
    pool = env.callback_pool_manager
    token = context.context_object_data["Task"]["Token"]
    endpoint = pool.get(token)
    if endpoint is None or endpoint.consumer_error is not None:  # an earlier attempt owned it
        token = context.update_task_token()
        endpoint = pool.add(token)
    moto_logging.stopped_here(None)
    try:
        attempt(self, env)
    except BaseException:
        # Closed by StopExecution (stepfunctions/api.py): the interpreter turns it into a task
        # timeout, which the console should not report as one.
        if getattr(endpoint, "sdflow_stopped", False):
            moto_logging.stopped_here(str(context.context_object_data.get("Execution", {}).get("Name")))
        raise
    finally:
        endpoint.report(_closed_attempt())
        endpoint.interrupt_all()


def _resolve(backend: Any, task_token: str, act: Any) -> None:
    """Finds the open task that issued `task_token` (in any execution) and applies `act` to its pool."""
    from moto.stepfunctions.exceptions import InvalidToken
    from moto.stepfunctions.parser.api import ExecutionStatus

    for execution in backend._get_executions():
        worker = execution.exec_worker
        pool = worker.env.callback_pool_manager if worker is not None else None
        endpoint = pool.get(task_token) if pool is not None else None
        if endpoint is None:
            continue
        if endpoint.consumer_error is not None or execution.exec_status != ExecutionStatus.RUNNING:
            raise TaskTimedOut(TASK_TIMED_OUT_MESSAGE)
        act(pool)
        return
    raise InvalidToken("'Invalid token'")


def sfn_send_task_success(self: Any, task_token: str, outcome: str) -> Any:
    """Replaces moto/stepfunctions/parser/models.py StepFunctionsParserBackend.send_task_success."""
    from moto.stepfunctions.parser.api import SendTaskSuccessOutput
    from moto.stepfunctions.parser.asl.eval.callback.callback import CallbackOutcomeSuccess

    result = CallbackOutcomeSuccess(callback_id=task_token, output=outcome)
    _resolve(self, task_token, lambda pool: pool.notify(callback_id=task_token, outcome=result))
    return SendTaskSuccessOutput()


def sfn_send_task_failure(self: Any, task_token: str, error: Any = None, cause: Any = None) -> Any:
    """Replaces StepFunctionsParserBackend.send_task_failure (same rules as send_task_success)."""
    from moto.stepfunctions.parser.api import SendTaskFailureOutput
    from moto.stepfunctions.parser.asl.eval.callback.callback import CallbackOutcomeFailure

    result = CallbackOutcomeFailure(callback_id=task_token, error=error, cause=cause)
    _resolve(self, task_token, lambda pool: pool.notify(callback_id=task_token, outcome=result))
    return SendTaskFailureOutput()


def sfn_send_task_heartbeat(self: Any, task_token: str) -> Any:
    """Replaces StepFunctionsParserBackend.send_task_heartbeat: an open task accepts a heartbeat
    even without HeartbeatSeconds (moto answers InvalidToken then)."""
    from moto.stepfunctions.parser.api import SendTaskHeartbeatOutput

    _resolve(self, task_token, lambda pool: pool.heartbeat(callback_id=task_token))
    return SendTaskHeartbeatOutput()


def patches() -> list[Patch]:
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service_callback import (
        StateTaskServiceCallback,
    )
    from moto.stepfunctions.parser.models import StepFunctionsParserBackend

    return [
        wrap(StateTaskServiceCallback, "_evaluate_with_timeout", sfn_callback_attempt),
        replace(StepFunctionsParserBackend, "send_task_success", sfn_send_task_success),
        replace(StepFunctionsParserBackend, "send_task_failure", sfn_send_task_failure),
        replace(StepFunctionsParserBackend, "send_task_heartbeat", sfn_send_task_heartbeat),
    ]
