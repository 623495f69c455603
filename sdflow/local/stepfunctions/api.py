"""Step Functions' API as AWS documents it, where moto's differs: StopExecution, the Map Run's child
executions, history paging, and "Step Functions Execution Status Change" events.

The interpreter's own semantics (payload limits, ResultWriter, tolerated failures, task tokens)
live in stepfunctions.py and stepfunctions_{limits,map,tokens}.py; this module wraps moto's API
layer and the interpreter hooks the API needs (an execution's start and end; a Distributed Map
child's, in stepfunctions/maprun.py). Every wrapper receives what it wraps
(`inner`), so it composes with another module's patch of the same method (patching.WRAP_ORDER).

What is kept, and where (on moto's own objects, so a reset moto forgets it):
- Execution: `_sdflow_abort` (stop date, error, cause, history length at the stop) once stopped.
- ExecutionWorker: `_sdflow_event_manager`, the execution's own history (moto swaps
  `env.event_manager` for a scratch one while a Distributed Map runs).
- MapRunRecord: `_sdflow_children` (stepfunctions/map_runs.py MapRunChildren), its child executions.
Task tokens of a stopped execution are closed on their callback endpoints, which
stepfunctions/tokens.py answers with TaskTimedOut."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from sdflow.local.patching import Patch, replace, wrap
from sdflow.local.runtime import current_clock
from sdflow.local.stepfunctions import listing, map_runs
from sdflow.local.stepfunctions.executions import (
    event_manager,
    execution_lock,
    history,
    publish_execution,
)
from sdflow.local.stepfunctions.map_runs import (
    StepFunctionsValidationError,
    decode_page_token,
    encode_page_token,
    page_size,
)

# API reference, StopExecution: error is 0-256 characters, cause 0-32768.
STOP_ERROR_MAX = 256
STOP_CAUSE_MAX = 32768
# moto fills env.event_manager from the execution thread, which starts right after StartExecution.
ENV_WAIT_S = 2.0


# ---------------------------------------------------------------- interpreter hooks: start, end, history


def sfn_execution_start(inner: Any, self: Any) -> None:
    """Wraps moto/stepfunctions/parser/backend/execution.py Execution.start: the RUNNING event goes
    out before the execution thread starts, so it always precedes the terminal event."""

    publish_execution(self, "RUNNING")
    inner(self)


def sfn_execution_terminated(inner: Any, self: Any) -> None:
    """Wraps moto/stepfunctions/parser/backend/execution.py BaseExecutionWorkerCommunication.terminated.

    An execution StopExecution already closed keeps the status, stop date, error and cause it gave
    (moto would overwrite the stop date when the interrupted thread ends); any other ends here
    and its status-change event goes out."""

    execution = self.execution
    with execution_lock(execution):
        if getattr(execution, "_sdflow_abort", None) is not None:
            return
        inner(self)
    publish_execution(execution, execution.status)


def sfn_evaluation_environment(inner: Any, self: Any) -> Any:
    """Wraps moto/stepfunctions/parser/backend/execution_worker.py
    ExecutionWorker._get_evaluation_environment to keep the execution's own history: while a
    Distributed Map runs, moto points `env.event_manager` at a scratch manager for the children."""

    env = inner(self)
    self._sdflow_event_manager = env.event_manager
    return env


# ---------------------------------------------------------------- StopExecution and task tokens


def _wait_for_env(execution: Any) -> Any:
    deadline = time.monotonic() + ENV_WAIT_S
    while execution.exec_worker is None or execution.exec_worker.env is None:
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)
    return execution.exec_worker.env


def _close_open_tokens(env: Any) -> list[Any]:
    """Closes every unanswered task token of the execution (its Map children share the pool):
    SendTask* on one then answers TaskTimedOut (stepfunctions/tokens.py reads `consumer_error`)."""
    from moto.stepfunctions.parser.asl.eval.callback.callback import CallbackConsumerTimeout

    endpoints = []
    for endpoint in list(getattr(env.callback_pool_manager, "_pool", {}).values()):
        if endpoint.get_outcome() is None and endpoint.consumer_error is None:
            endpoint.sdflow_stopped = True  # for the console line (stepfunctions/tokens.py, moto_logging.py)
            endpoint.report(CallbackConsumerTimeout())
            endpoints.append(endpoint)
    return endpoints


def stop_execution(backend: Any, execution_arn: str, error: str | None, cause: str | None) -> dt.datetime:
    """StopExecution as the API reference describes it: the execution is ABORTED at once with the
    given error and cause, its history ends with ExecutionAborted, its Map Runs and their running
    children are aborted, and its outstanding task tokens answer TaskTimedOut. A stop of an
    execution that already ended changes nothing."""
    from moto.stepfunctions.parser.api import ExecutionStatus

    backend._validate_execution_arn(execution_arn)
    execution = backend.describe_execution(execution_arn)
    env = _wait_for_env(execution)
    with execution_lock(execution):
        if execution.exec_status != ExecutionStatus.RUNNING:
            return execution.stop_date or current_clock().now()
        stop_date = current_clock().now()
        manager = event_manager(execution)
        length = len(getattr(manager, "_history_event_list", ())) if manager is not None else 0
        execution._sdflow_abort = (stop_date, error, cause, length)
        execution.error, execution.cause, execution.stop_date = error, cause, stop_date
        execution.exec_status = ExecutionStatus.ABORTED
        endpoints = _close_open_tokens(env) if env is not None else []
        records = env.map_run_record_pool_manager.get_all() if env is not None else []
        if env is not None:
            env.set_stop(stop_date=stop_date, cause=cause, error=error)
        for endpoint in endpoints:  # wake the waiting tasks now that the program reads as stopped
            endpoint.interrupt_all()
    for record in records:
        map_runs.abort_map_run(record, stop_date)
    publish_execution(execution, "ABORTED")
    return stop_date


def _check_length(name: str, value: str | None, limit: int) -> None:
    if value is not None and len(value) > limit:
        raise StepFunctionsValidationError(
            f"1 validation error detected: Value at '{name}' failed to satisfy constraint: "
            f"Member must have length less than or equal to {limit}"
        )


def sfn_stop_execution(self: Any) -> Any:
    """Replaces moto/stepfunctions/responses.py StepFunctionResponse.stop_execution, which drops
    error and cause and leaves the execution RUNNING until its current task ends."""
    from moto.core.responses import ActionResult

    error, cause = self._get_param("error"), self._get_param("cause")
    _check_length("error", error, STOP_ERROR_MAX)
    _check_length("cause", cause, STOP_CAUSE_MAX)
    stop_date = stop_execution(self.stepfunction_backend, self._get_param("executionArn"), error, cause)
    return ActionResult({"stopDate": stop_date})


# ---------------------------------------------------------------- ListExecutions, DescribeExecution, history


def sfn_list_executions(inner: Any, self: Any) -> Any:
    """Wraps moto/stepfunctions/responses.py StepFunctionResponse.list_executions, which answers 500
    for `mapRunArn` and knows no redrive. API reference, ListExecutions: "You can specify either a
    mapRunArn or a stateMachineArn, but not both"; with mapRunArn, the Map Run's child workflow
    executions, most recent first, paged by maxResults (default 100, at most 1000) and nextToken.
    With stateMachineArn: every item carries redriveCount (and redriveDate once redriven), and
    redriveFilter (REDRIVEN / NOT_REDRIVEN) selects the executions (stepfunctions/listing.py)."""
    from moto.core.responses import ActionResult

    map_run_arn = self._get_param("mapRunArn")
    if not map_run_arn:
        return listing.list_state_machine_executions(inner, self)
    if self._get_param("stateMachineArn"):
        raise StepFunctionsValidationError("You can specify either a mapRunArn or a stateMachineArn, but not both.")
    status_filter, redrive_filter = self._get_param("statusFilter"), self._get_param("redriveFilter")
    listing.check_redrive_filter(redrive_filter)
    limit = page_size(self._get_param("maxResults"))
    record = map_runs.find_map_run(self.stepfunction_backend, map_run_arn)
    request = {"mapRunArn": map_run_arn, "statusFilter": status_filter}
    if redrive_filter is not None:
        request["redriveFilter"] = redrive_filter
    start = decode_page_token(self._get_param("nextToken"), request)
    items, next_index = map_runs.list_children(record, status_filter, limit, start, redrive_filter)
    response: dict[str, Any] = {"executions": items}
    if next_index is not None:
        response["nextToken"] = encode_page_token(request, next_index)
    return ActionResult(response)


def sfn_describe_execution(inner: Any, self: Any) -> Any:
    """Wraps moto/stepfunctions/responses.py StepFunctionResponse.describe_execution: a Map Run's
    child execution ("…:execution:<machine>/<label>:<id>") is described too, with its mapRunArn."""
    from moto.core.responses import ActionResult
    from moto.stepfunctions.exceptions import ExecutionDoesNotExist

    try:
        return inner(self)
    except ExecutionDoesNotExist as missing:
        child = map_runs.find_child(self.stepfunction_backend, self._get_param("executionArn"))
        if child is None:
            raise missing from None
        return ActionResult(child.describe())


_DATA_KEYS = ("input", "inputDetails", "output", "outputDetails")


def _without_data(event: dict[str, Any]) -> dict[str, Any]:
    return {
        key: {k: v for k, v in value.items() if k not in _DATA_KEYS} if key.endswith("EventDetails") else value
        for key, value in event.items()
    }


def sfn_get_execution_history(self: Any) -> Any:
    """Replaces moto/stepfunctions/responses.py StepFunctionResponse.get_execution_history, which
    ignores every option. API reference, GetExecutionHistory: maxResults (default 100, at most
    1000, 0 = default) with nextToken, reverseOrder (latest first), includeExecutionData (default
    true; false leaves out the events' input and output)."""
    from moto.core.responses import ActionResult

    arn = self._get_param("executionArn")
    execution = self.stepfunction_backend.describe_execution(arn)
    reverse = bool(self._get_param("reverseOrder", False))
    include = self._get_param("includeExecutionData")
    include = True if include is None else bool(include)
    limit = page_size(self._get_param("maxResults"))
    request = {"executionArn": arn, "reverseOrder": reverse, "includeExecutionData": include}
    start = decode_page_token(self._get_param("nextToken"), request) or 0
    events = history(execution)
    if reverse:
        events.reverse()
    page = events[start : start + limit]
    response: dict[str, Any] = {"events": page if include else [_without_data(event) for event in page]}
    if start + limit < len(events):
        response["nextToken"] = encode_page_token(request, start + limit)
    return ActionResult(response)


def sfn_describe_map_run(self: Any, map_run_arn: str) -> dict[str, Any]:
    """Wraps moto/stepfunctions/parser/models.py StepFunctionsParserBackend.describe_map_run: the
    execution and item counts come from the child executions recorded here (moto never counts a
    pending child, nor a failed one as no longer running), and an aborted parent's Map Run reads ABORTED."""
    record = map_runs.find_map_run(self, map_run_arn)
    return map_runs.describe_map_run(record, record.describe())


def sfn_list_map_runs(self: Any) -> Any:
    """Replaces moto/stepfunctions/responses.py StepFunctionResponse.list_map_runs (no paging in
    moto). API reference, ListMapRuns: maxResults (default 100, at most 1000) and nextToken."""
    from moto.core.responses import ActionResult

    arn = self._get_param("executionArn")
    execution = self.stepfunction_backend.describe_execution(arn)
    env = execution.exec_worker.env if execution.exec_worker is not None else None
    records = env.map_run_record_pool_manager.get_all() if env is not None else []
    limit = page_size(self._get_param("maxResults"))
    request = {"executionArn": arn}
    start = decode_page_token(self._get_param("nextToken"), request) or 0
    response: dict[str, Any] = {"mapRuns": [map_runs.list_item(record) for record in records[start : start + limit]]}
    if start + limit < len(records):
        response["nextToken"] = encode_page_token(request, start + limit)
    return ActionResult(response)


def patches() -> list[Patch]:
    from moto.stepfunctions.parser.backend.execution import BaseExecutionWorkerCommunication, Execution
    from moto.stepfunctions.parser.backend.execution_worker import ExecutionWorker
    from moto.stepfunctions.parser.models import StepFunctionsParserBackend
    from moto.stepfunctions.responses import StepFunctionResponse

    return [
        wrap(Execution, "start", sfn_execution_start),
        wrap(BaseExecutionWorkerCommunication, "terminated", sfn_execution_terminated),
        wrap(ExecutionWorker, "_get_evaluation_environment", sfn_evaluation_environment),
        replace(StepFunctionResponse, "stop_execution", sfn_stop_execution),
        wrap(StepFunctionResponse, "list_executions", sfn_list_executions),
        wrap(StepFunctionResponse, "describe_execution", sfn_describe_execution),
        replace(StepFunctionResponse, "get_execution_history", sfn_get_execution_history),
        replace(StepFunctionResponse, "list_map_runs", sfn_list_map_runs),
        replace(StepFunctionsParserBackend, "describe_map_run", sfn_describe_map_run),
    ]
