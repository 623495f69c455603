"""Resolve waiting Step Functions tasks from SageMaker state-change events.

EventBridge delivers "SageMaker Processing Job State Change" (downloads, dedup, evaluations), "SageMaker
Training Job State Change", "SageMaker Endpoint State Change" and "SageMaker Model Package State
Change" (a person's approval) events; on a terminal status the task token stored under the
resource's name (a package: its ARN) is answered with SendTaskSuccess (a compact summary) or
SendTaskFailure (a named error and the FailureReason), then the claim is deleted.

SageMaker may send an event more than once and events may be late, so everything here is
idempotent: an unknown resource is ignored, and a token Step Functions no longer knows
(TaskDoesNotExist / InvalidToken / TaskTimedOut) is logged, not raised. An endpoint is the
exception: a deployment that settles after its run failed, timed out or was stopped (or whose
claim carries run_cleanup's `rollback=requested`) is rolled back (sdflow_common.rollback). The reconciler feeds
details built from Describe* responses through the same `TaskResolver.resolve`."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal

from aws_lambda_powertools import Logger
from aws_lambda_powertools.utilities.parser.models import EventBridgeModel
from botocore.exceptions import ClientError
from pydantic import BaseModel, ConfigDict, Field

from sdflow_common import aws, model_artifact, rollback, sagemaker_jobs
from sdflow_common.errors import (
    DedupJobFailed,
    DownloadJobFailed,
    EndpointDeployFailed,
    EvaluationJobFailed,
    ModelRejected,
    SdflowError,
    TrainingCapacityUnavailable,
    TrainingJobFailed,
)
from sdflow_common.settings import Settings
from sdflow_common.token_store import Kind, TokenRecord, TokenStore

logger = Logger(child=True)

PROCESSING_DETAIL_TYPE = "SageMaker Processing Job State Change"
TRAINING_DETAIL_TYPE = "SageMaker Training Job State Change"
ENDPOINT_DETAIL_TYPE = "SageMaker Endpoint State Change"
MODEL_PACKAGE_DETAIL_TYPE = "SageMaker Model Package State Change"

# Step Functions' limits for SendTaskFailure (error ≤ 256, cause ≤ 32,768 characters); the
# success output is kept far below its 256 KB limit so later states stay small.
MAX_ERROR_CHARS = 256
MAX_CAUSE_CHARS = 32_768
MAX_OUTPUT_BYTES = 4096
MAX_METRICS = 20
STALE_TOKEN_CODES = frozenset({"TaskDoesNotExist", "InvalidToken", "TaskTimedOut"})

FAILURE_ERRORS: dict[Kind, type[SdflowError]] = {
    "download": DownloadJobFailed,
    "training": TrainingJobFailed,
    "evaluation": EvaluationJobFailed,
    "dedup": DedupJobFailed,
    "endpoint": EndpointDeployFailed,
    "approval": ModelRejected,
}


def normalize_status(status: str) -> str:
    """Events say IN_SERVICE, DescribeEndpoint says InService: compare them as `inservice`."""
    return re.sub(r"[^a-z]", "", status.lower())


# ---------------------------------------------------------------------------- event models


class _Detail(BaseModel):
    # SageMaker events carry the whole Describe* response; keep what resolution needs.
    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True)

    kind: ClassVar[Kind]
    # The claims this kind of event may answer: a processing job is a download, a dedup or an evaluation.
    kinds: ClassVar[frozenset[Kind]]
    # Each kind names these two differently; subclasses give the alias.
    resource_name: str
    status: str


class _JobDetail(_Detail):
    success_statuses: ClassVar[frozenset[str]] = frozenset({"completed"})
    failure_statuses: ClassVar[frozenset[str]] = frozenset({"failed", "stopped"})

    def is_terminal(self) -> bool:
        return normalize_status(self.status) in self.success_statuses | self.failure_statuses

    def succeeded(self) -> bool:
        return normalize_status(self.status) in self.success_statuses


class ProcessingJobDetail(_JobDetail):
    kind: ClassVar[Kind] = "download"
    kinds: ClassVar[frozenset[Kind]] = frozenset({"download", "dedup", "evaluation"})

    resource_name: str = Field(alias="ProcessingJobName")
    status: str = Field(alias="ProcessingJobStatus")
    failure_reason: str | None = Field(default=None, alias="FailureReason")
    exit_message: str | None = Field(default=None, alias="ExitMessage")
    output_config: dict[str, Any] | None = Field(default=None, alias="ProcessingOutputConfig")

    def output_uri(self, output_name: str) -> str | None:
        """Where the job's named ProcessingOutput went: the job's own word, so an adopted job's
        output (an earlier attempt's name, its own folder) is found where it really is."""
        for output in (self.output_config or {}).get("Outputs") or []:
            if isinstance(output, dict) and output.get("OutputName") == output_name:
                uri = (output.get("S3Output") or {}).get("S3Uri")
                return str(uri) if uri else None
        return None

    @property
    def reason(self) -> str:
        parts = [part for part in (self.failure_reason, self.exit_message) if part]
        # Containers often write the same text to both; say it once.
        if len(parts) == 2 and (parts[1] in parts[0] or parts[0] in parts[1]):
            parts = [max(parts, key=len)]
        return " | ".join(parts) or "no FailureReason given"


class ModelArtifacts(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True)
    s3_model_artifacts: str = Field(alias="S3ModelArtifacts")


class OutputDataConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True)
    compression_type: str | None = Field(default=None, alias="CompressionType")


class MetricDatum(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True)
    metric_name: str = Field(alias="MetricName")
    value: float = Field(alias="Value")


class TrainingJobDetail(_JobDetail):
    kind: ClassVar[Kind] = "training"
    kinds: ClassVar[frozenset[Kind]] = frozenset({"training"})

    resource_name: str = Field(alias="TrainingJobName")
    status: str = Field(alias="TrainingJobStatus")
    secondary_status: str | None = Field(default=None, alias="SecondaryStatus")
    failure_reason: str | None = Field(default=None, alias="FailureReason")
    model_artifacts: ModelArtifacts | None = Field(default=None, alias="ModelArtifacts")
    output_data_config: OutputDataConfig | None = Field(default=None, alias="OutputDataConfig")
    final_metrics: list[MetricDatum] = Field(default_factory=list, alias="FinalMetricDataList")

    @property
    def reason(self) -> str:
        reason = self.failure_reason or "no FailureReason given"
        if self.secondary_status and normalize_status(self.secondary_status) != normalize_status(self.status):
            reason = f"{reason} (secondary status {self.secondary_status})"
        return reason


class EndpointDetail(_Detail):
    kind: ClassVar[Kind] = "endpoint"
    kinds: ClassVar[frozenset[Kind]] = frozenset({"endpoint"})
    # The event's status is only a hint: resolution reads DescribeEndpoint, because a
    # blue/green update that rolled back also ends IN_SERVICE, on the old config.
    terminal_statuses: ClassVar[frozenset[str]] = frozenset(
        {"inservice", "failed", "updaterollbackfailed", "outofservice", "deleting"}
    )

    resource_name: str = Field(alias="EndpointName")
    status: str = Field(alias="EndpointStatus")
    endpoint_config_name: str | None = Field(default=None, alias="EndpointConfigName")
    failure_reason: str | None = Field(default=None, alias="FailureReason")

    def is_terminal(self) -> bool:
        return normalize_status(self.status) in self.terminal_statuses


class ModelPackageDetail(_Detail):
    """A model package's approval: a person (or the pipeline) set ModelApprovalStatus. Approved
    answers the run's "Wait for approval" task, Rejected fails it; PendingManualApproval waits on."""

    kind: ClassVar[Kind] = "approval"
    kinds: ClassVar[frozenset[Kind]] = frozenset({"approval"})

    resource_name: str = Field(alias="ModelPackageArn")
    status: str = Field(alias="ModelApprovalStatus")
    approval_description: str | None = Field(default=None, alias="ApprovalDescription")

    def is_terminal(self) -> bool:
        return normalize_status(self.status) in {"approved", "rejected"}

    def succeeded(self) -> bool:
        return normalize_status(self.status) == "approved"


JobDetail = ProcessingJobDetail | TrainingJobDetail | EndpointDetail | ModelPackageDetail
# The detail model of each claim kind (its `kinds`): one place says an evaluation is a processing job.
DETAIL_MODELS: dict[Kind, type[JobDetail]] = {
    kind: model
    for model in (ProcessingJobDetail, TrainingJobDetail, EndpointDetail, ModelPackageDetail)
    for kind in model.kinds
}


class ProcessingJobStateChange(EventBridgeModel):
    detail_type: Literal["SageMaker Processing Job State Change"] = Field(alias="detail-type")
    detail: ProcessingJobDetail


class TrainingJobStateChange(EventBridgeModel):
    detail_type: Literal["SageMaker Training Job State Change"] = Field(alias="detail-type")
    detail: TrainingJobDetail


class EndpointStateChange(EventBridgeModel):
    detail_type: Literal["SageMaker Endpoint State Change"] = Field(alias="detail-type")
    detail: EndpointDetail


class ModelPackageStateChange(EventBridgeModel):
    detail_type: Literal["SageMaker Model Package State Change"] = Field(alias="detail-type")
    detail: ModelPackageDetail


SageMakerStateChangeEvent = (
    ProcessingJobStateChange | TrainingJobStateChange | EndpointStateChange | ModelPackageStateChange
)
# The model for Powertools' event_parser: the detail-type picks the detail's model.
SageMakerStateChange = Annotated[SageMakerStateChangeEvent, Field(discriminator="detail_type")]


# ---------------------------------------------------------------------------- resolution

Outcome = Literal["succeeded", "failed", "ignored", "unknown", "stale_token", "rolled_back"]


@dataclass(frozen=True)
class Resolution:
    outcome: Outcome
    resource_name: str
    kind: str
    status: str
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}


def truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def compact_json(payload: dict[str, Any]) -> str:
    return json.dumps(payload, separators=(",", ":"), sort_keys=True)


class TaskResolver:
    def __init__(self, store: TokenStore, sfn: Any, sagemaker: Any) -> None:
        self.store = store
        self.sfn = sfn
        self.sagemaker = sagemaker

    @classmethod
    def from_settings(cls, settings: Settings) -> TaskResolver:
        settings.require("token_table")
        return cls(TokenStore.from_settings(settings), aws.client("stepfunctions"), aws.client("sagemaker"))

    # -- entry point ------------------------------------------------------------------

    def resolve(
        self,
        detail: JobDetail,
        *,
        event_time: datetime | None = None,
        described_endpoint: dict[str, Any] | None = None,
    ) -> Resolution:
        """Answer the task waiting on this resource, if the status is terminal.

        `event_time` is the EventBridge event's time (None for the reconciler's synthetic
        details); `described_endpoint` saves a DescribeEndpoint the caller already made."""
        name, kind, status = detail.resource_name, detail.kind, detail.status
        if not detail.is_terminal():
            logger.info("non-terminal status ignored", extra={"resource_name": name, "status": status})
            return Resolution("ignored", name, kind, status)
        record = self.store.get(name)
        if record is None:
            logger.info("no task waits on this resource", extra={"resource_name": name, "status": status})
            return Resolution("unknown", name, kind, status)
        if record.kind not in detail.kinds:
            logger.warning("token kind does not match the event", extra={"resource_name": name, "kind": record.kind})
            return Resolution("unknown", name, kind, status)
        if isinstance(detail, EndpointDetail):
            if event_time is not None and _predates_deployment(record, event_time):
                # Endpoint names are reused across runs: a late or duplicate event of the
                # previous deployment must not judge this one (it would look rolled back).
                logger.info("event predates this deployment; ignored", extra={"endpoint": name})
                return Resolution("ignored", name, kind, status)
            return self._resolve_endpoint(record, detail, described_endpoint)
        if isinstance(detail, ModelPackageDetail):
            return self._resolve_approval(record, detail)
        if detail.succeeded():
            return self.succeed(record, self._job_summary(record, detail), status)
        cause = f"{record.kind} job {name} ended {status}: {detail.reason}"
        return self.fail(record, _failure_error(record, detail), cause, status)

    def _resolve_approval(self, record: TokenRecord, detail: ModelPackageDetail) -> Resolution:
        arn = detail.resource_name
        if detail.succeeded():
            summary = {"model_package_arn": arn, "approval_status": detail.status}
            if detail.approval_description:
                summary["approval_description"] = truncate(detail.approval_description, 1000)
            return self.succeed(record, summary, detail.status)
        reason = f": {detail.approval_description}" if detail.approval_description else ""
        cause = (
            f"model package {arn} was rejected{reason}; nothing was deployed and the endpoint keeps its "
            "current model. Register a better model with a new run."
        )
        return self.fail(record, ModelRejected, cause, detail.status)

    # -- summaries --------------------------------------------------------------------

    @staticmethod
    def _job_summary(record: TokenRecord, detail: ProcessingJobDetail | TrainingJobDetail) -> dict[str, Any]:
        if isinstance(detail, ProcessingJobDetail):
            if record.kind == "evaluation":
                # evaluation.json and adherence.png are there; Register model reads them.
                uri = detail.output_uri("evaluation") or record.context.get("output_uri", "")
                return {"job_name": detail.resource_name, "evaluation_uri": uri}
            if record.kind == "dedup":
                # The container wrote summary.json last; Build dataset index reads it ($.dedup).
                return {"job_name": detail.resource_name, "summary_uri": record.context.get("summary_uri", "")}
            return {
                "shard_id": record.context.get("shard_id", ""),
                "status": "ok",
                "job_name": detail.resource_name,
            }
        # The job's own OutputDataConfig (the event and DescribeTrainingJob carry it), else what it asked for.
        reported = detail.output_data_config.compression_type if detail.output_data_config else None
        compression = reported or record.context.get("output_compression")
        if detail.model_artifacts is not None:
            # Where SageMaker says the model is: a model.tar.gz, or the prefix of an uncompressed output.
            model_data_url = model_artifact.reported_location(detail.model_artifacts.s3_model_artifacts, compression)
        else:
            # SageMaker's own layout under OutputDataConfig.S3OutputPath.
            model_data_url = model_artifact.expected_location(
                record.context.get("output_path", ""), detail.resource_name, compression
            )
        metrics = {datum.metric_name: datum.value for datum in detail.final_metrics[:MAX_METRICS]}
        summary: dict[str, Any] = {
            "job_name": detail.resource_name,
            "model_data_url": model_data_url,
            "final_metrics": metrics,
        }
        while len(compact_json(summary).encode()) > MAX_OUTPUT_BYTES and metrics:
            metrics.pop(next(iter(metrics)))
        return summary

    def _resolve_endpoint(
        self, record: TokenRecord, detail: EndpointDetail, described: dict[str, Any] | None
    ) -> Resolution:
        name = record.resource_name
        if described is None:
            try:
                described = self.sagemaker.describe_endpoint(EndpointName=name)
            except ClientError as exc:
                if not sagemaker_jobs.is_not_found(exc):
                    raise
                return self.fail(
                    record,
                    EndpointDeployFailed,
                    f"endpoint {name} vanished during the deployment",
                    "NotFound",
                )
        status = str(described.get("EndpointStatus", ""))
        current = normalize_status(status)
        if current in {"creating", "updating", "systemupdating", "rollingback"}:
            # A late event from before the current change; the change's own event follows.
            logger.info("endpoint still changing; event ignored", extra={"endpoint": name, "status": status})
            return Resolution("ignored", name, "endpoint", status)
        if rollback.is_requested(record):
            # The run ended while this deployment was under way (run_cleanup): undo it now.
            return self._roll_back(record, status, described)
        wanted = record.context.get("endpoint_config_name", "")
        serving = str(described.get("EndpointConfigName", ""))
        reason = described.get("FailureReason") or detail.failure_reason
        if current == "inservice" and serving == wanted:
            summary = {
                "endpoint_name": name,
                "endpoint_config_name": wanted,
                "model_name": record.context.get("model_name", ""),
                "action": record.context.get("action", ""),
            }
            return self.succeed(record, summary, status)
        if current == "inservice":
            verb = "update" if record.context.get("action") == "update" else "deployment"
            cause = (
                f"{verb} of endpoint {name} to {wanted} rolled back: the endpoint is InService on "
                f"{serving or 'another config'}"
            )
        else:
            cause = f"endpoint {name} ended {status} while deploying {wanted}"
        if reason:
            cause = f"{cause}: {reason}"
        return self.fail(record, EndpointDeployFailed, cause, status)

    # -- Step Functions ---------------------------------------------------------------

    def succeed(self, record: TokenRecord, summary: dict[str, Any], status: str) -> Resolution:
        outcome: Outcome = "succeeded"
        try:
            self.sfn.send_task_success(taskToken=record.task_token, output=compact_json(summary))
        except ClientError as exc:
            outcome = self._stale_or_raise(exc, record)
        if outcome == "stale_token" and record.kind == "endpoint":
            return self._after_stale_endpoint(record, status)
        self.store.delete(record.resource_name, token=record.task_token)
        logger.info("task resolved", extra={"resource_name": record.resource_name, "outcome": outcome})
        return Resolution(outcome, record.resource_name, record.kind, status)

    def fail(self, record: TokenRecord, error: type[SdflowError], cause: str, status: str) -> Resolution:
        outcome: Outcome = "failed"
        try:
            self.sfn.send_task_failure(
                taskToken=record.task_token,
                error=truncate(error.__name__, MAX_ERROR_CHARS),
                cause=truncate(cause, MAX_CAUSE_CHARS),
            )
        except ClientError as exc:
            outcome = self._stale_or_raise(exc, record)
        if outcome == "stale_token" and record.kind == "endpoint":
            return self._after_stale_endpoint(record, status)
        self.store.delete(record.resource_name, token=record.task_token)
        logger.info(
            "task failed",
            extra={"resource_name": record.resource_name, "outcome": outcome, "error": error.__name__},
        )
        return Resolution(outcome, record.resource_name, record.kind, status, error=error.__name__)

    # -- endpoint rollback --------------------------------------------------------------

    def _after_stale_endpoint(self, record: TokenRecord, status: str) -> Resolution:
        """The deploy task is gone. If its run FAILED, TIMED_OUT or was ABORTED, the deployment
        that just settled is undone; a stale token of a run still running (a retried attempt
        took over) or that succeeded (a duplicate event) leaves the endpoint alone."""
        if rollback.execution_ended_unsuccessfully(self.sfn, record.execution_arn):
            return self._roll_back(record, status, None)
        self.store.delete(record.resource_name, token=record.task_token)
        return Resolution("stale_token", record.resource_name, record.kind, status)

    def _roll_back(self, record: TokenRecord, status: str, described: dict[str, Any] | None) -> Resolution:
        result = rollback.roll_back(record, self.sagemaker, described)
        name = record.resource_name
        if result.keeps_claim:
            # Changing again: its next state-change event comes back here.
            logger.info("endpoint still changing; rollback waits", extra={"endpoint": name, "detail": result.text})
            return Resolution("ignored", name, record.kind, status)
        if result.outcome == "manual":
            logger.error("endpoint rollback needs a person", extra={"endpoint": name, "detail": result.text})
        else:
            logger.info("endpoint deployment rolled back", extra={"endpoint": name, "detail": result.text})
        self.store.delete(name, token=record.task_token)
        return Resolution("rolled_back", name, record.kind, status)

    @staticmethod
    def _stale_or_raise(exc: ClientError, record: TokenRecord) -> Outcome:
        code = sagemaker_jobs.error_code(exc)
        if code not in STALE_TOKEN_CODES:
            raise exc
        # The task already ended (answered, timed out, or its execution stopped): a duplicate
        # or late event. Nothing waits any more, so the claim is cleaned up all the same.
        logger.warning("task token no longer valid", extra={"resource_name": record.resource_name, "code": code})
        return "stale_token"


def _failure_error(record: TokenRecord, detail: ProcessingJobDetail | TrainingJobDetail) -> type[SdflowError]:
    """The step's error; a training job SageMaker could not find instances for gets its own, which
    the state retries with a new job later (SageMaker's RetryStrategy does not cover capacity)."""
    failed = normalize_status(detail.status) == "failed"
    if isinstance(detail, TrainingJobDetail) and failed and sagemaker_jobs.is_capacity_failure(detail.failure_reason):
        return TrainingCapacityUnavailable
    return FAILURE_ERRORS[record.kind]


def _predates_deployment(record: TokenRecord, event_time: datetime) -> bool:
    started = "action" in record.context  # set just before CreateEndpoint/UpdateEndpoint
    return not started or event_time.timestamp() < record.created_at


def resolve_event(event: SageMakerStateChangeEvent, resolver: TaskResolver) -> Resolution:
    """What the job_events handler calls for each parsed event."""
    return resolver.resolve(event.detail, event_time=event.time)
