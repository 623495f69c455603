"""SageMaker's job operations for sdflow, one `JobApi` per job kind (it keeps the processing /
training spelling differences, operation and field names, in one place), and the lookups of a
task's earlier jobs by name (earlier_attempts, earlier_redrives). The start of a job, which uses
them, reads as one sequence in sdflow_common.job_start."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError

from sdflow_common import names, sagemaker_jobs
from sdflow_common.token_store import TokenStore

logger = Logger(child=True)


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


# WarmPoolStatus.Status values after which the warm pool is not this job's to end: another job
# reused it, or it is over (SageMaker API reference, WarmPoolStatus).
WARM_POOL_GONE = frozenset({"Reused", "Terminated"})


def end_warm_pool(sagemaker: Any, name: str) -> bool:
    """End the warm pool of training job `name`, if it asked for one that may still live: sets its
    retention to 0 (UpdateTrainingJob ResourceConfig.KeepAlivePeriodInSeconds, "to change warm
    pool retention length", API reference). A warm pool is kept when its job completes, is
    stopped after its cluster started or fails with an algorithm error, and is billed until its
    KeepAlivePeriodInSeconds runs out (SageMaker developer guide, "SageMaker AI Managed Warm Pools").
    False when there was nothing to end (no warm pool asked for, reused, already over, no such job)."""
    try:
        described = sagemaker.describe_training_job(TrainingJobName=name)
    except ClientError as exc:
        if sagemaker_jobs.is_not_found(exc):
            return False
        raise
    keep_alive = int((described.get("ResourceConfig") or {}).get("KeepAlivePeriodInSeconds") or 0)
    status = (described.get("WarmPoolStatus") or {}).get("Status")
    if keep_alive == 0 or status in WARM_POOL_GONE:
        return False
    sagemaker.update_training_job(TrainingJobName=name, ResourceConfig={"KeepAlivePeriodInSeconds": 0})
    logger.info("warm pool ended", extra={"job": name, "warm_pool_status": status})
    return True


def processing_jobs(sagemaker: Any) -> JobApi:
    return JobApi(sagemaker, "download job", names.DOWNLOAD_PREFIX, "ProcessingJob")


def evaluation_jobs(sagemaker: Any) -> JobApi:
    return JobApi(sagemaker, "evaluation job", names.EVALUATION_PREFIX, "ProcessingJob")


def dedup_jobs(sagemaker: Any) -> JobApi:
    return JobApi(sagemaker, "dedup job", names.DEDUP_PREFIX, "ProcessingJob")


def training_jobs(sagemaker: Any) -> JobApi:
    return JobApi(sagemaker, "training job", names.TRAINING_PREFIX, "TrainingJob")


def for_kind(sagemaker: Any, kind: str) -> JobApi | None:
    """The job API of a claim's kind (its label names the job in messages); None for what is no job (an
    endpoint deployment, an approval)."""
    factory = {
        "download": processing_jobs,
        "dedup": dedup_jobs,
        "evaluation": evaluation_jobs,
        "training": training_jobs,
    }.get(kind)
    return factory(sagemaker) if factory is not None else None


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
