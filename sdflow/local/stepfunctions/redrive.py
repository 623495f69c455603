"""Step Functions: RedriveExecution and `$$.Execution.RedriveCount`, as AWS documents them.

- Context object (Developer Guide, "Accessing execution data from the Context object"):
  `$$.Execution` holds Id, Input, Name, RoleArn, StartTime ("Format: ISO 8601"), RedriveCount,
  and RedriveTime, which "is only available if you've redriven an execution". moto's interpreter
  gives neither redrive field, and a Distributed Map child sees its parent's `$$.Execution`;
  on AWS a child workflow execution is an execution of its own (its ARN, name, input, start and
  its own redrive count).
- RedriveExecution (API reference; Developer Guide "Restarting state machine executions with
  redrive"): only a STANDARD execution that is FAILED, TIMED_OUT or ABORTED, closed less than 14
  days ago, open less than a year, with fewer than 24,999 history events; otherwise
  ExecutionNotRedrivable with the redriveStatusReason DescribeExecution gives ("Execution is
  SUCCEEDED and cannot be redriven", ...). The execution keeps its ARN, name, start date and
  input, is RUNNING again and continues at the state it did not finish (the last state entered:
  a caught failure moved on to another state, so it is not re-run), with the input that state
  got; the history goes on after an ExecutionRedriven event; a Retry's attempts start from 0;
  the state machine's timeout starts over. `clientToken`: "idempotent responses for the last 10
  client tokens used to successfully redrive the execution ... valid for up to 15 minutes".
  DescribeExecution (and so the status-change event, "the same information as the
  DescribeExecution API") gains redriveCount, redriveDate, redriveStatus, redriveStatusReason.
  A Distributed Map state that is re-run redrives its Map Run (stepfunctions/redrive_map.py).
Not emulated: an Inline Map / Parallel state is re-run whole (AWS re-runs only the failed
iterations / branches); JSONata variables (Assign) are not restored.

What is kept, on moto's objects: Execution `sdflow_redrive_count`, `sdflow_redrive_date`,
`sdflow_redrive_tokens`, `sdflow_comm` (the worker communication whose end counts); an
Environment's `sdflow_point` (the last state entered and its input) and, for one evaluation,
`sdflow_resume` (the state to start at instead of StartAt); the Map Run pool's `sdflow_redrive`
(the Map Run the redrive will redrive).
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from moto.core.exceptions import AWSError

from sdflow.local.patching import Patch, add, wrap
from sdflow.local.runtime import current_clock
from sdflow.local.stepfunctions.executions import (
    REDRIVABLE,
    execution_lock,
    history,
    publish_execution,
    redrive_fields_of,
    redrive_status,
)

# API reference, RedriveExecution clientToken.
CLIENT_TOKENS_KEPT = 10
CLIENT_TOKEN_TTL = dt.timedelta(minutes=15)
CLIENT_TOKEN_MAX = 64


class ExecutionNotRedrivable(AWSError):
    """API reference, RedriveExecution: "The execution Amazon Resource Name (ARN) that you specified
    for executionArn cannot be redriven"; the message is the redriveStatusReason."""

    TYPE = "ExecutionNotRedrivable"


@dataclass
class RedrivePlan:
    """What a redriven execution's worker starts from."""

    count: int
    events: list[dict[str, Any]]
    state: tuple[str, Any] | None  # (state name, its input); None: from StartAt
    map_runs: list[Any]
    map_redrive: Any = None  # stepfunctions_redrive_map.MapRunRedrive


def iso_time(moment: dt.datetime | str) -> str:
    """AWS's context-object timestamps: "2019-03-26T20:14:13.192Z" (UTC, milliseconds)."""
    if isinstance(moment, str):
        return moment
    moment = moment.astimezone(dt.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def redrive_fields(count: int, date: dt.datetime | None) -> dict[str, Any]:
    fields: dict[str, Any] = {"RedriveCount": count}
    if count and date is not None:
        fields["RedriveTime"] = iso_time(date)
    return fields


# ---------------------------------------------------------------- $$.Execution


def sfn_redrive_context(inner: Any, self: Any) -> Any:
    """Wraps moto/stepfunctions/parser/backend/execution_worker.py
    ExecutionWorker._get_evaluation_environment: the execution's `$$.Execution` gains RedriveCount
    (0 until redriven) and, once redriven, RedriveTime; StartTime is AWS's ISO 8601 text."""

    env = inner(self)
    execution = getattr(self._execution_communication, "execution", None)
    data = env.states.context_object.context_object_data["Execution"]
    data["StartTime"] = iso_time(data["StartTime"])
    data.update(
        redrive_fields(getattr(execution, "sdflow_redrive_count", 0), getattr(execution, "sdflow_redrive_date", None))
    )
    return env


def sfn_child_job_marker(inner: Any, self: Any, env: Any, job: Any) -> None:
    """Wraps moto's DistributedItemProcessorWorker._eval_job (outermost): the child's frame knows
    its job, whose ChildExecution (stepfunctions/map_runs.py) exists by the time its input is read."""

    env.sdflow_job = job
    inner(self, env, job)
    child = getattr(job, "sdflow_child", None)
    if child is not None:  # where a redrive of this child continues
        child.sdflow_point = getattr(env, "sdflow_point", None)


def sfn_child_context(inner: Any, self: Any, env_frame: Any) -> None:
    """Wraps moto's DistributedItemProcessorWorker._eval_input: once the ItemSelector (which reads
    the parent's context, as on AWS) has made the child's input, the child's frame gets its own
    `$$.Execution`. moto shares the parent's dict with every frame, so it is replaced, not changed."""

    job = getattr(env_frame, "sdflow_job", None)
    child = getattr(job, "sdflow_child", None)
    if child is not None and getattr(job, "sdflow_redriven", None) is not None:
        # A redriven child keeps its input (no second ItemSelector) and continues where it stopped.
        child_input = json.loads(child.input_text)
        env_frame.states.reset(child_input)
        env_frame.sdflow_child_input = child_input
        if getattr(child, "sdflow_point", None) is not None:
            env_frame.sdflow_resume = child.sdflow_point
    else:
        inner(self, env_frame)
    context = env_frame.states.context_object.context_object_data
    execution = dict(context["Execution"])
    if child is not None:
        execution.update(Id=child.arn, Name=child.name, StartTime=iso_time(child.start_date))
        execution.update(redrive_fields(child.redrive_count, child.redrive_date))
    else:  # moto's own Map worker without the Map Run bookkeeping: a first run
        execution.update(redrive_fields(0, None))
    execution["Input"] = env_frame.states.get_input()
    context["Execution"] = execution


# ---------------------------------------------------------------- where a redrive continues


def sfn_state_entered(inner: Any, self: Any, env: Any) -> Any:
    """Wraps moto's CommonStateField._get_state_entered_event_details (state.py), called as a
    state is entered with the state's input in place: the environment remembers the last state
    it entered, which is where a redrive continues."""

    env.sdflow_point = (self.name, env.states.get_input())
    return inner(self, env)


def sfn_program_resume(inner: Any, self: Any, env: Any) -> None:
    """Wraps moto's Program._eval_body (program/program.py): an environment marked to resume starts
    at that state with that input instead of StartAt (a redriven execution or Map Run child)."""

    resume = vars(env).pop("sdflow_resume", None)
    if resume is not None:
        state_name, state_input = resume
        env.next_state_name = state_name
        env.states.reset(state_input)
    inner(self, env)


# ---------------------------------------------------------------- eligibility


# ---------------------------------------------------------------- RedriveExecution


def _check_client_token(token: str | None) -> None:
    from sdflow.local.stepfunctions.map_runs import StepFunctionsValidationError

    if token is not None and not (0 < len(token) <= CLIENT_TOKEN_MAX and all("!" <= c <= "~" for c in token)):
        raise StepFunctionsValidationError(
            "1 validation error detected: Value at 'clientToken' failed to satisfy constraint: "
            f"Member must have length between 1 and {CLIENT_TOKEN_MAX} and match pattern [!-~]+"
        )


def _earlier_redrive(execution: Any, token: str | None, now: dt.datetime) -> dt.datetime | None:
    """The redrive date a recent request with the same client token got, if any."""
    tokens: dict[str, tuple[dt.datetime, dt.datetime]] = getattr(execution, "sdflow_redrive_tokens", {})
    found = tokens.get(token) if token else None
    if found is not None and now - found[1] <= CLIENT_TOKEN_TTL:
        return found[0]
    return None


def _remember_token(execution: Any, token: str | None, date: dt.datetime) -> None:
    if not token:
        return
    tokens = vars(execution).setdefault("sdflow_redrive_tokens", {})
    tokens[token] = (date, date)
    while len(tokens) > CLIENT_TOKENS_KEPT:
        tokens.pop(next(iter(tokens)))


def _plan(execution: Any, count: int) -> RedrivePlan:
    from sdflow.local.stepfunctions import redrive_map as stepfunctions_redrive_map

    env = execution.exec_worker.env
    point = getattr(env, "sdflow_point", None) if env is not None else None
    records = env.map_run_record_pool_manager.get_all() if env is not None else []
    map_redrive = stepfunctions_redrive_map.plan(execution, records, point[0]) if point is not None else None
    return RedrivePlan(
        count=count,
        events=history(execution),
        state=point,
        map_runs=records,
        map_redrive=map_redrive,
    )


def redrive_execution(backend: Any, execution_arn: str, client_token: str | None) -> dt.datetime:
    """RedriveExecution: the execution runs again from the state it did not finish."""
    from moto.stepfunctions.parser.api import ExecutionStatus

    _check_client_token(client_token)
    backend._validate_execution_arn(execution_arn)
    execution = backend.describe_execution(execution_arn)
    with execution_lock(execution):
        now = current_clock().now()
        earlier = _earlier_redrive(execution, client_token, now)
        if earlier is not None:
            return earlier
        status, reason = redrive_status(execution)
        if status != REDRIVABLE:
            raise ExecutionNotRedrivable(str(reason))
        count = getattr(execution, "sdflow_redrive_count", 0) + 1
        plan = _plan(execution, count)
        execution.sdflow_redrive_count, execution.sdflow_redrive_date = count, now
        execution._sdflow_abort = None
        execution.output = execution.error = execution.cause = execution.stop_date = None
        worker = execution._get_start_execution_worker()
        worker.sdflow_plan = plan
        execution.sdflow_comm = worker._execution_communication
        execution.exec_worker = worker
        execution.exec_status = ExecutionStatus.RUNNING
        _remember_token(execution, client_token, now)
    publish_execution(execution, "RUNNING")
    worker.start()
    return now


def sfn_execution_logic(inner: Any, self: Any) -> None:
    """Wraps moto's ExecutionWorker._execution_logic (backend/execution_worker.py): a redriven
    execution's worker continues the history (ExecutionRedriven instead of ExecutionStarted), keeps
    its Map Runs and starts at the state the last attempt did not finish."""
    from moto.stepfunctions.parser.api import ExecutionRedrivenEventDetails, HistoryEventType
    from moto.stepfunctions.parser.asl.eval.event.event_detail import EventDetails

    plan: RedrivePlan | None = getattr(self, "sdflow_plan", None)
    if plan is None:
        inner(self)
        return
    program = self._get_evaluation_entrypoint()
    self.env = env = self._get_evaluation_environment()
    manager = env.event_manager
    manager._history_event_list.extend(plan.events)
    manager._event_id_gen._next_id = len(plan.events) + 1
    context = env.event_history_context
    context.source_event_id = context.last_published_event_id = len(plan.events)
    for record in plan.map_runs:
        env.map_run_record_pool_manager.add(record)
    manager.add_event(
        context=context,
        event_type=HistoryEventType.ExecutionRedriven,
        event_details=EventDetails(  # type: ignore[typeddict-item]
            executionRedrivenEventDetails=ExecutionRedrivenEventDetails(redriveCount=plan.count)
        ),
    )
    if plan.state is not None:
        env.sdflow_resume = plan.state
    env.map_run_record_pool_manager.sdflow_redrive = plan.map_redrive
    program.eval(env)
    self._execution_communication.terminated()


def sfn_terminated_current(inner: Any, self: Any) -> None:
    """Wraps BaseExecutionWorkerCommunication.terminated (backend/execution.py): the thread of an
    attempt that a redrive replaced (a stopped or timed-out one may still be running) ends
    without touching the execution."""

    current = getattr(self.execution, "sdflow_comm", None)
    if current is not None and current is not self:
        return
    inner(self)


# ---------------------------------------------------------------- the API


def sfn_redrive_execution_api(self: Any) -> Any:
    """StepFunctionResponse.redrive_execution: moto has no RedriveExecution."""
    from moto.core.responses import ActionResult

    date = redrive_execution(self.stepfunction_backend, self._get_param("executionArn"), self._get_param("clientToken"))
    return ActionResult({"redriveDate": date})


def sfn_describe_execution_redrive(inner: Any, self: Any) -> Any:
    """Wraps StepFunctionResponse.describe_execution: the redrive members (a Map Run's child
    execution, described by stepfunctions/map_runs.py, has its own)."""
    from moto.stepfunctions.exceptions import ExecutionDoesNotExist

    result = inner(self)
    described = result.result
    if isinstance(described, dict) and "mapRunArn" not in described:
        try:
            execution = self.stepfunction_backend.describe_execution(described["executionArn"])
        except ExecutionDoesNotExist:
            return result
        described.update(redrive_fields_of(execution))
    return result


def patches() -> list[Patch]:
    from moto.stepfunctions.parser.asl.component.program.program import Program
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.itemprocessor.distributed_item_processor_worker import (  # noqa: E501
        DistributedItemProcessorWorker,
    )
    from moto.stepfunctions.parser.asl.component.state.state import CommonStateField
    from moto.stepfunctions.parser.backend.execution import BaseExecutionWorkerCommunication
    from moto.stepfunctions.parser.backend.execution_worker import ExecutionWorker
    from moto.stepfunctions.responses import StepFunctionResponse

    return [
        wrap(ExecutionWorker, "_get_evaluation_environment", sfn_redrive_context),
        wrap(ExecutionWorker, "_execution_logic", sfn_execution_logic),
        wrap(BaseExecutionWorkerCommunication, "terminated", sfn_terminated_current),
        wrap(CommonStateField, "_get_state_entered_event_details", sfn_state_entered),
        wrap(Program, "_eval_body", sfn_program_resume),
        wrap(DistributedItemProcessorWorker, "_eval_job", sfn_child_job_marker),
        wrap(DistributedItemProcessorWorker, "_eval_input", sfn_child_context),
        add(StepFunctionResponse, "redrive_execution", sfn_redrive_execution_api),
        wrap(StepFunctionResponse, "describe_execution", sfn_describe_execution_redrive),
    ]
