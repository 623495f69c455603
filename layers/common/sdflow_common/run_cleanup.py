"""Nothing left running that was looked for: what a run that FAILED, TIMED_OUT or was ABORTED leaves behind is
stopped or rolled back before the notification says so.

Step Functions ends an execution without touching what its tasks started: a processing or
training job runs on until its MaxRuntime, an endpoint deployment still completes. The run's
claims in the token table say what it started: a starter claims a job's name before it creates the
job (sdflow_common.job_start), and a claim goes only when its job has ended (job_events, the
reconciler) or was stopped. So, from one read of the run's claims:
1. every claimed SageMaker job of the run is stopped: downloads, the dedup job, the training job, the
   evaluation job (StopProcessingJob / StopTrainingJob by name), each only after its claim was deleted on the
   condition that it still holds the token read (a redrive that adopted the job holds it now:
   the job is the redrive's, and is left running). A job that ended already answers
   ValidationException ("The request was rejected because the training job is in status
   Stopped.", the documented refusal for a job not InProgress): nothing to do. No List* call:
   SageMaker keeps every job record for ever, so ListProcessingJobs / ListTrainingJobs grow with
   the account's history and are throttled at low rates (ListTrainingJobs: 2 a second, not
   adjustable, as users report it), where a 10,000-shard run's cleanup would page through
   thousands of names.
2. the run's endpoint deployment is rolled back (sdflow_common.rollback).
3. the run's other claims are deleted (their tokens died with the execution), except a deferred
   rollback's, which job_events needs when the endpoint settles; a job whose stop failed gets its
   claim back (unless the name was claimed again meanwhile): a redrive finds the job it may adopt
   by its claim (job_control.earlier_redrives), and the reconciler's pass still sees it.
Every step is idempotent and one item's error does not stop the others: the errors are
collected, reported, and raised by the caller after the rest is done, so the event is retried.

Before any of it, the execution is described: a redrive keeps the run's hash, so jobs and claims
of the run may belong to a redrive started since the end being cleaned up (the failure's
notification tells the user to redrive, and a cleanup retried by Lambda runs one to three minutes
later). If the execution runs again, or has been redriven more times than the end being cleaned
up, what runs now is the redrive's, with one exception: downloads that an earlier redrive started
are stopped (stop_earlier_redrive_downloads), as no redrive adopts them."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError

from sdflow_common import job_control, names, rollback, sagemaker_jobs
from sdflow_common.errors import SdflowError
from sdflow_common.token_store import TokenRecord, TokenStore

logger = Logger(child=True)

NAMES_SHOWN = 10


class CleanupIncomplete(SdflowError):
    """Some of a run's jobs or its endpoint could not be stopped or rolled back (the message
    lists each); the event is retried."""


@dataclass
class CleanupReport:
    stopped: dict[str, list[str]] = field(default_factory=dict)
    rollbacks: list[rollback.Rollback] = field(default_factory=list)
    claims_deleted: int = 0
    errors: list[str] = field(default_factory=list)
    # Set when a redrive started after the end being cleaned up: nothing was touched.
    superseded_by: str | None = None
    # What was looked at (job kinds listed, the endpoint claims read): all that a "nothing was
    # running" can be said of. A run may hold what the cleanup does not look for.
    checked: list[str] = field(default_factory=list)
    # Jobs whose stop failed: their claims are put back (module docstring, step 3).
    unstopped: set[str] = field(default_factory=set)
    # Job claims the stop step dealt with (released, or found taken over): not settled again.
    settled: set[str] = field(default_factory=set)
    # Jobs whose claims the stop step deleted: the run's, not a redrive's that took one over.
    released: set[str] = field(default_factory=set)
    # Training jobs whose warm pool the cleanup ended (KeepAlivePeriodInSeconds 0).
    warm_pools_ended: list[str] = field(default_factory=list)

    @property
    def stopped_count(self) -> int:
        return sum(len(jobs) for jobs in self.stopped.values())

    def lines(self) -> list[str]:
        """The notification's account of the cleanup, one finding a line."""
        parts = [_job_phrase(label, jobs) for label, jobs in self.stopped.items() if jobs]
        if self.superseded_by is not None:
            errors = [f"NOT cleaned up: {error}" for error in self.errors]
            if not parts:
                return [f"Nothing stopped: {self.superseded_by}; what runs now is the redrive's.", *errors]
            stopped = "; ".join(parts)
            return [
                f"Stopped: {stopped} an earlier redrive left running; the rest was left to the redrive: "
                f"{self.superseded_by}.",
                *errors,
            ]
        lines = []
        if parts:
            lines.append("Stopped: " + "; ".join(parts))
        lines.extend(
            f"Ended the warm pool of training job {name} (KeepAlivePeriodInSeconds 0)."
            for name in self.warm_pools_ended
        )
        lines.extend(item.text for item in self.rollbacks if item.outcome != "untouched")
        if not lines and self.checked:
            lines.append(f"None of this run's {_listed(self.checked)} was still running when checked.")
        lines.extend(f"NOT cleaned up: {error}" for error in self.errors)
        return lines

    def as_dict(self) -> dict[str, Any]:
        return {
            "stopped": self.stopped_count,
            "rollbacks": [item.outcome for item in self.rollbacks],
            "claims_deleted": self.claims_deleted,
            "errors": len(self.errors),
            "superseded": self.superseded_by is not None,
        }


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def _job_phrase(label: str, jobs: list[str]) -> str:
    shown = ", ".join(jobs[:NAMES_SHOWN])
    more = f" and {len(jobs) - NAMES_SHOWN} more" if len(jobs) > NAMES_SHOWN else ""
    noun = label if len(jobs) == 1 else f"{label}s"
    return f"{len(jobs)} {noun} ({shown}{more})"


def _cli_name(noun: str) -> str:
    """ "ProcessingJob" -> "processing-job", as the AWS CLI spells operations and options."""
    return re.sub(r"(?<!^)(?=[A-Z])", "-", noun).lower()


# The job kinds a claim can name, in the order the notification lists them.
JOB_APIS: dict[str, Callable[[Any], job_control.JobApi]] = {
    "download": job_control.processing_jobs,
    "dedup": job_control.dedup_jobs,
    "training": job_control.training_jobs,
    "evaluation": job_control.evaluation_jobs,
}
# What one read of the claims lets the cleanup say of the run (CleanupReport.checked).
CHECKED = ["download jobs", "dedup jobs", "evaluation jobs", "training jobs", "endpoint deployments"]


def _is_job_of_run(record: TokenRecord, run_hash: str) -> bool:
    """A claim on a job of this run. A claim on a name of another run of the same execution name
    (one started again after 90 days) is not this run's."""
    return record.kind in JOB_APIS and f"-{run_hash}-" in record.resource_name


def stop_jobs(
    records: list[TokenRecord],
    sagemaker: Any,
    store: TokenStore,
    run_hash: str,
    report: CleanupReport,
    *,
    kinds: tuple[str, ...] = tuple(JOB_APIS),
) -> None:
    """Stop every job of `kinds` the run's claims name (module docstring, step 1), in the
    notification's order."""
    for kind in kinds:
        api = JOB_APIS[kind](sagemaker)
        claimed = sorted(
            (r for r in records if r.kind == kind and _is_job_of_run(r, run_hash)), key=lambda r: r.resource_name
        )
        for record in claimed:
            _release_and_stop(api, record, store, report)


def _release_and_stop(api: job_control.JobApi, record: TokenRecord, store: TokenStore, report: CleanupReport) -> None:
    """Delete the claim on the condition that it still holds the token read, and stop the job only
    when that delete succeeded: a redrive adopts a job the ended run left running by taking over
    its claim (job_start), so a claim that changed hands since the read names a job that is the
    redrive's now. The delete and the takeover are both conditional writes of one item, so
    exactly one of them wins (DynamoDB API reference, DeleteItem / PutItem ConditionExpression)."""
    name = record.resource_name
    report.settled.add(name)
    if not store.delete(name, token=record.task_token):
        logger.info("claim changed hands or was released since it was read; job left alone", extra={"job": name})
        return
    report.claims_deleted += 1
    report.released.add(name)
    try:
        if api.stop(name):
            report.stopped.setdefault(api.label, []).append(name)
    except ClientError as exc:
        report.unstopped.add(name)
        noun = _cli_name(api.noun)
        report.errors.append(
            f"{api.label} {name} is still running ({exc}); stop it: "
            f"aws sagemaker stop-{noun} --{noun}-name {shlex.quote(name)}"
        )
        # The job runs on: its claim goes back, so a redrive and the reconciler still find it.
        try:
            if store.restore(record):
                report.claims_deleted -= 1
        except ClientError as restore_error:
            report.errors.append(f"the claim of {api.label} {name} could not be put back ({restore_error})")


def end_warm_pools(names_: list[str], sagemaker: Any, report: CleanupReport) -> None:
    """End the warm pool of each training job of the run (job_control.end_warm_pool): the ones
    the claims named, stopped or ended, and the one the run's state names (its claim went when it
    completed). A redrive that trains again starts a new job, so a warm pool left would only bill."""
    for name in sorted(set(names_)):
        try:
            if job_control.end_warm_pool(sagemaker, name):
                report.warm_pools_ended.append(name)
        except ClientError as exc:
            report.errors.append(
                f"the warm pool of training job {name} may still be billed ({exc}); end it: aws sagemaker "
                f"update-training-job --training-job-name {shlex.quote(name)} "
                "--resource-config KeepAlivePeriodInSeconds=0"
            )


def _settle_claim(record: TokenRecord, sagemaker: Any, store: TokenStore, report: CleanupReport) -> None:
    if record.kind == "endpoint":
        outcome = rollback.roll_back(record, sagemaker)
        report.rollbacks.append(outcome)
        if outcome.outcome == "manual":
            report.errors.append(outcome.text)
        if outcome.keeps_claim:
            _request_rollback(record, store)
            return
    if store.delete(record.resource_name, token=record.task_token):
        report.claims_deleted += 1


def _request_rollback(record: TokenRecord, store: TokenStore) -> None:
    try:
        store.update_context(
            record.resource_name, record.task_token, {rollback.ROLLBACK_KEY: rollback.ROLLBACK_REQUESTED}
        )
    except ClientError as exc:
        if sagemaker_jobs.error_code(exc) != "ConditionalCheckFailedException":
            raise
        # Another token holds the endpoint by now (a redrive's new attempt): not ours to undo.
        logger.info("endpoint claim changed hands; rollback not requested", extra={"endpoint": record.resource_name})


def settle_claims(records: list[TokenRecord], sagemaker: Any, store: TokenStore, report: CleanupReport) -> None:
    for record in records:
        if record.resource_name in report.settled:
            continue
        try:
            _settle_claim(record, sagemaker, store, report)
        except ClientError as exc:
            report.errors.append(f"{record.kind} {record.resource_name}: {exc}")


@dataclass(frozen=True)
class Supersession:
    """Why the end being cleaned up is no longer the execution's latest state, and the redrive
    count the execution has now."""

    reason: str
    redrive_count: int


def superseding_redrive(sfn: Any, execution_arn: str, redrive_count: int) -> Supersession | None:
    """Why the end of attempt `redrive_count` is no longer the execution's latest state, if it is not."""
    described = sfn.describe_execution(executionArn=execution_arn)
    current = int(described.get("redriveCount") or 0)
    if current > redrive_count:
        return Supersession(f"the run was redriven (redrive {current}) after this end", current)
    if described["status"] == "RUNNING":
        return Supersession("the run is running again (redriven) since this end", current)
    return None


def stop_earlier_redrive_downloads(
    records: list[TokenRecord], sagemaker: Any, store: TokenStore, run_hash: str, current: int, report: CleanupReport
) -> None:
    """A redrive re-runs each failed or aborted Map child under `-r<current>` names and adopts no
    download across redrives (a scan of the claims per shard would read the table once per shard),
    so a download an earlier redrive started and the ended run left running only downloads its
    shard a second time: it is stopped. Its Map child is not running (Step Functions stops a Map
    Run's children when the run fails, and a redrive restarts them as new child attempts). The
    training and evaluation jobs are left: the redrive adopts them (job_control.earlier_redrives)."""
    earlier = [
        record
        for record in records
        if record.kind == "download" and (names.counters_of(record.resource_name) or (current, 0))[0] < current
    ]
    stop_jobs(earlier, sagemaker, store, run_hash, report, kinds=("download",))


def clean_up_run(
    execution_arn: str,
    start_time: Any,
    *,
    sagemaker: Any,
    store: TokenStore,
    sfn: Any,
    redrive_count: int = 0,
    training_jobs: Sequence[str] = (),
) -> CleanupReport:
    """Stop, roll back and release everything of the run's attempt `redrive_count` (the end
    being cleaned up), and end the warm pools of its training jobs (`training_jobs`: those the
    run's state names, whose claims went when they ended); see the module docstring."""
    run_hash = names.run_hash(execution_arn, start_time)
    report = CleanupReport()
    superseded = superseding_redrive(sfn, execution_arn, redrive_count)
    records = _read_claims(store, execution_arn, run_hash, report)
    if superseded is not None:
        report.superseded_by = superseded.reason
        logger.info(
            "run redriven since it ended; cleanup skipped but for earlier redrives' downloads",
            extra={"reason": superseded.reason},
        )
        if records is not None:
            stop_earlier_redrive_downloads(records, sagemaker, store, run_hash, superseded.redrive_count, report)
        return report
    if records is None:
        return report
    report.checked.extend(CHECKED)
    stop_jobs(records, sagemaker, store, run_hash, report)
    claimed_training = [r.resource_name for r in records if r.kind == "training" and r.resource_name in report.released]
    end_warm_pools([*claimed_training, *training_jobs], sagemaker, report)
    settle_claims(records, sagemaker, store, report)
    logger.info("run cleaned up", extra={"run_hash": run_hash, **report.as_dict()})
    return report


def _read_claims(
    store: TokenStore, execution_arn: str, run_hash: str, report: CleanupReport
) -> list[TokenRecord] | None:
    try:
        return list(store.for_execution(execution_arn))
    except ClientError as exc:
        report.errors.append(
            f"could not read the run's task-token claims ({exc}), so nothing was stopped; its SageMaker jobs "
            f"are named with {run_hash}: aws sagemaker list-processing-jobs --name-contains {run_hash} "
            "--status-equals InProgress (and list-training-jobs)"
        )
        return None
