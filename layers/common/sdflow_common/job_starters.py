"""The long steps' starters: the payloads of the waiting Step Functions tasks, and a starter per
task that builds its SageMaker request and starts it.

A job (download, training; evaluation in sdflow_common.evaluation) starts through one sequence,
sdflow_common.job_start.start_job: find an earlier attempt's job and adopt it, claim the
deterministic name (sdflow_common.names: run hash, redrive count, attempt) → the task token, create,
check the run still runs. The endpoint deployment has its own (deploy_endpoint): its claim is the
endpoint's name, one deployment per endpoint at a time. The task's result comes later, from
job_events."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError
from pydantic import BaseModel, ConfigDict, Field, field_validator

from sdflow_common import aws, job_control, model_artifact, names, sagemaker_jobs
from sdflow_common.dataset_filters import DatasetFilters, filter_arguments
from sdflow_common.errors import (
    DownloadJobFailed,
    EndpointBusy,
    EndpointDeployFailed,
    TrainingJobFailed,
)
from sdflow_common.job_start import JobStart, refusal_text, start_job, translate
from sdflow_common.rollback import PREVIOUS_CONFIG_KEY
from sdflow_common.run_config import RunConfig
from sdflow_common.run_document import DownloadOptions
from sdflow_common.settings import Settings
from sdflow_common.token_store import MAX_TIMEOUT_SECONDS, TokenRecord, TokenStore

logger = Logger(child=True)

# Comma-separated CloudWatch alarm names for the blue/green update's auto-rollback (optional).
ROLLBACK_ALARMS_ENV = "ENDPOINT_ROLLBACK_ALARMS"

# describe_endpoint statuses during which UpdateEndpoint is refused.
ENDPOINT_BUSY_STATUSES = frozenset({"Creating", "Updating", "SystemUpdating", "RollingBack", "Deleting"})
# Statuses an endpoint cannot leave by itself: a person has to delete it first.
ENDPOINT_BROKEN_STATUSES = frozenset({"Failed", "UpdateRollbackFailed"})


# ---------------------------------------------------------------------------- payloads


class _Payload(BaseModel):
    # Tolerant of extra keys: the state machine may pass more than a starter needs.
    model_config = ConfigDict(extra="ignore", frozen=True)


class ShardItem(_Payload):
    shard_id: str = Field(min_length=1, max_length=12)
    parquet_uri: str = Field(min_length=6)
    output_uri: str = Field(min_length=6)


class DatasetColumns(_Payload):
    url_column: str = "URL"
    caption_column: str = "TEXT"
    filters: DatasetFilters | None = None  # $.config.run.dataset.filters


class CallbackTask(_Payload):
    """What every waitForTaskToken payload carries (docs/contracts.md "State machine data")."""

    token: str = Field(min_length=1, repr=False)
    attempt: int = Field(ge=0, description="$$.State.RetryCount")
    execution_arn: str = Field(min_length=1, description="$$.Execution.Id of the run (the parent for downloads)")
    start_time: str | int = Field(description="$$.Execution.StartTime of the run (the parent for downloads)")
    redrive_count: int = Field(default=0, ge=0, description="$$.Execution.RedriveCount of the run")
    child_redrive_count: int = Field(
        default=0, ge=0, description="$$.Execution.RedriveCount of a Distributed Map child (downloads only)"
    )
    timeout_seconds: int = Field(
        ge=1, le=MAX_TIMEOUT_SECONDS, description="The task's TimeoutSeconds: the claim's deadline"
    )

    @field_validator("start_time")
    @classmethod
    def _readable_start_time(cls, value: str | int) -> str | int:
        try:
            names.start_millis(value)
        except names.InvalidNameInput as exc:
            raise ValueError(f"{exc}; the state machine must pass $$.Execution.StartTime") from exc
        return value

    @property
    def run_hash(self) -> str:
        return names.run_hash(self.execution_arn, self.start_time)

    @property
    def redrive(self) -> int:
        """The `-r<n>` of the names. A redriven Map child keeps the input (the parent's count of
        its first start) and counts its own redrives; a child first started by a redrive has the
        parent's count. The sum differs for every start of one shard's child."""
        return self.redrive_count + self.child_redrive_count


class DownloadTask(CallbackTask):
    run_id: str = Field(min_length=1)
    shard: ShardItem
    download: DownloadOptions = Field(default_factory=DownloadOptions)
    dataset: DatasetColumns = Field(default_factory=DatasetColumns)
    holdout_rate: float = Field(default=0.0, ge=0, le=1)  # $.config.holdout_rate


class TrainingTask(CallbackTask):
    config: RunConfig
    dataset: dict[str, Any] = Field(default_factory=dict)


class TrainingResult(_Payload):
    """`$.training`, the training task's callback output."""

    job_name: str
    model_data_url: str = Field(min_length=6)
    final_metrics: dict[str, float] = Field(default_factory=dict)


class RegisteredModel(_Payload):
    """`$.model`, Register model's result: the package Deploy endpoint serves."""

    model_package_arn: str = Field(min_length=20)
    approval_status: str = "Approved"


class DeployTask(CallbackTask):
    config: RunConfig
    training: TrainingResult
    model: RegisteredModel


# ---------------------------------------------------------------------------- helpers


def _describe_or_none(describe: Callable[..., dict[str, Any]], **kwargs: str) -> dict[str, Any] | None:
    try:
        return describe(**kwargs)
    except ClientError as exc:
        if sagemaker_jobs.is_not_found(exc):
            return None
        raise


def start_outcome(result: dict[str, Any]) -> str:
    """A starter's result as a metric dimension value: `created` (this invocation created the
    resource), `adopted` (an earlier attempt's, taken over) or `existing` (an earlier invocation of
    this attempt had created it)."""
    if result.get("adopted"):
        return "adopted"
    return "created" if result.get("created") else "existing"


def require_job_settings(settings: Settings) -> None:
    """What every starter needs from its environment: the token table, the job role, the image."""
    settings.require("token_table", "sagemaker_role_arn", "training_image_uri")


# ---------------------------------------------------------------------------- starters


def start_download(
    task: DownloadTask,
    settings: Settings,
    *,
    store: TokenStore | None = None,
    sagemaker: Any = None,
    sfn: Any = None,
) -> dict[str, Any]:
    """One processing job per shard (docs/contracts.md "The download job")."""
    require_job_settings(settings)
    sagemaker = sagemaker or aws.client("sagemaker")
    shard = task.shard
    name = names.download_job_name(task.run_hash, task.run_id, shard.shard_id, task.redrive, task.attempt)
    request = sagemaker_jobs.processing_job_request(
        job_name=name,
        run_id=task.run_id,
        run_hash=task.run_hash,
        shard_id=shard.shard_id,
        parquet_uri=shard.parquet_uri,
        output_uri=shard.output_uri,
        options=task.download,
        url_column=task.dataset.url_column,
        caption_column=task.dataset.caption_column,
        filters=filter_arguments(task.dataset.filters, task.dataset.caption_column),
        image_uri=settings.training_image_uri,
        role_arn=settings.sagemaker_role_arn,
        holdout_rate=task.holdout_rate,
    )
    return start_job(
        JobStart(
            store=store or TokenStore.from_settings(settings),
            sfn=sfn or aws.client("stepfunctions"),
            task=task,
            api=job_control.processing_jobs(sagemaker),
            name=name,
            request=request,
            context={"shard_id": shard.shard_id, "output_uri": shard.output_uri, "run_id": task.run_id},
            failure=DownloadJobFailed,
        )
    )


def start_training(
    task: TrainingTask,
    settings: Settings,
    *,
    store: TokenStore | None = None,
    sagemaker: Any = None,
    sfn: Any = None,
) -> dict[str, Any]:
    """The run's training job (docs/contracts.md "The training job")."""
    require_job_settings(settings)
    sagemaker = sagemaker or aws.client("sagemaker")
    config = task.config
    name = names.training_job_name(task.run_hash, config.run_id, task.redrive, task.attempt)
    request = sagemaker_jobs.training_job_request(
        job_name=name,
        run_id=config.run_id,
        run_hash=task.run_hash,
        bucket=config.bucket,
        dataset_prefix_uri=config.dataset_prefix_uri,
        run=config.run,
        # The image of the run's backend (Validate run resolved it from the model's family).
        image_uri=settings.image_uri(config.run.training.backend),
        role_arn=settings.sagemaker_role_arn,
    )
    return start_job(
        JobStart(
            store=store or TokenStore.from_settings(settings),
            sfn=sfn or aws.client("stepfunctions"),
            task=task,
            api=job_control.training_jobs(sagemaker),
            name=name,
            request=request,
            context={
                "output_path": request["OutputDataConfig"]["S3OutputPath"],
                "output_compression": request["OutputDataConfig"].get("CompressionType", model_artifact.GZIP),
                "run_id": config.run_id,
            },
            failure=TrainingJobFailed,
            across_redrives=True,
        )
    )


def rollback_alarm_names() -> list[str]:
    return [name.strip() for name in os.environ.get(ROLLBACK_ALARMS_ENV, "").split(",") if name.strip()]


def _deploys_config(described: dict[str, Any], config_name: str) -> bool:
    """The endpoint serves this config, or is rolling it out (UpdateEndpoint accepted)."""
    pending = described.get("PendingDeploymentSummary") or {}
    return config_name in (described.get("EndpointConfigName"), pending.get("EndpointConfigName"))


def _create_if_missing(call: Callable[..., Any], request: Mapping[str, Any]) -> None:
    """Model and endpoint config are per attempt; a re-invocation finds them made already."""
    try:
        call(**request)
    except ClientError as exc:
        if not sagemaker_jobs.is_already_exists(exc):
            raise


def deploy_endpoint(
    task: DeployTask,
    settings: Settings,
    *,
    store: TokenStore | None = None,
    sagemaker: Any = None,
    alarm_names: Sequence[str] | None = None,
) -> dict[str, Any]:
    """CreateModel (from the approved model package) + CreateEndpointConfig, then CreateEndpoint, or a
    blue/green UpdateEndpoint
    when the endpoint exists. The token is keyed by the endpoint name, so one deployment per
    endpoint runs at a time; another run's deployment → EndpointBusy (the state retries)."""
    require_job_settings(settings)
    store = store or TokenStore.from_settings(settings)
    sagemaker = sagemaker or aws.client("sagemaker")
    alarms = rollback_alarm_names() if alarm_names is None else list(alarm_names)
    config, options = task.config, task.config.run.endpoint
    endpoint = options.name
    run_hash = task.run_hash
    deployment = names.deployment_name(endpoint, run_hash, task.redrive, task.attempt)
    context = {"endpoint_config_name": deployment, "model_name": deployment, "run_id": config.run_id}
    earlier = store.get(endpoint)
    claim = store.claim(
        endpoint, task.token, task.execution_arn, "endpoint", context, timeout_seconds=task.timeout_seconds
    )
    try:
        described = _describe_or_none(sagemaker.describe_endpoint, EndpointName=endpoint)
        if not claim.new and described is not None and _deploys_config(described, deployment):
            logger.info("deployment already under way", extra={"endpoint": endpoint, "config": deployment})
            return {"resource_name": endpoint, "endpoint_config_name": deployment, "created": False}
        adopted = _adopt_earlier_deployment(store, task, described, earlier)
        if adopted is not None:
            return adopted
        action = _choose_action(endpoint, described)
        started = {"action": action}
        if described is not None:
            # What a rollback restores when the run ends without succeeding (sdflow_common.rollback).
            started[PREVIOUS_CONFIG_KEY] = str(described.get("EndpointConfigName", ""))
        store.update_context(endpoint, task.token, started)
        _create_if_missing(
            sagemaker.create_model,
            sagemaker_jobs.model_request(
                model_name=deployment,
                run_id=config.run_id,
                run_hash=run_hash,
                model_package_arn=task.model.model_package_arn,
                role_arn=settings.sagemaker_role_arn,
            ),
        )
        _create_if_missing(
            sagemaker.create_endpoint_config,
            sagemaker_jobs.endpoint_config_request(
                config_name=deployment,
                model_name=deployment,
                run_id=config.run_id,
                run_hash=run_hash,
                options=options,
                backend=config.run.training.backend,
            ),
        )
        if action == "create":
            sagemaker.create_endpoint(
                **sagemaker_jobs.create_endpoint_request(
                    endpoint_name=endpoint, config_name=deployment, run_id=config.run_id, run_hash=run_hash
                )
            )
        else:
            sagemaker.update_endpoint(
                **sagemaker_jobs.update_endpoint_request(
                    endpoint_name=endpoint,
                    config_name=deployment,
                    options=options,
                    rollback_alarm_names=alarms,
                )
            )
    except ClientError as exc:
        store.delete(endpoint, token=task.token)
        message = sagemaker_jobs.error_message(exc).lower()
        if sagemaker_jobs.is_already_exists(exc) or "in progress" in message or "in-progress" in message:
            # Someone outside sdflow created or is changing the endpoint since we looked.
            raise EndpointBusy(refusal_text(exc, "the deployment", endpoint) + "; retrying later") from exc
        raise translate(exc, "the deployment", endpoint, EndpointDeployFailed) from exc
    except BaseException:
        store.delete(endpoint, token=task.token)
        raise
    logger.info("deployment started", extra={"endpoint": endpoint, "action": action, "config": deployment})
    return {"resource_name": endpoint, "endpoint_config_name": deployment, "action": action, "created": True}


def _adopt_earlier_deployment(
    store: TokenStore, task: DeployTask, described: dict[str, Any] | None, earlier: TokenRecord | None
) -> dict[str, Any] | None:
    """An earlier attempt of this task (same execution and redrive) whose starter died after its
    CreateEndpoint / UpdateEndpoint: the endpoint is already rolling out that attempt's config.
    This attempt takes the deployment over (its claim gets the earlier context: the config, the
    action, the config a rollback restores) instead of queueing a second update behind it."""
    if described is None or earlier is None or earlier.execution_arn != task.execution_arn:
        return None
    config_name = earlier.context.get("endpoint_config_name", "")
    if "action" not in earlier.context or not config_name or not _deploys_config(described, config_name):
        return None
    endpoint = earlier.resource_name
    store.update_context(endpoint, task.token, dict(earlier.context))
    logger.info("earlier attempt's deployment adopted", extra={"endpoint": endpoint, "config": config_name})
    return {"resource_name": endpoint, "endpoint_config_name": config_name, "created": False, "adopted": True}


def _choose_action(endpoint: str, described: dict[str, Any] | None) -> str:
    if described is None:
        return "create"
    status = described.get("EndpointStatus", "")
    if status in ENDPOINT_BUSY_STATUSES:
        raise EndpointBusy(f"endpoint {endpoint} is {status}; waiting for it to settle before updating")
    if status in ENDPOINT_BROKEN_STATUSES:
        reason = described.get("FailureReason", "no reason given")
        raise EndpointDeployFailed(
            f"endpoint {endpoint} is {status} ({reason}) and cannot be updated; delete it "
            f"(aws sagemaker delete-endpoint --endpoint-name {shlex.quote(endpoint)}) and run again to recreate it"
        )
    return "update"
