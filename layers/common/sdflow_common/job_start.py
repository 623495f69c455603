"""The start of one SageMaker job, read top to bottom in `start_job`:

1. **Find earlier jobs** (a retried attempt; for training and evaluation also a redrive): a job an
   earlier attempt or redrive of the same task left running is adopted (its claim moves to this
   task's token) instead of a second one created; any further one still running is stopped.
   Found by name (job_control.earlier_attempts / earlier_redrives), never by listing.
2. **Claim** the deterministic name → this task's token in the token table, before the job
   exists, so the job's events always find the token. A re-invoked Lambda (same attempt, same
   token) finds its claim and, when the job exists already, starts nothing.
3. **Create** the job. SageMaker's "already exists" is adopted only when the job carries this
   run's `sdflow:run` tag (JobNameTaken otherwise). A refusal (ClientError) releases the claim, so
   the state's retry starts clean. Any other error (a timeout, a dropped connection) keeps the
   claim: the job may exist, and the claim is how the cleanup, the reconciler and the next attempt
   find it.
4. **Check the run still runs**: the run-ended cleanup stops the jobs it finds in the run's
   claims; a job claimed after it read them would run on. The claim comes before Create and this
   check after it, so either the cleanup saw the claim or this check sees the run ended, and then
   the job is stopped here (RunEnded).

A refused call becomes the named error the state's Retry/Catch matches (`translate`): throttling →
SageMakerThrottled, an instance quota held by other jobs → SageMakerQuotaExceeded, a request larger
than the quota itself or anything else → the step's own failure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError

from sdflow_common import job_control, names, sagemaker_jobs
from sdflow_common.errors import (
    JobNameTaken,
    RunEnded,
    SageMakerQuotaExceeded,
    SageMakerThrottled,
    SdflowError,
    TokenConflict,
)
from sdflow_common.token_store import Claim, Kind, TokenStore

logger = Logger(child=True)


class CallbackTaskLike(Protocol):
    """What of a callback task's payload (job_starters.CallbackTask) a job's start needs."""

    @property
    def token(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def redrive(self) -> int: ...
    @property
    def execution_arn(self) -> str: ...
    @property
    def timeout_seconds(self) -> int: ...
    @property
    def run_hash(self) -> str: ...


@dataclass(frozen=True)
class JobStart:
    """One job to start: what the claim, the request and the checks need."""

    store: TokenStore
    sfn: Any
    task: CallbackTaskLike
    api: job_control.JobApi
    name: str
    # A CreateProcessingJob / CreateTrainingJob request (sagemaker_jobs' TypedDicts, or a plain dict).
    request: Mapping[str, Any]
    context: dict[str, str]
    failure: type[SdflowError]
    # The claim's kind when the API's default is not it (an evaluation is a processing job too).
    job_kind: Kind | None = None
    # Look for a job an earlier redrive of the task left running (earlier_redrives): training
    # and evaluation, the run's one job of each kind.
    across_redrives: bool = False

    @property
    def looks_for_earlier_jobs(self) -> bool:
        return self.task.attempt > 0 or (self.across_redrives and self.task.redrive > 0)

    @property
    def kind(self) -> Kind:
        if self.job_kind is not None:
            return self.job_kind
        return "download" if self.api.noun == "ProcessingJob" else "training"

    def claim(self, name: str) -> Claim:
        task = self.task
        return self.store.claim(
            name, task.token, task.execution_arn, self.kind, self.context, timeout_seconds=task.timeout_seconds
        )

    def release(self) -> None:
        """Delete this task's claim on the name (only if this token still holds it)."""
        self.store.delete(self.name, token=self.task.token)

    def refused(self, exc: ClientError, operation: str) -> SdflowError:
        return translate(exc, f"{operation}{self.api.noun}", self.name, self.failure)


def start_job(start: JobStart) -> dict[str, Any]:
    """Start (or adopt) the task's job; the module docstring gives the sequence."""
    if start.looks_for_earlier_jobs:
        adopted = _adopt_earlier_job(start)
        if adopted is not None:
            return {"resource_name": adopted, "created": False, "adopted": True}
    claim = start.claim(start.name)
    if not claim.new and _exists(start):
        logger.info("job already started by an earlier invocation", extra={"resource_name": start.name})
        return {"resource_name": start.name, "created": False}
    if not _create(start):
        return {"resource_name": start.name, "created": False}
    _check_run_still_running(start)
    logger.info("job started", extra={"resource_name": start.name, "kind": start.kind, "attempt": start.task.attempt})
    return {"resource_name": start.name, "created": True}


# ---------------------------------------------------------------------------- the steps


def _adopt_earlier_job(start: JobStart) -> str | None:
    """Step 1. An earlier attempt's job still runs when its starter died after Create
    (Runtime.ExitError, a killed worker) and the state retried the task; an earlier redrive's, when
    the run ended while its job ran and was redriven before its cleanup stopped the job. Adopting
    beats stopping and starting anew: its work goes on (for training, hours of instances), and
    exactly one job runs for the task, so no two jobs share the task's outputs. A job that ends
    between the lookup and the claim is answered by the reconciler."""
    try:
        running = job_control.earlier_attempts(start.api, start.store, start.name, start.task.execution_arn)
        if start.across_redrives:
            running += job_control.earlier_redrives(start.api, start.store, start.name, start.task.execution_arn)
        if not running:
            return None
        adopted, *others = sorted(running, key=lambda other: names.counters_of(other) or (0, 0), reverse=True)
        if not _take_claim(start, adopted):
            return None
        for other in others:
            start.api.stop(other)
    except ClientError as exc:
        raise start.refused(exc, "Describe") from exc
    logger.info(
        "earlier attempt's job adopted",
        extra={"resource_name": adopted, "attempt": start.task.attempt, "stopped": others},
    )
    return adopted


def _take_claim(start: JobStart, name: str) -> bool:
    """Move the earlier job's claim to this task. A job of an earlier redrive is taken only as
    its claim is held now (TokenStore.take_over): the ended run's cleanup deletes that claim on the
    condition of its token and then stops the job, so exactly one of the two wins the claim, and a
    claim gone is a job being stopped (False: this task starts its own). An earlier attempt of
    this redrive may be unclaimed (a Create that went through while its call failed); no cleanup
    acts on a running redrive's attempts."""
    held = start.store.get(name)
    counters = names.counters_of(name)
    if counters is not None and counters[0] == start.task.redrive:
        start.claim(name)
        return True
    if held is None or held.execution_arn != start.task.execution_arn:
        logger.info("earlier redrive's claim released by its cleanup; not adopted", extra={"resource_name": name})
        return False
    try:
        start.store.take_over(held, start.task.token, start.context, timeout_seconds=start.task.timeout_seconds)
    except TokenConflict:
        logger.info("earlier redrive's claim changed hands; not adopted", extra={"resource_name": name})
        return False
    return True


def _exists(start: JobStart) -> bool:
    """Step 2, a re-invoked Lambda: did an earlier invocation of this attempt create the job?"""
    try:
        return start.api.describe(start.name) is not None
    except ClientError as exc:
        # The claim stays: an earlier invocation may have created the job, whose event must still
        # find a token (a dead one is answered harmlessly by job_events).
        raise start.refused(exc, "Describe") from exc


def _create(start: JobStart) -> bool:
    """Step 3: True when this call created the job, False when it adopted this run's job of the
    same name."""
    try:
        start.api.create(start.request)
    except ClientError as exc:
        if sagemaker_jobs.is_already_exists(exc):
            _adopt_existing(start)
            return False
        # SageMaker answered: no job was created.
        start.release()
        raise start.refused(exc, "Create") from exc
    return True


def _adopt_existing(start: JobStart) -> None:
    """Create said "already exists" for a new claim: adopt the job only when it is this run's
    (its `sdflow:run` tag is this run's hash), else fail with JobNameTaken."""
    try:
        described = start.api.describe(start.name)
        tag = start.api.run_tag(start.api.arn(described)) if described is not None else None
    except ClientError as exc:
        # Whose job it is stays unknown: it must not answer this task, nor be stopped as this run's.
        start.release()
        raise start.refused(exc, "ListTags") from exc
    if tag == start.task.run_hash:
        logger.info("job already exists and is this run's; adopted", extra={"resource_name": start.name})
        return
    start.release()
    owner = f"run {tag}" if tag else "no sdflow run (it has no sdflow:run tag)"
    raise JobNameTaken(
        f"{start.api.label} {start.name} exists already and belongs to {owner}, not to this run "
        f"({start.task.run_hash}); it was not adopted. SageMaker job names are unique per account and "
        "region for ever: start this run again under a new execution name."
    )


def _check_run_still_running(start: JobStart) -> None:
    """Step 4 (see the module docstring)."""
    try:
        status = job_control.execution_status(start.sfn, start.task.execution_arn)
    except ClientError as exc:
        if sagemaker_jobs.is_throttling(exc):
            # The claim and the job stay: the retry's attempt adopts the job instead of a new one.
            raise SageMakerThrottled(
                f"Step Functions throttled DescribeExecution after {start.name} was created; "
                f"the retry adopts the job ({sagemaker_jobs.error_message(exc)})"
            ) from exc
        _stop_created(start)
        raise start.failure(
            f"could not confirm that the run still runs after creating {start.name}, so the job was stopped: "
            f"DescribeExecution of {start.task.execution_arn} answered {sagemaker_jobs.error_code(exc)}: "
            f"{sagemaker_jobs.error_message(exc)}"
        ) from exc
    if status == "RUNNING":
        return
    stopped = _stop_created(start)
    raise RunEnded(
        f"the run {start.task.execution_arn} is {status}: it ended while {start.name} was being created; "
        + ("the job was stopped" if stopped else "the job had ended already")
    )


def _stop_created(start: JobStart) -> bool:
    try:
        stopped = start.api.stop(start.name)
    except ClientError as exc:
        # Stopping failed; the claim stays, so the job's event still finds (and clears) it.
        raise start.refused(exc, "Stop") from exc
    start.release()
    return stopped


# ---------------------------------------------------------------------------- refusals


def refusal_text(exc: ClientError, operation: str, resource: str) -> str:
    code, message = sagemaker_jobs.error_code(exc), sagemaker_jobs.error_message(exc)
    return f"SageMaker refused {operation} for {resource}: {code}: {message}"


def _quota_error(exc: ClientError, operation: str, resource: str, failure: type[SdflowError]) -> SdflowError:
    refusal = sagemaker_jobs.quota_refusal(exc)
    if refusal is not None and refusal.never_fits:
        # No job ending can free enough instances: retrying for hours would only delay the answer.
        return failure(
            f"{refusal_text(exc, operation, resource)}; the quota '{refusal.quota_name}' ({refusal.limit:g}) is "
            f"smaller than this one request ({refusal.requested:g}): request an increase in the Service "
            "Quotas console (service Amazon SageMaker), or choose an instance type or count that fits it"
        )
    return SageMakerQuotaExceeded(
        refusal_text(exc, operation, resource) + " (instances held by other jobs; retrying until they free up)"
    )


def translate(exc: ClientError, operation: str, resource: str, failure: type[SdflowError]) -> SdflowError:
    """The named error Step Functions' Retry/Catch matches for a refused call."""
    if sagemaker_jobs.is_quota_exceeded(exc):
        return _quota_error(exc, operation, resource, failure)
    if sagemaker_jobs.is_throttling(exc):
        return SageMakerThrottled(refusal_text(exc, operation, resource) + " (retrying with a new attempt)")
    return failure(refusal_text(exc, operation, resource))
