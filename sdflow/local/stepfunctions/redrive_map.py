"""Step Functions: a redriven execution redrives its Distributed Map's Map Run, as AWS documents it.

Developer Guide, "Redriving Map Runs in Step Functions executions":
- the parent's redrive redrives the Map Run (same Map Run ARN; DescribeMapRun's redriveCount and
  redriveDate; a MapRunRedriven event in the parent's history); "All child workflow executions
  that failed, timed out, or canceled in the original execution attempt are redriven using the
  RedriveExecution API action ... from the last state in ItemProcessor that resulted in their
  unsuccessful execution" and "use the same execution ARN" (so their own
  `$$.Execution.RedriveCount` goes up); children that succeeded are not run again and their
  results stay (ResultWriter writes the whole Map Run again, to the same `<MapRun id>/` folder);
  items that never started a child start one now;
- "The redriven Map Run uses the same input provided in the original execution attempt" (the
  items are not read from the ItemReader again);
- "A new Map Run is started and the existing Map Run isn't redriven" when it failed with
  States.DataLimitExceeded or States.Runtime, or started no child;
- "the hard limit of 1000 redrives of a given Map Run. If you've exceeded this limit, you'll
  receive the States.Runtime error";
- the state machine's role needs states:RedriveExecution on the children,
  "arn:aws:states:<region>:<account>:execution:<stateMachineName>/<mapRunLabel>:*" (section
  "IAM permission to redrive a Map Run"); enforced when the local cloud enforces IAM. AWS does not
  say how a missing permission shows; here such a child is treated like the children the guide
  calls not redrivable: "it won't be attempted again. The last error or output of the execution
  is permanent" (it counts as failed), and the denial is logged.
The tolerated failure threshold (stepfunctions/map.py) is evaluated over the whole Map Run: the
kept successful children count as succeeded items of the run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from sdflow.local.patching import Patch, wrap
from sdflow.local.runtime import current_clock, runtime_or_none
from sdflow.local.stepfunctions import map as stepfunctions_map
from sdflow.local.stepfunctions.interpreter import states_failure

log = logging.getLogger(__name__)
MAX_MAP_RUN_REDRIVES = 1000
NOT_REDRIVEN_ERRORS = frozenset({"States.DataLimitExceeded", "States.Runtime"})


@dataclass
class MapRunRedrive:
    """The Map Run a redriven execution redrives, and which items run again."""

    record: Any  # moto's MapRunRecord
    items: list[Any]  # the items of the original attempt
    redo: list[int]  # indices of the items that run again, ascending
    children: dict[int, Any] = field(default_factory=dict)  # index -> ChildExecution redriven
    kept: dict[int, Any] = field(default_factory=dict)  # index -> output of a child that succeeded


class RedriveItems(list[Any]):
    """The items to run again, handed to moto's _map_run in place of the item list; the JobPool
    made from them gives each job its original index (sfn_job_pool)."""

    def __init__(self, plan_: MapRunRedrive) -> None:
        super().__init__(plan_.items[index] for index in plan_.redo)
        self.plan = plan_


def plan(execution: Any, records: list[Any], state_name: str) -> MapRunRedrive | None:
    """The Map Run to redrive when the redrive continues at `state_name`, or None (a new Map Run).
    A Map Run of a Map inside a child workflow belongs to the child's execution ARN."""
    if execution.error in NOT_REDRIVEN_ERRORS:
        return None
    mine = [
        r
        for r in records
        if r.execution_arn == execution.execution_arn and getattr(r, "sdflow_state_name", None) == state_name
    ]
    if not mine:
        return None
    record = mine[-1]
    items = getattr(record, "sdflow_items", None)
    runs = getattr(record, "_sdflow_children", None)
    if items is None or runs is None or not runs.children:
        return None
    lock, finished = stepfunctions_map._children(record)
    with lock:
        kept = {child.index: child.output for child in finished if child.status == "SUCCEEDED"}
    with runs.lock:
        started = {child.index: child for child in runs.children}
    redo = [index for index in range(len(items)) if index not in kept]
    children = {index: started[index] for index in redo if index in started}
    return MapRunRedrive(record=record, items=list(items), redo=redo, children=children, kept=kept)


def sfn_map_run_items(inner: Any, self: Any, env: Any, eval_input: Any) -> None:
    """Wraps moto's DistributedIterationComponent._map_run (outermost): a first run remembers its
    items and its state, which a redrive of the execution needs."""

    record = eval_input.map_run_record
    if not isinstance(env.stack[-1], RedriveItems):
        record.sdflow_items = list(env.stack[-1])
        record.sdflow_state_name = eval_input.state_name
    inner(self, env, eval_input)


def sfn_job_pool(inner: Any, job_program: Any, job_inputs: list[Any]) -> Any:
    """Replaces `JobPool` in moto's distributed_iteration_component.py: for a redrive, each job
    keeps its item's original index ($$.Map.Item.Index, ResultWriter order) and names the child
    execution it redrives."""

    pool = inner(job_program=job_program, job_inputs=job_inputs)
    redrive: MapRunRedrive | None = getattr(job_inputs, "plan", None)
    if redrive is not None:
        for job in pool._open_jobs:
            job.job_index = redrive.redo[job.job_index]
            job.sdflow_redriven = redrive.children.get(job.job_index)
    return pool


def _denied(env: Any, redrive: MapRunRedrive) -> set[int]:
    """The children the state machine's role may not redrive (states:RedriveExecution on each)."""
    from sdflow.local.iam_resources import Check
    from sdflow.local.services.iam import AccessDenied

    runtime = runtime_or_none()
    role_arn = getattr(env.aws_execution_details, "role_arn", None)
    if runtime is None or runtime.iam is None or not role_arn or not redrive.children:
        return set()
    keys = runtime.iam.credentials_for_role(role_arn, "StepFunctions")
    principal = runtime.iam.principal(keys["AWS_ACCESS_KEY_ID"])
    if principal is None:
        return set()
    denied = set()
    for index, child in redrive.children.items():
        try:
            runtime.iam.check(
                principal, [Check("states:RedriveExecution", child.arn, {"aws:securetransport": ["true"]})]
            )
        except AccessDenied as refusal:
            log.warning("Map Run %s: child not redriven: %s", redrive.record.map_run_arn, refusal)
            denied.add(index)
    return denied


def _reopen(record: Any, fresh: Any, redrive: MapRunRedrive, denied: set[int]) -> None:
    """The Map Run runs again: its counts restart from the children it keeps (succeeded, or
    failed for good because they may not be redriven)."""
    from moto.stepfunctions.parser.api import MapRunStatus
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.itemprocessor.map_run_record import (
        ExecutionCounter,
        ItemCounter,
    )

    record.sdflow_redrive_count = getattr(record, "sdflow_redrive_count", 0) + 1
    record.sdflow_redrive_date = current_clock().now()
    record.status, record.stop_date, record._sdflow_aborted_at = MapRunStatus.RUNNING, None, None
    record.max_concurrency = fresh.max_concurrency
    record.tolerated_failure_count = fresh.tolerated_failure_count
    record.tolerated_failure_percentage = fresh.tolerated_failure_percentage
    record.item_counter, record.execution_counter = ItemCounter(), ExecutionCounter()
    for counter in (record.item_counter, record.execution_counter):
        for kind in (counter.total, counter.succeeded, counter.results_written):
            kind.count(len(redrive.kept))
        counter.total.count(len(denied))
        counter.failed.count(len(denied))
    redrive.redo = [index for index in redrive.redo if index not in denied]
    for index in denied:
        redrive.children.pop(index)
    lock, finished = stepfunctions_map._children(record)
    redo = set(redrive.redo)
    with lock:
        finished[:] = [child for child in finished if child.index not in redo]


def _redrive_map_run(component: Any, env: Any, eval_input: Any, redrive: MapRunRedrive) -> None:
    """moto's DistributedIterationComponent._eval_body for a redrive: MapRunRedriven in place of
    MapRunStarted, the original items in place of the ItemReader, the kept outputs merged back."""
    from moto.stepfunctions.parser.api import (
        HistoryEventType,
        MapRunFailedEventDetails,
        MapRunRedrivenEventDetails,
        MapRunStatus,
    )
    from moto.stepfunctions.parser.asl.component.common.error_name.failure_event import FailureEventException
    from moto.stepfunctions.parser.asl.eval.event.event_detail import EventDetails
    from moto.stepfunctions.parser.asl.eval.event.event_manager import EventManager

    record = redrive.record
    redriven = MapRunRedrivenEventDetails(mapRunArn=record.map_run_arn, redriveCount=record.sdflow_redrive_count)
    env.event_manager.add_event(
        context=env.event_history_context,
        event_type=HistoryEventType.MapRunRedriven,
        event_details=EventDetails(mapRunRedrivenEventDetails=redriven),  # type: ignore[typeddict-item]
    )
    parent_event_manager = env.event_manager
    try:
        env.stack.append(RedriveItems(redrive))
        env.event_manager = EventManager()
        component._map_run(env=env, eval_input=eval_input)
    except Exception as failure:
        details = MapRunFailedEventDetails()
        pair = failure.extract_error_cause_pair() if isinstance(failure, FailureEventException) else None
        error, cause = pair or (None, None)
        if error:
            details["error"] = error
        if cause:
            details["cause"] = cause
        env.event_manager = parent_event_manager
        env.event_manager.add_event(
            context=env.event_history_context,
            event_type=HistoryEventType.MapRunFailed,
            event_details=EventDetails(mapRunFailedEventDetails=details),  # type: ignore[typeddict-item]
        )
        record.set_stop(status=MapRunStatus.FAILED)
        raise
    finally:
        env.event_manager = parent_event_manager
    rerun = dict(zip(redrive.redo, env.stack.pop(), strict=True))
    env.stack.append([redrive.kept[i] if i in redrive.kept else rerun.get(i) for i in range(len(redrive.items))])
    env.event_manager.add_event(context=env.event_history_context, event_type=HistoryEventType.MapRunSucceeded)
    record.set_stop(status=MapRunStatus.SUCCEEDED)


def sfn_map_run_body(inner: Any, self: Any, env: Any) -> None:
    """Wraps moto's DistributedIterationComponent._eval_body: the Distributed Map a redriven
    execution continues at redrives its Map Run. The pending redrive waits on the Map Run pool,
    which every frame of the execution shares (the Map itself runs in a frame)."""
    from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name_type import (
        StatesErrorNameType,
    )

    pool = env.map_run_record_pool_manager
    redrive: MapRunRedrive | None = getattr(pool, "sdflow_redrive", None)
    eval_input = env.stack[-1]
    execution_arn = env.states.context_object.context_object_data["Execution"]["Id"]
    if (
        redrive is None
        or eval_input.state_name != redrive.record.sdflow_state_name
        or execution_arn != redrive.record.execution_arn
    ):
        inner(self, env)
        return
    pool.sdflow_redrive = None
    env.stack.pop()
    fresh, record = eval_input.map_run_record, redrive.record
    pool._pool.pop(fresh.map_run_arn, None)  # the Map Run is not new
    if getattr(record, "sdflow_redrive_count", 0) >= MAX_MAP_RUN_REDRIVES:
        cause = f"The Map Run '{record.map_run_arn}' was redriven {MAX_MAP_RUN_REDRIVES} times, the most allowed"
        raise states_failure(env, StatesErrorNameType.StatesRuntime, cause, map_run=True)
    _reopen(record, fresh, redrive, _denied(env, redrive))
    eval_input.map_run_record = record
    _redrive_map_run(self, env, eval_input, redrive)


def patches() -> list[Patch]:
    import moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.distributed_iteration_component as component  # noqa: E501

    return [
        wrap(component.DistributedIterationComponent, "_eval_body", sfn_map_run_body),
        wrap(component.DistributedIterationComponent, "_map_run", sfn_map_run_items),
        wrap(component, "JobPool", sfn_job_pool),
    ]
