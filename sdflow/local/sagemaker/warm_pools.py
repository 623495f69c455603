"""SageMaker managed warm pools on the local cloud: DescribeTrainingJob's WarmPoolStatus and
UpdateTrainingJob's retention (moto 5.2.5 has no UpdateTrainingJob and no WarmPoolStatus).

On AWS (SageMaker developer guide, "SageMaker AI Managed Warm Pools"), a training job whose
ResourceConfig carries KeepAlivePeriodInSeconds > 0 keeps its instances once it has ended (it
completed, was stopped after its cluster started, or failed with an algorithm error): its
WarmPoolStatus is Available for KeepAlivePeriodInSeconds, then Terminated, and it is billed
meanwhile. UpdateTrainingJob's ResourceConfig.KeepAlivePeriodInSeconds changes that retention
("to change warm pool retention length", API reference); 0 ends the warm pool. The local cloud
keeps no instances: the status is computed from the job's end and its retention, as AWS would
report it. Not modelled: a matching job reusing the pool (Reused / InUse)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sdflow.local.patching import Patch, add, wrap
from sdflow.local.runtime import current_clock
from sdflow.local.sagemaker import limits

ENDED = ("Completed", "Stopped", "Failed")
# Set on moto's FakeTrainingJob when UpdateTrainingJob ends the warm pool.
_TERMINATED = "_sdflow_warm_pool_terminated"


def warm_pool_status(job: Any, now: dt.datetime) -> str | None:
    """WarmPoolStatus.Status of a moto FakeTrainingJob: None while it runs or when it asked for no warm pool."""
    keep_alive = int((job.resource_config or {}).get("KeepAlivePeriodInSeconds") or 0)
    if job.training_job_status not in ENDED or (keep_alive == 0 and not getattr(job, _TERMINATED, False)):
        return None
    ended = job.training_end_time or job.last_modified_time
    if isinstance(ended, dt.datetime) and ended.tzinfo is None:
        ended = ended.replace(tzinfo=dt.UTC)
    if getattr(job, _TERMINATED, False) or not isinstance(ended, dt.datetime):
        return "Terminated"
    return "Available" if now < ended + dt.timedelta(seconds=keep_alive) else "Terminated"


def sagemaker_describe_training_job(inner: Any, self: Any) -> Any:
    """Wraps moto/sagemaker/responses.py SageMakerResponse.describe_training_job to add WarmPoolStatus."""
    from moto.core.responses import ActionResult

    answer = inner(self)
    described = answer.result if isinstance(answer, ActionResult) else None
    job = self.sagemaker_backend.training_jobs.get(self._get_param("TrainingJobName"))
    if not isinstance(described, dict) or job is None:
        return answer
    status = warm_pool_status(job, current_clock().now())
    if status is None:
        return answer
    return ActionResult({**described, "WarmPoolStatus": {"Status": status}})


def sagemaker_update_training_job(self: Any) -> Any:
    """Adds SageMakerResponse.update_training_job (moto 5.2.5 has none): the warm pool's
    retention. ResourceNotFound for an unknown job (the API reference's error for it); the
    service model's range (KeepAlivePeriodInSeconds 0 to 21600) refused as ValidationException."""
    from moto.core.responses import ActionResult

    from sdflow.local.sagemaker.service import job_or_error

    request = {key: self._get_param(key) for key in ("TrainingJobName", "ResourceConfig") if self._get_param(key)}
    limits.check("UpdateTrainingJob", request)
    name = request.get("TrainingJobName", "")
    job = job_or_error(self.sagemaker_backend.training_jobs, name, "training job", self)
    resources = request.get("ResourceConfig")
    if resources is not None and "KeepAlivePeriodInSeconds" in resources:
        keep_alive = int(resources["KeepAlivePeriodInSeconds"])
        job.resource_config = {**(job.resource_config or {}), "KeepAlivePeriodInSeconds": keep_alive}
        if keep_alive == 0:
            setattr(job, _TERMINATED, True)
    return ActionResult({"TrainingJobArn": job.arn})


def patches() -> list[Patch]:
    from moto.sagemaker.responses import SageMakerResponse

    return [
        wrap(SageMakerResponse, "describe_training_job", sagemaker_describe_training_job),
        add(SageMakerResponse, "update_training_job", sagemaker_update_training_job),
    ]
