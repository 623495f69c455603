"""Resolve tokens whose SageMaker event never arrived.

EventBridge delivery is reliable but not guaranteed end to end (a disabled rule, a throttled
Lambda that ran out of retries). Every few minutes this looks at claims older than
RECONCILE_AFTER_SECONDS, describes their resource and, when it is terminal, resolves the
token through job_events' TaskResolver: the same path a real event takes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError

from sdflow_common import aws, sagemaker_jobs
from sdflow_common.errors import ReconcileIncomplete
from sdflow_common.job_events import (
    FAILURE_ERRORS,
    EndpointDetail,
    JobDetail,
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
    errors: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {
            "checked": self.checked,
            "resolved": self.resolved,
            "pending": self.pending,
            "vanished": self.vanished,
            "errors": len(self.errors),
        }

    def raise_for_errors(self) -> None:
        """Surface failures after every claim had its turn (one bad item must not starve the rest)."""
        if self.errors:
            shown = "; ".join(self.errors[:5])
            raise ReconcileIncomplete(f"{len(self.errors)} claim(s) could not be reconciled: {shown}")


def _describer(sagemaker: Any, record: TokenRecord) -> Callable[[], dict[str, Any]]:
    name = record.resource_name
    if record.kind == "download":
        return lambda: sagemaker.describe_processing_job(ProcessingJobName=name)
    if record.kind == "training":
        return lambda: sagemaker.describe_training_job(TrainingJobName=name)
    return lambda: sagemaker.describe_endpoint(EndpointName=name)


def detail_from_description(record: TokenRecord, described: dict[str, Any]) -> JobDetail:
    """Describe* responses have the same field names as the events' detail."""
    if record.kind == "download":
        return ProcessingJobDetail.model_validate(described)
    if record.kind == "training":
        return TrainingJobDetail.model_validate(described)
    return EndpointDetail.model_validate(described)


def reconcile_one(record: TokenRecord, resolver: TaskResolver, sagemaker: Any, report: ReconcileReport) -> None:
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
    endpoint = described if record.kind == "endpoint" else None
    resolution = resolver.resolve(detail, described_endpoint=endpoint)
    if resolution.outcome in ("succeeded", "failed", "stale_token"):
        report.resolved += 1
        logger.info("missed event reconciled", extra=resolution.as_dict())
    else:
        report.pending += 1


def reconcile(store: TokenStore, resolver: TaskResolver, sagemaker: Any, older_than_seconds: int) -> ReconcileReport:
    report = ReconcileReport()
    for record in store.older_than(older_than_seconds):
        report.checked += 1
        try:
            reconcile_one(record, resolver, sagemaker, report)
        except Exception as exc:
            logger.exception("could not reconcile claim", extra={"resource_name": record.resource_name})
            report.errors.append(f"{record.resource_name}: {type(exc).__name__}: {exc}")
    logger.info("reconciliation done", extra=report.counts())
    return report


def run(settings: Settings) -> ReconcileReport:
    """The scheduled entry point: clients and store from the function's environment."""
    settings.require("token_table")
    store = TokenStore.from_settings(settings)
    sagemaker = aws.client("sagemaker")
    resolver = TaskResolver(store, aws.client("stepfunctions"), sagemaker)
    return reconcile(store, resolver, sagemaker, settings.reconcile_after_seconds)
