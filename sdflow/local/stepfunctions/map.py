"""Step Functions: the Distributed Map's tolerated failure threshold and ResultWriter, as AWS has them.

- Tolerated failure threshold (https://docs.aws.amazon.com/step-functions/latest/dg/maprun-fail-threshold.html):
  the failed share is "the total number of failed or timed out items divided by the total
  number of items"; with neither ToleratedFailureCount nor ToleratedFailurePercentage (nor their
  *Path forms) "the workflow fails if any one of its child workflow executions fails or times
  out"; with both, it fails when either is exceeded. The error is
  States.ExceedToleratedFailureThreshold, cause "The specified tolerated failure threshold was
  exceeded" (as LocalStack recorded it against AWS). moto records the thresholds and ignores them.
- ResultWriter (https://docs.aws.amazon.com/step-functions/latest/dg/input-output-resultwriter.html):
  the children's results go to `<Prefix>/<MapRun id>/` as SUCCEEDED_0.json / FAILED_0.json /
  PENDING_0.json (a JSON array per status, each child with ExecutionArn, Input, Name, Output or
  Error and Cause, dates, StateMachineArn, Status) and a manifest.json listing them
  ({DestinationBucket, MapRunArn, ResultFiles: {FAILED, PENDING, SUCCEEDED: [{Key, Size}]}}); the
  Map state's result is only {MapRunArn, ResultWriterDetails: {Bucket, Key}}. moto writes an
  empty manifest. A bucket it cannot write to is States.ResultWriterFailed.
  WriterConfig is not supported: moto's ASL grammar rejects it."""

from __future__ import annotations

import datetime as dt
import json
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from sdflow.local.patching import Patch, replace, wrap
from sdflow.local.runtime import current_clock
from sdflow.local.stepfunctions.interpreter import states_failure
from sdflow.local.stepfunctions.limits import check_map_result

EXCEEDED_CAUSE = "The specified tolerated failure threshold was exceeded"


@dataclass
class ChildRecord:
    """One Distributed Map child execution, as ResultWriter reports it."""

    index: int
    name: str
    input: Any
    start: dt.datetime
    stop: dt.datetime
    status: str  # SUCCEEDED | FAILED | TIMED_OUT | ABORTED
    output: Any = None
    error: str | None = None
    cause: str | None = None


def _children(map_run_record: Any) -> tuple[threading.Lock, list[ChildRecord]]:
    children = getattr(map_run_record, "sdflow_children", None)
    if children is None:  # created before the workers start: no race
        children = map_run_record.sdflow_children = (threading.Lock(), [])
    return children


def sfn_map_from_state_props(inner: Any, self: Any, state_props: Any) -> None:
    """Wraps moto's StateMap.from_state_props: remembers which thresholds the definition gives,
    since moto fills in 0 for an absent one and an absent threshold must not apply."""
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.tolerated_failure import (
        ToleratedFailureCountDecl,
        ToleratedFailurePercentageDecl,
    )

    inner(self, state_props)
    self.sdflow_thresholds_given = (
        state_props.get(ToleratedFailureCountDecl) is not None,
        state_props.get(ToleratedFailurePercentageDecl) is not None,
    )


def sfn_map_eval_execution(inner: Any, self: Any, env: Any) -> None:
    """Wraps moto's StateMap._eval_execution: tells the Map Run which state it belongs to (the
    iteration runs on this same frame) and bounds the collected result (stepfunctions/limits.py)."""

    env.sdflow_map_state = self
    env.sdflow_map_input = env.stack[-1] if env.stack else env.states.get_input()
    inner(self, env)
    check_map_result(env, self)


def threshold_exceeded(map_state: Any, map_run_record: Any) -> bool:
    counter = map_run_record.item_counter
    failed = counter.failed.get() + counter.timed_out.get()
    if failed == 0:
        return False
    count_given, percentage_given = getattr(map_state, "sdflow_thresholds_given", (False, False))
    if not (count_given or percentage_given):
        return True
    total = max(counter.total.get(), 1)
    return (count_given and failed > map_run_record.tolerated_failure_count) or (
        percentage_given and failed * 100.0 / total > map_run_record.tolerated_failure_percentage
    )


def _exceeded_error(env: Any) -> Exception:
    from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name_type import (
        StatesErrorNameType,
    )

    return states_failure(env, StatesErrorNameType.StatesExceedToleratedFailureThreshold, EXCEEDED_CAUSE, map_run=True)


def sfn_map_run(inner: Any, self: Any, env: Any, eval_input: Any) -> None:
    """Wraps moto's DistributedIterationComponent._map_run: after every child ended, the Map Run
    fails with States.ExceedToleratedFailureThreshold when its failures exceed the threshold
    (AWS may also stop early; ending them all first is allowed: "Step Functions may continue to
    run child workflows ... after the tolerated failure threshold is exceeded")."""

    record = eval_input.map_run_record
    _children(record)
    env.sdflow_map_run_record = record
    inner(self, env, eval_input)
    map_state = getattr(env, "sdflow_map_state", None)
    # A stopped execution aborts its Map Run; its aborted children are not failures to count.
    if map_state is not None and env.is_running() and threshold_exceeded(map_state, record):
        raise _exceeded_error(env)


def sfn_child_input(inner: Any, self: Any, env_frame: Any) -> None:
    """Wraps moto's InlineItemProcessorWorker._eval_input for Distributed Map workers: keeps the
    child's input (after ItemSelector) for ResultWriter's `Input`."""

    inner(self, env_frame)
    env_frame.sdflow_child_input = env_frame.states.get_input()


def sfn_child_job(inner: Any, self: Any, env: Any, job: Any) -> None:
    """Wraps moto's DistributedItemProcessorWorker._eval_job: records each child's outcome."""
    from moto.stepfunctions.parser.asl.eval.program_state import ProgramError, ProgramStopped, ProgramTimedOut

    start = current_clock().now()
    inner(self, env, job)
    state = env.program_state()
    child = ChildRecord(
        index=job.job_index,
        name=getattr(getattr(job, "sdflow_child", None), "name", None) or str(uuid.uuid4()),
        input=getattr(env, "sdflow_child_input", job.job_input),
        start=start,
        stop=current_clock().now(),
        status="SUCCEEDED",
        output=job.job_output,
    )
    if isinstance(state, ProgramError):
        child.status, child.output = "FAILED", None
        child.error, child.cause = (state.error or {}).get("error"), (state.error or {}).get("cause")
    elif isinstance(state, ProgramStopped):
        child.status = "ABORTED"
    elif isinstance(state, ProgramTimedOut):
        child.status = "TIMED_OUT"
    lock, children = _children(self._map_run_record)
    with lock:
        children.append(child)


def _iso(moment: dt.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _child_entry(child: ChildRecord, map_run_record: Any) -> dict[str, Any]:
    """One entry of a result file with ResultWriter's default Transformation NONE."""
    machine = map_run_record.map_state_machine_arn
    entry: dict[str, Any] = {
        "ExecutionArn": f"{machine.replace(':stateMachine:', ':execution:', 1)}:{child.name}",
        "Input": json.dumps(child.input, separators=(",", ":"), ensure_ascii=False),
        "InputDetails": {"Included": True},
        "Name": child.name,
    }
    if child.status == "SUCCEEDED":
        entry["Output"] = json.dumps(child.output, separators=(",", ":"), ensure_ascii=False)
        entry["OutputDetails"] = {"Included": True}
    else:
        entry["Error"], entry["Cause"] = child.error or "", child.cause or ""
    entry.update(StartDate=_iso(child.start), StateMachineArn=machine, Status=child.status, StopDate=_iso(child.stop))
    return entry


def _result_writer_failed(env: Any, cause: str) -> Exception:
    from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name_type import (
        StatesErrorNameType,
    )

    return states_failure(env, StatesErrorNameType.StatesResultWriterFailed, cause)


def result_files(map_run_record: Any) -> dict[str, list[dict[str, Any]]]:
    """The children's entries grouped the way ResultWriter files them, in item order."""
    lock, children = _children(map_run_record)
    with lock:
        ordered = sorted(children, key=lambda child: child.index)
    groups: dict[str, list[dict[str, Any]]] = {"FAILED": [], "PENDING": [], "SUCCEEDED": []}
    for child in ordered:
        groups["SUCCEEDED" if child.status == "SUCCEEDED" else "FAILED"].append(_child_entry(child, map_run_record))
    return groups


def sfn_result_writer_eval(self: Any, env: Any) -> None:
    """Replaces moto's ResultWriter._eval_body (result_writer/result_writer_decl.py).

    moto evaluates the writer's Parameters against the collected results, so "Bucket.$":
    "$.config.bucket" fails with States.Runtime; on AWS such paths select from the Map state's
    input, like ItemReader's."""
    results = env.stack.pop()
    env.stack.append(getattr(env, "sdflow_map_input", env.states.get_input()))
    self.parargs.eval(env=env)
    parameters = env.stack.pop()
    env.stack[-1] = results
    env.stack.append(parameters)
    self.resource_eval.eval_resource(env=env)


def sfn_result_writer_put_object(env: Any, resource_runtime_part: Any, state_credentials: Any) -> None:
    """Replaces moto's ResourceEvalS3._handle_put_object (result_writer/resource_eval/resource_eval_s3.py),
    which writes a manifest listing no files and drops the results."""
    from botocore.exceptions import ClientError
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.result_writer.resource_eval.resource_eval_s3 import (  # noqa: E501
        ResourceEvalS3,
    )

    parameters = env.stack.pop()
    env.stack.pop()  # the collected outputs: never part of the state's data with a ResultWriter
    record = getattr(env, "sdflow_map_run_record", None) or env.map_run_record_pool_manager.get_all().pop()
    bucket, prefix = parameters["Bucket"], parameters.get("Prefix") or ""
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    folder = f"{prefix}{record.map_run_arn.split(':')[-1]}/"
    s3 = ResourceEvalS3._get_s3_client(resource_runtime_part=resource_runtime_part, state_credentials=state_credentials)
    manifest: dict[str, Any] = {"DestinationBucket": bucket, "MapRunArn": record.map_run_arn, "ResultFiles": {}}
    try:
        for status, entries in result_files(record).items():
            manifest["ResultFiles"][status] = []
            if not entries:
                continue
            body = json.dumps(entries, ensure_ascii=False).encode("utf-8")
            key = f"{folder}{status}_0.json"
            s3.put_object(Bucket=bucket, Key=key, Body=body)
            manifest["ResultFiles"][status].append({"Key": key, "Size": len(body)})
        s3.put_object(Bucket=bucket, Key=f"{folder}manifest.json", Body=json.dumps(manifest).encode("utf-8"))
    except ClientError as error:
        raise _result_writer_failed(
            env, f"Failed to write the Map Run's results to s3://{bucket}/{folder}: {error}"
        ) from error
    env.stack.append(
        {"MapRunArn": record.map_run_arn, "ResultWriterDetails": {"Bucket": bucket, "Key": f"{folder}manifest.json"}}
    )


def patches() -> list[Patch]:
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.distributed_iteration_component import (
        DistributedIterationComponent,
    )
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.itemprocessor.distributed_item_processor_worker import (  # noqa: E501
        DistributedItemProcessorWorker,
    )
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.result_writer.resource_eval.resource_eval_s3 import (  # noqa: E501
        ResourceEvalS3,
    )
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.result_writer.result_writer_decl import (
        ResultWriter,
    )
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.state_map import StateMap

    return [
        replace(ResultWriter, "_eval_body", sfn_result_writer_eval),
        wrap(StateMap, "from_state_props", sfn_map_from_state_props),
        wrap(StateMap, "_eval_execution", sfn_map_eval_execution),
        wrap(DistributedIterationComponent, "_map_run", sfn_map_run),
        wrap(DistributedItemProcessorWorker, "_eval_input", sfn_child_input),
        wrap(DistributedItemProcessorWorker, "_eval_job", sfn_child_job),
        replace(ResourceEvalS3, "_handle_put_object", staticmethod(sfn_result_writer_put_object)),
    ]
