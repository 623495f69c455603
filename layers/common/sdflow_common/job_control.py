"""What a starter and the reconciler do to a SageMaker job besides creating it: find a task's
earlier attempts still running and adopt one, stop a job, tell this run's job from another
run's by its tag, and stop a job created after the run ended. One `JobApi` per job kind keeps
the processing/training spelling differences (operation and field names) in one place."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError

from sdflow_common import names, sagemaker_jobs
from sdflow_common.errors import JobNameTaken, RunEnded, SageMakerThrottled, SdflowError
from sdflow_common.token_store import Claim, Kind, TokenStore

logger = Logger(child=True)

# ListProcessingJobs / ListTrainingJobs accept MaxResults 1..100.
LIST_PAGE_SIZE = 100


class CallbackTaskLike(Protocol):
    """What of a callback task's payload (job_starters.CallbackTask) the job's lifecycle needs."""

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
class JobApi:
    """One SageMaker job kind's operations, bound to a client."""

    sagemaker: Any
    label: str
    prefix: str
    noun: str  # "ProcessingJob" / "TrainingJob": the operations and fields are spelled from it

    @property
    def name_field(self) -> str:
        return f"{self.noun}Name"

    def _call(self, verb: str, suffix: str = "") -> Callable[..., dict[str, Any]]:
        snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in self.noun).lstrip("_")
        return getattr(self.sagemaker, f"{verb}_{snake}{suffix}")

    def create(self, request: Mapping[str, Any]) -> None:
        self._call("create")(**request)

    def describe(self, name: str) -> dict[str, Any] | None:
        """The job's description, or None when SageMaker does not know it."""
        try:
            return self._call("describe")(**{self.name_field: name})
        except ClientError as exc:
            if sagemaker_jobs.is_not_found(exc):
                return None
            raise

    def status(self, described: dict[str, Any]) -> str:
        return str(described.get(f"{self.noun}Status", ""))

    def arn(self, described: dict[str, Any]) -> str:
        return str(described[f"{self.noun}Arn"])

    def in_progress(self, name_contains: str) -> list[str]:
        """Names of InProgress jobs whose name contains the text (every page)."""
        call = self._call("list", "s")
        request: dict[str, Any] = {
            "NameContains": name_contains,
            "StatusEquals": "InProgress",
            "MaxResults": LIST_PAGE_SIZE,
        }
        found: list[str] = []
        while True:
            page = call(**request)
            found += [str(summary[self.name_field]) for summary in page.get(f"{self.noun}Summaries", [])]
            token = page.get("NextToken")
            if not token:
                return found
            request["NextToken"] = token

    def stop(self, name: str) -> bool:
        """Stop the job; False when it had ended already. SageMaker refuses to stop a job that is
        not InProgress with a ValidationException ("… the training job is in status Stopped.")."""
        try:
            self._call("stop")(**{self.name_field: name})
        except ClientError as exc:
            if sagemaker_jobs.error_code(exc) == "ValidationException" or sagemaker_jobs.is_not_found(exc):
                logger.info("job not in progress any more", extra={"job": name, "error": str(exc)})
                return False
            raise
        logger.info("job stopped", extra={"job": name})
        return True

    def run_tag(self, arn: str) -> str | None:
        """The job's `sdflow:run` tag (its run hash), or None when it has none."""
        paginator = self.sagemaker.get_paginator("list_tags")
        for page in paginator.paginate(ResourceArn=arn):
            for tag in page.get("Tags", []):
                if tag.get("Key") == sagemaker_jobs.TAG_RUN:
                    return str(tag.get("Value", ""))
        return None


def processing_jobs(sagemaker: Any) -> JobApi:
    return JobApi(sagemaker, "download job", names.DOWNLOAD_PREFIX, "ProcessingJob")


def evaluation_jobs(sagemaker: Any) -> JobApi:
    return JobApi(sagemaker, "evaluation job", names.EVALUATION_PREFIX, "ProcessingJob")


def training_jobs(sagemaker: Any) -> JobApi:
    return JobApi(sagemaker, "training job", names.TRAINING_PREFIX, "TrainingJob")


def _running(api: JobApi, candidates: set[str]) -> list[str]:
    """The candidates SageMaker describes as InProgress, newest (redrive, attempt) first."""
    found = []
    for other in sorted(candidates):
        described = api.describe(other)
        if described is not None and api.status(described) == "InProgress":
            found.append(other)
    return sorted(found, key=lambda other: names.counters_of(other) or (0, 0), reverse=True)


def earlier_attempts(api: JobApi, store: TokenStore, name: str, execution_arn: str) -> list[str]:
    """Names of the running jobs of the same task (same run, item and redrive) started by an
    attempt before the one `name` belongs to, newest first.

    Found by name, not by listing (ListProcessingJobs / ListTrainingJobs grow with every job the
    account ever ran and are throttled at low rates): one BatchGetItem of the claims on the earlier
    attempts' names, then a Describe of each claimed name and of the previous attempt's name. That
    is every job that can still run: a starter claims a name before it creates the job, so a
    started job keeps its claim (an adopted job keeps its own name and claim), and the only
    unclaimed job possible, a Create that went through while its call failed, is the previous
    attempt's (each attempt looks before it creates, so an earlier one would have been adopted)."""
    current = names.attempt_of(name)
    if not current:
        return []
    stem = name[: len(name) - len(str(current))]  # ends with "-a"
    earlier = [f"{stem}{attempt}" for attempt in range(current)]
    claimed = {record.resource_name for record in store.get_many(earlier) if record.execution_arn == execution_arn}
    return _running(api, claimed | {earlier[-1]})


def earlier_redrives(api: JobApi, store: TokenStore, name: str, execution_arn: str) -> list[str]:
    """Names of the running jobs of the same task started before the redrive `name` belongs to,
    newest first.

    A redrive re-runs its failed state from attempt 0 under new names (`-r<n>`), while the job
    the ended run was waiting on may still run: its cleanup skips a run that was redriven before
    it ran (it would stop the redrive's own jobs), and a lost end event or a failed stop leaves
    it too. Which attempt of which redrive started it is not known, so the run's claims are read
    (a scan of the token table, which holds one item per waiting task) and the claimed names of
    this task with an earlier redrive are described. A task has a claim for every job it started
    (the cleanup deletes a claim only when it stops everything); an adopted job keeps its old name.
    For the run's one training and one evaluation task only: a shard's download numbers its
    redrives with the Map child's count, and a scan per shard would read the table once per shard."""
    counters, key = names.counters_of(name), names.task_key(name)
    if counters is None or key is None or counters[0] == 0:
        return []
    claimed = {
        record.resource_name
        for record in store.for_execution(execution_arn)
        if names.task_key(record.resource_name) == key
        and (names.counters_of(record.resource_name) or counters)[0] < counters[0]
    }
    return _running(api, claimed)


def execution_status(sfn: Any, execution_arn: str) -> str:
    """DescribeExecution's `status`: RUNNING, SUCCEEDED, FAILED, TIMED_OUT, ABORTED or PENDING_REDRIVE."""
    return str(sfn.describe_execution(executionArn=execution_arn)["status"])


@dataclass(frozen=True)
class JobStart:
    """One job to start: what the claim, the request and the checks need."""

    store: TokenStore
    sfn: Any
    task: CallbackTaskLike
    api: JobApi
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


def adopt_earlier_attempt(start: JobStart) -> str | None:
    """Before an attempt creates a job, take over a job an earlier attempt (or, for training and
    evaluation, an earlier redrive) of the same task left running, and return its name.

    An earlier attempt's job still runs when its starter died after CreateProcessingJob /
    CreateTrainingJob (Runtime.ExitError, a killed worker) and the state retried the task; an
    earlier redrive's, when the run ended while its job ran and was redriven before its cleanup
    stopped the job. Adopting it beats stopping it and starting anew: its work goes on instead of
    starting over (for training, hours of instances), and exactly one job runs for the task, so no
    two jobs share the task's outputs. The claim moves to the new token (token_store takes over an
    earlier claim of the same execution); any further earlier job still running is stopped, so
    one remains. A job that ends between the lookup and the claim is answered by the reconciler (a
    download's a little before the task's deadline)."""
    running = earlier_attempts(start.api, start.store, start.name, start.task.execution_arn)
    if start.across_redrives:
        running += earlier_redrives(start.api, start.store, start.name, start.task.execution_arn)
    if not running:
        return None
    adopted, *others = sorted(running, key=lambda other: names.counters_of(other) or (0, 0), reverse=True)
    start.claim(adopted)
    for other in others:
        start.api.stop(other)
    logger.info(
        "earlier attempt's job adopted",
        extra={"resource_name": adopted, "attempt": start.task.attempt, "stopped": others},
    )
    return adopted


def adopt_existing(start: JobStart) -> None:
    """Create said "already exists" for a new claim: adopt the job only when it is this run's
    (its `sdflow:run` tag is this run's hash), else fail with JobNameTaken."""
    described = start.api.describe(start.name)
    tag = start.api.run_tag(start.api.arn(described)) if described is not None else None
    if tag == start.task.run_hash:
        logger.info("job already exists and is this run's; adopted", extra={"resource_name": start.name})
        return
    start.store.delete(start.name, token=start.task.token)
    owner = f"run {tag}" if tag else "no sdflow run (it has no sdflow:run tag)"
    raise JobNameTaken(
        f"{start.api.label} {start.name} exists already and belongs to {owner}, not to this run "
        f"({start.task.run_hash}); it was not adopted. SageMaker job names are unique per account and "
        "region for ever: start this run again under a new execution name."
    )


def check_run_still_running(start: JobStart) -> None:
    """Close the race with the run-ended cleanup: the cleanup stops the jobs it can list; a job
    created after it listed would run on. Create comes first and this check second, so either
    the cleanup saw the job or this sees the run ended; then the job is stopped here."""
    try:
        status = execution_status(start.sfn, start.task.execution_arn)
    except ClientError as exc:
        if sagemaker_jobs.is_throttling(exc):
            # The claim and the job stay: the retry's attempt adopts the job instead of a new one.
            raise SageMakerThrottled(
                f"Step Functions throttled DescribeExecution after {start.name} was created; "
                f"the retry adopts the job ({sagemaker_jobs.error_message(exc)})"
            ) from exc
        start.api.stop(start.name)
        start.store.delete(start.name, token=start.task.token)
        raise start.failure(
            f"could not confirm that the run still runs after creating {start.name}, so the job was stopped: "
            f"DescribeExecution of {start.task.execution_arn} answered {sagemaker_jobs.error_code(exc)}: "
            f"{sagemaker_jobs.error_message(exc)}"
        ) from exc
    if status == "RUNNING":
        return
    stopped = start.api.stop(start.name)
    start.store.delete(start.name, token=start.task.token)
    raise RunEnded(
        f"the run {start.task.execution_arn} is {status}: it ended while {start.name} was being created; "
        + ("the job was stopped" if stopped else "the job had ended already")
    )
