"""The long steps' starters: create a SageMaker resource for a waiting Step Functions task.

Each starter runs behind `lambda:invoke.waitForTaskToken` and follows one protocol:
1. compute the resource's deterministic name (sdflow_common.names; new per retry attempt);
2. claim name → task token in the token table FIRST, so the job_events Lambda can always find
   the token once the resource exists;
3. create the resource. A re-invoked Lambda (same attempt, same token) finds its claim and,
   when the resource already exists, does nothing: one attempt, one resource.
Errors: throttling/capacity → SageMakerThrottled and an instance quota in use by other jobs →
SageMakerQuotaExceeded (the state's Retry runs a new attempt with a new name, the quota one
slowly and for hours); a request larger than the quota itself, or anything else → the step's
named error. Either way the claim is released first, so a retry starts clean. The task's
result comes later, from job_events."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError
from pydantic import BaseModel, ConfigDict, Field

from sdflow_common import aws, names, sagemaker_jobs
from sdflow_common.errors import (
    DownloadJobFailed,
    EndpointBusy,
    EndpointDeployFailed,
    SageMakerQuotaExceeded,
    SageMakerThrottled,
    SdflowError,
    TrainingJobFailed,
)
from sdflow_common.run_document import DownloadOptions
from sdflow_common.settings import Settings
from sdflow_common.token_store import Kind, TokenStore
from sdflow_common.validate_run import RunConfig

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


class CallbackTask(_Payload):
    """What every waitForTaskToken payload carries (docs/contracts.md "State machine data")."""

    token: str = Field(min_length=1, repr=False)
    attempt: int = Field(ge=0, description="$$.State.RetryCount")
    execution_arn: str = Field(min_length=1)


class DownloadTask(CallbackTask):
    run_id: str = Field(min_length=1)
    shard: ShardItem
    download: DownloadOptions = Field(default_factory=DownloadOptions)
    dataset: DatasetColumns = Field(default_factory=DatasetColumns)


class TrainingTask(CallbackTask):
    config: RunConfig
    dataset: dict[str, Any] = Field(default_factory=dict)


class TrainingResult(_Payload):
    """`$.training`, the training task's callback output."""

    job_name: str
    model_data_url: str = Field(min_length=6)
    final_metrics: dict[str, float] = Field(default_factory=dict)


class DeployTask(CallbackTask):
    config: RunConfig
    training: TrainingResult


# ---------------------------------------------------------------------------- helpers


def _describe_or_none(describe: Callable[..., dict[str, Any]], **kwargs: str) -> dict[str, Any] | None:
    try:
        return describe(**kwargs)
    except ClientError as exc:
        if sagemaker_jobs.is_not_found(exc):
            return None
        raise


def _refusal(exc: ClientError, operation: str, resource: str) -> str:
    code, message = sagemaker_jobs.error_code(exc), sagemaker_jobs.error_message(exc)
    return f"SageMaker refused {operation} for {resource}: {code}: {message}"


def _quota_error(exc: ClientError, operation: str, resource: str, failure: type[SdflowError]) -> SdflowError:
    refusal = sagemaker_jobs.quota_refusal(exc)
    if refusal is not None and refusal.never_fits:
        # No job ending can free enough instances: retrying for hours would only delay the answer.
        return failure(
            f"{_refusal(exc, operation, resource)}; the quota '{refusal.quota_name}' ({refusal.limit:g}) is "
            f"smaller than this one request ({refusal.requested:g}): request an increase in the Service "
            "Quotas console (service Amazon SageMaker), or choose an instance type or count that fits it"
        )
    return SageMakerQuotaExceeded(
        _refusal(exc, operation, resource) + " (instances held by other jobs; retrying until they free up)"
    )


def _translate(exc: ClientError, operation: str, resource: str, failure: type[SdflowError]) -> SdflowError:
    """The named error Step Functions' Retry/Catch matches for a refused create call."""
    if sagemaker_jobs.is_quota_exceeded(exc):
        return _quota_error(exc, operation, resource, failure)
    if sagemaker_jobs.is_throttling(exc):
        return SageMakerThrottled(_refusal(exc, operation, resource) + " (retrying with a new attempt)")
    return failure(_refusal(exc, operation, resource))


def _start_job(
    *,
    store: TokenStore,
    task: CallbackTask,
    kind: Kind,
    name: str,
    context: dict[str, str],
    operation: str,
    create: Callable[[], Any],
    describe: Callable[[], dict[str, Any] | None],
    failure: type[SdflowError],
) -> dict[str, Any]:
    claim = store.claim(name, task.token, task.execution_arn, kind, context)
    if not claim.new:
        try:
            existing = describe()
        except ClientError as exc:
            # The claim stays: an earlier invocation may have created the job, whose event
            # must still find a token (a dead one is answered harmlessly by job_events).
            raise _translate(exc, operation.replace("Create", "Describe"), name, failure) from exc
        if existing is not None:
            logger.info("job already started by an earlier invocation", extra={"resource_name": name})
            return {"resource_name": name, "created": False}
    try:
        create()
    except ClientError as exc:
        if sagemaker_jobs.is_already_exists(exc):
            logger.info("job already exists", extra={"resource_name": name})
            return {"resource_name": name, "created": False}
        store.delete(name, token=task.token)
        raise _translate(exc, operation, name, failure) from exc
    except BaseException:
        store.delete(name, token=task.token)
        raise
    logger.info("job started", extra={"resource_name": name, "kind": kind, "attempt": task.attempt})
    return {"resource_name": name, "created": True}


def _require(settings: Settings) -> None:
    settings.require("token_table", "sagemaker_role_arn", "training_image_uri")


# ---------------------------------------------------------------------------- starters


def start_download(
    task: DownloadTask, settings: Settings, *, store: TokenStore | None = None, sagemaker: Any = None
) -> dict[str, Any]:
    """One processing job per shard (docs/contracts.md "The download job")."""
    _require(settings)
    store = store or TokenStore.from_settings(settings)
    sagemaker = sagemaker or aws.client("sagemaker")
    shard = task.shard
    name = names.download_job_name(task.execution_arn, task.run_id, shard.shard_id, task.attempt)
    request = sagemaker_jobs.processing_job_request(
        job_name=name,
        run_id=task.run_id,
        shard_id=shard.shard_id,
        parquet_uri=shard.parquet_uri,
        output_uri=shard.output_uri,
        options=task.download,
        url_column=task.dataset.url_column,
        caption_column=task.dataset.caption_column,
        image_uri=settings.training_image_uri,
        role_arn=settings.sagemaker_role_arn,
    )
    return _start_job(
        store=store,
        task=task,
        kind="download",
        name=name,
        context={"shard_id": shard.shard_id, "output_uri": shard.output_uri, "run_id": task.run_id},
        operation="CreateProcessingJob",
        create=lambda: sagemaker.create_processing_job(**request),
        describe=lambda: _describe_or_none(sagemaker.describe_processing_job, ProcessingJobName=name),
        failure=DownloadJobFailed,
    )


def start_training(
    task: TrainingTask, settings: Settings, *, store: TokenStore | None = None, sagemaker: Any = None
) -> dict[str, Any]:
    """The run's training job (docs/contracts.md "The training job")."""
    _require(settings)
    store = store or TokenStore.from_settings(settings)
    sagemaker = sagemaker or aws.client("sagemaker")
    config = task.config
    name = names.training_job_name(task.execution_arn, config.run_id, task.attempt)
    request = sagemaker_jobs.training_job_request(
        job_name=name,
        run_id=config.run_id,
        bucket=config.bucket,
        dataset_prefix_uri=config.dataset_prefix_uri,
        run=config.run,
        image_uri=settings.training_image_uri,
        role_arn=settings.sagemaker_role_arn,
    )
    return _start_job(
        store=store,
        task=task,
        kind="training",
        name=name,
        context={"output_path": request["OutputDataConfig"]["S3OutputPath"], "run_id": config.run_id},
        operation="CreateTrainingJob",
        create=lambda: sagemaker.create_training_job(**request),
        describe=lambda: _describe_or_none(sagemaker.describe_training_job, TrainingJobName=name),
        failure=TrainingJobFailed,
    )


def rollback_alarm_names() -> list[str]:
    return [name.strip() for name in os.environ.get(ROLLBACK_ALARMS_ENV, "").split(",") if name.strip()]


def _deploys_config(described: dict[str, Any], config_name: str) -> bool:
    """The endpoint serves this config, or is rolling it out (UpdateEndpoint accepted)."""
    pending = described.get("PendingDeploymentSummary") or {}
    return config_name in (described.get("EndpointConfigName"), pending.get("EndpointConfigName"))


def _create_if_missing(call: Callable[..., Any], request: dict[str, Any]) -> None:
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
    """CreateModel + CreateEndpointConfig, then CreateEndpoint, or a blue/green UpdateEndpoint
    when the endpoint exists. The token is keyed by the endpoint name, so one deployment per
    endpoint runs at a time; another run's deployment → EndpointBusy (the state retries)."""
    _require(settings)
    store = store or TokenStore.from_settings(settings)
    sagemaker = sagemaker or aws.client("sagemaker")
    alarms = rollback_alarm_names() if alarm_names is None else list(alarm_names)
    config, options = task.config, task.config.run.endpoint
    endpoint = options.name
    deployment = names.deployment_name(endpoint, task.execution_arn, task.attempt)
    context = {"endpoint_config_name": deployment, "model_name": deployment, "run_id": config.run_id}
    claim = store.claim(endpoint, task.token, task.execution_arn, "endpoint", context)
    try:
        described = _describe_or_none(sagemaker.describe_endpoint, EndpointName=endpoint)
        if not claim.new and described is not None and _deploys_config(described, deployment):
            logger.info("deployment already under way", extra={"endpoint": endpoint, "config": deployment})
            return {"resource_name": endpoint, "endpoint_config_name": deployment, "created": False}
        action = _choose_action(endpoint, described)
        store.update_context(endpoint, task.token, {"action": action})
        _create_if_missing(
            sagemaker.create_model,
            sagemaker_jobs.model_request(
                model_name=deployment,
                run_id=config.run_id,
                image_uri=settings.training_image_uri,
                model_data_url=task.training.model_data_url,
                role_arn=settings.sagemaker_role_arn,
            ),
        )
        _create_if_missing(
            sagemaker.create_endpoint_config,
            sagemaker_jobs.endpoint_config_request(
                config_name=deployment, model_name=deployment, run_id=config.run_id, options=options
            ),
        )
        if action == "create":
            sagemaker.create_endpoint(
                **sagemaker_jobs.create_endpoint_request(
                    endpoint_name=endpoint, config_name=deployment, run_id=config.run_id
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
            raise EndpointBusy(_refusal(exc, "the deployment", endpoint) + "; retrying later") from exc
        raise _translate(exc, "the deployment", endpoint, EndpointDeployFailed) from exc
    except BaseException:
        store.delete(endpoint, token=task.token)
        raise
    logger.info("deployment started", extra={"endpoint": endpoint, "action": action, "config": deployment})
    return {"resource_name": endpoint, "endpoint_config_name": deployment, "action": action, "created": True}


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
            f"(aws sagemaker delete-endpoint --endpoint-name {endpoint}) and run again to recreate it"
        )
    return "update"
