"""Resolve tokens whose SageMaker event never arrived, and stop jobs that outlived their task.

EventBridge delivery is reliable but not guaranteed end to end (a disabled rule, a throttled
Lambda that ran out of retries). Every claim carries its task's deadline (the claim time plus
the task's TimeoutSeconds), and the reconciler looks only at claims whose deadline is near
(within RECONCILE_LEAD_SECONDS) or past: on the normal path, where the event resolves the
token long before, it makes no SageMaker call at all (not one Describe per shard and period).
For a due claim it describes the resource:
- terminal → the token is resolved through job_events' TaskResolver, the same path a real event
  takes; the lead means a finished job whose event was lost still answers a live task;
- a job still running after its deadline → the task has timed out, so nothing will ever use the
  job: it is stopped and its token failed with the step's error;
- an endpoint still changing after its deadline cannot be stopped: its claim stays, and its
  state-change event (or a later pass) finds the dead token and rolls the deployment back;
- anything else is left for a later pass.
Claims other than downloads (a run's dedup, training, evaluation, endpoint and approval: a few per run)
are described every period, whatever their deadline: a lost "Completed" event of a training job
would otherwise hold the run until the deadline's lead, about a day for a default training job.
Download claims (thousands in a big run) wait for their deadline's lead, as above.
Then, from the same read of the table and a listing of the pipeline's recently ended executions
(a run that ends holding no claim: a success, a gate failure at Register model), runs whose end
event was lost are handed to notify again (sdflow_common.lost_ends). The claims as they were
before the pass: a stopped run whose training job then ended has its last claim settled by the
pass (a dead token), and a read after it would no longer see the run whose end needs handling."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError

from sdflow_common import aws, job_control, lost_ends, sagemaker_jobs
from sdflow_common.errors import ReconcileIncomplete
from sdflow_common.job_events import (
    DETAIL_MODELS,
    FAILURE_ERRORS,
    JobDetail,
    ModelPackageDetail,
    ProcessingJobDetail,
    TaskResolver,
    TrainingJobDetail,
)
from sdflow_common.settings import Settings
from sdflow_common.token_store import TokenRecord, TokenStore

logger = Logger(child=True)


@dataclass
class ReconcileReport:
    checked: int = 0
    resolved: int = 0
    pending: int = 0
    vanished: int = 0
    stopped: int = 0
    runs_closed: int = 0
    errors: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {
            "checked": self.checked,
            "resolved": self.resolved,
            "pending": self.pending,
            "vanished": self.vanished,
            "stopped": self.stopped,
            "runs_closed": self.runs_closed,
            "errors": len(self.errors),
        }

    def raise_for_errors(self) -> None:
        """Surface failures after every claim had its turn (one bad item must not starve the rest)."""
        if self.errors:
            shown = "; ".join(self.errors[:5])
            raise ReconcileIncomplete(f"{len(self.errors)} claim(s) could not be reconciled: {shown}")


def _describer(sagemaker: Any, record: TokenRecord) -> Callable[[], dict[str, Any]]:
    name = record.resource_name
    model = DETAIL_MODELS[record.kind]
    if model is ProcessingJobDetail:
        return lambda: sagemaker.describe_processing_job(ProcessingJobName=name)
    if model is TrainingJobDetail:
        return lambda: sagemaker.describe_training_job(TrainingJobName=name)
    if model is ModelPackageDetail:
        return lambda: sagemaker.describe_model_package(ModelPackageName=name)
    return lambda: sagemaker.describe_endpoint(EndpointName=name)


def detail_from_description(record: TokenRecord, described: dict[str, Any]) -> JobDetail:
    """Describe* responses have the same field names as the events' detail."""
    return DETAIL_MODELS[record.kind].model_validate(described)


def _stop_overdue(
    record: TokenRecord, detail: JobDetail, resolver: TaskResolver, sagemaker: Any, report: ReconcileReport
) -> None:
    """A job still running after its task's deadline: the task timed out, nobody will use the job."""
    if record.kind == "approval":
        # Nobody decided in time: the task has timed out (the run failed with States.Timeout); the
        # claim goes, and a later decision finds no task to answer.
        cause = f"model package {record.resource_name} was still {detail.status} at its task's deadline"
        resolver.fail(record, FAILURE_ERRORS[record.kind], cause, detail.status)
        report.stopped += 1
        return
    api = job_control.for_kind(sagemaker, record.kind)
    if api is None:
        # An endpoint change cannot be stopped; its settling event rolls it back (see the module docstring).
        logger.warning("endpoint deployment outlived its task", extra={"endpoint": record.resource_name})
        report.pending += 1
        return
    if detail.status == "InProgress":
        api.stop(record.resource_name)
    cause = (
        f"{api.label} {record.resource_name} was still {detail.status} after its task's timeout "
        f"(deadline epoch {record.deadline}): it outlived its task, so the reconciler stopped it"
    )
    resolver.fail(record, FAILURE_ERRORS[record.kind], cause, detail.status)
    report.stopped += 1
    if record.kind == "training":
        _end_warm_pool(sagemaker, record.resource_name, report)


def _end_warm_pool(sagemaker: Any, name: str, report: ReconcileReport) -> None:
    """A stopped job keeps its warm pool, billed; once its claim has gone here, the run's cleanup
    does not see the job, so it is ended now. A refusal is reported (the task is answered)."""
    try:
        job_control.end_warm_pool(sagemaker, name)
    except ClientError as exc:
        report.errors.append(
            f"{name}: its warm pool may still be billed ({exc}); end it: aws sagemaker update-training-job "
            f"--training-job-name {name} --resource-config KeepAlivePeriodInSeconds=0"
        )


def reconcile_one(
    record: TokenRecord, resolver: TaskResolver, sagemaker: Any, report: ReconcileReport, now: float
) -> None:
    try:
        described = _describer(sagemaker, record)()
    except ClientError as exc:
        if not sagemaker_jobs.is_not_found(exc):
            raise
        cause = (
            f"{record.kind} resource {record.resource_name} vanished: SageMaker no longer knows it "
            f"({sagemaker_jobs.error_message(exc)}); found by the reconciler"
        )
        resolver.fail(record, FAILURE_ERRORS[record.kind], cause, "NotFound")
        report.vanished += 1
        return
    detail = detail_from_description(record, described)
    if not detail.is_terminal() and now >= record.deadline:
        _stop_overdue(record, detail, resolver, sagemaker, report)
        return
    endpoint = described if record.kind == "endpoint" else None
    resolution = resolver.resolve(detail, described_endpoint=endpoint)
    if resolution.outcome in ("succeeded", "failed", "stale_token"):
        report.resolved += 1
        logger.info("missed event reconciled", extra=resolution.as_dict())
    else:
        report.pending += 1


def _is_due(record: TokenRecord, horizon: float) -> bool:
    """Downloads wait for their deadline's lead; the run's other claims are looked at every period."""
    return record.kind != "download" or record.deadline <= horizon


def reconcile(
    records: list[TokenRecord],
    resolver: TaskResolver,
    sagemaker: Any,
    lead_seconds: int,
    *,
    clock: Callable[[], float] = time.time,
) -> ReconcileReport:
    """Look at the claims that are due (see the module docstring)."""
    report = ReconcileReport()
    now = clock()
    for record in records:
        if not _is_due(record, now + lead_seconds):
            continue
        report.checked += 1
        try:
            reconcile_one(record, resolver, sagemaker, report, now)
        except Exception as exc:
            logger.exception("could not reconcile claim", extra={"resource_name": record.resource_name})
            report.errors.append(f"{record.resource_name}: {type(exc).__name__}: {exc}")
    logger.info("reconciliation done", extra=report.counts())
    return report


def close_lost_ends(
    records: list[TokenRecord],
    sfn: Any,
    lambda_client: Any,
    notify_function: str,
    report: ReconcileReport,
    state_machine_arn: str = "",
) -> None:
    """Hand notify the end of every run whose end event was lost: runs that still hold claims,
    and runs that ended recently holding none (sdflow_common.lost_ends)."""
    try:
        now = time.time()
        runs = set(lost_ends.runs_with_claims(records))
        if state_machine_arn:
            runs.update(lost_ends.recently_ended(sfn, state_machine_arn, now=now))
        closed = lost_ends.close_lost_ends(
            sorted(runs),
            sfn=sfn,
            lambda_client=lambda_client,
            notify_function=notify_function,
            now=now,
        )
    except Exception as exc:
        logger.exception("could not look for runs whose end event was lost")
        report.errors.append(f"runs whose end event was lost: {type(exc).__name__}: {exc}")
        return
    report.runs_closed = len(closed)


def run(settings: Settings) -> ReconcileReport:
    """The scheduled entry point: clients and store from the function's environment."""
    settings.require("token_table", "notify_function")
    store = TokenStore.from_settings(settings)
    sagemaker = aws.client("sagemaker")
    sfn = aws.client("stepfunctions")
    resolver = TaskResolver(store, sfn, sagemaker)
    records = list(store.all_claims())  # one read a period, for the pass and the lost ends
    report = reconcile(records, resolver, sagemaker, settings.reconcile_lead_seconds)
    close_lost_ends(records, sfn, aws.client("lambda"), settings.notify_function, report, settings.state_machine_arn)
    return report
