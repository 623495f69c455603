"""Step Functions: each child workflow execution of a Distributed Map recorded as it runs, on its
Map Run's record (stepfunctions/map_runs.py). Wraps a Distributed Map child's evaluation (around
stepfunctions/map.py's wrapper of the same method; patching.WRAP_ORDER).

moto runs each Map item as a frame inside the parent's thread and keeps no record of it: here each
started child gets one (ARN, status, dates, input, output, error, cause) on its MapRunRecord."""

from __future__ import annotations

from typing import Any

from sdflow.local.patching import Patch, wrap
from sdflow.local.stepfunctions.map_runs import UNSET, MapRunChildren


def _children_of(worker: Any) -> MapRunChildren:
    record = worker._map_run_record
    runs = getattr(record, "_sdflow_children", None)
    if runs is None:
        fresh = MapRunChildren(record, worker._job_pool._jobs_number, getattr(worker, "_sdflow_standard", True))
        runs = vars(record).setdefault("_sdflow_children", fresh)  # atomic: workers race to create it
    return runs


def sfn_eval_child(inner: Any, self: Any, env: Any, job: Any) -> None:
    """Wraps moto's DistributedItemProcessorWorker._eval_job (…/itemprocessor/
    distributed_item_processor_worker.py): records the child execution and its outcome. After the
    parent stopped no further child starts (moto would run every remaining item into an error)."""

    runs = _children_of(self)
    if not env.is_running() or getattr(self._map_run_record, "_sdflow_aborted_at", None) is not None:
        job.job_output = None
        return
    redriven = getattr(job, "sdflow_redriven", None)  # set by stepfunctions/redrive_map.py
    child = runs.restart(redriven) if redriven is not None else runs.start(job.job_input, job.job_index)
    job.sdflow_child = child  # its name, for whatever else reports on this child (ResultWriter)
    try:
        inner(self, env, job)
    finally:
        runs.finish(child, env.program_state(), job.job_output, getattr(env, "sdflow_child_input", UNSET))


def sfn_create_child_worker(inner: Any, self: Any, env: Any, eval_input: Any, job_pool: Any) -> Any:
    """Wraps moto's DistributedItemProcessor._create_worker (…/itemprocessor/distributed_item_processor.py)
    to tell the worker its children's ExecutionType: only STANDARD children emit status events."""
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.execution_type import ExecutionType

    worker = inner(self, env, eval_input, job_pool)
    worker._sdflow_standard = self._processor_config.execution_type == ExecutionType.Standard
    return worker


def patches() -> list[Patch]:
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.itemprocessor.distributed_item_processor import (  # noqa: E501
        DistributedItemProcessor,
    )
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.itemprocessor.distributed_item_processor_worker import (  # noqa: E501
        DistributedItemProcessorWorker,
    )

    return [
        wrap(DistributedItemProcessorWorker, "_eval_job", sfn_eval_child),
        wrap(DistributedItemProcessor, "_create_worker", sfn_create_child_worker),
    ]
