"""Register model and Wait for approval: every trained model becomes a SageMaker model package.

Register model reads the evaluation job's `evaluation.json`, registers the model as a new version
in the model package group of its run_name (`sdf-<run name>`) with its metrics (final loss,
prompt adherence of the base and the trained model) and its lineage (the run, the training job,
the evaluation job, the dataset index), and applies the quality gate:
- below `evaluation.min_prompt_adherence`: registered Rejected, then QualityGateFailed (the run
  fails before Deploy endpoint, so the endpoint keeps serving its current model);
- passed, `approval.mode` auto: registered Approved, deployed next;
- passed, `approval.mode` manual: registered PendingManualApproval; Wait for approval parks a task
  token keyed by the package ARN, and the "SageMaker Model Package State Change" event of a
  person's `update-model-package --model-approval-status Approved|Rejected` answers it (job_events).
CreateModelPackage's ClientToken makes a retried or redriven Register model find the package its
first attempt created instead of adding a version."""

from __future__ import annotations

import json
from typing import Any

from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError
from pydantic import BaseModel, ConfigDict, Field

from sdflow_common import aws, model_artifact, names, sagemaker_jobs
from sdflow_common.errors import EvaluationJobFailed, QualityGateFailed
from sdflow_common.evaluation import EVALUATION_FILE, GRID_FILE
from sdflow_common.job_events import ModelPackageDetail, Resolution, TaskResolver
from sdflow_common.job_starters import CallbackTask, TrainingResult
from sdflow_common.run_document import parse_s3_uri
from sdflow_common.settings import Settings
from sdflow_common.token_store import TokenStore
from sdflow_common.validate_run import RunConfig

logger = Logger(child=True)

APPROVED, REJECTED, PENDING = "Approved", "Rejected", "PendingManualApproval"
# What the endpoint serves: JSON in, JSON (base64 PNGs) or a PNG out (docs/contracts.md "Serving").
CONTENT_TYPES = ["application/json"]
RESPONSE_TYPES = ["application/json", "image/png"]
# CustomerMetadataProperties values are at most 256 characters.
METADATA_VALUE_LIMIT = 256
# The training job's loss metric (sagemaker_jobs.LOSS_METRIC).
LOSS_METRIC_NAME = "train:loss"
# A LoRA model's archive holds only the adapter; the serving container finds the base model in the
# AdditionalModelDataSources channel of this name. SageMaker places such a channel's files under
# /opt/ml/additional-model-data-sources/<ChannelName>/ (SageMaker API Reference, CreateModel:
# ContainerDefinition.AdditionalModelDataSources and AdditionalModelDataSource, "data sources that are
# available to your model in addition to the one that you specify for ModelDataSource"; the path as the
# AWS provider for Terraform documents ChannelName: "It will be stored in
# /opt/ml/additional-model-data-sources/<channel_name>/"). CreateModelPackage's
# ModelPackageContainerDefinition carries the same list, and a model created from the package
# (CreateModel with ModelPackageName) serves the package's container with it.
BASE_MODEL_CHANNEL = "base_model"
BASE_MODEL_DIR = f"/opt/ml/additional-model-data-sources/{BASE_MODEL_CHANNEL}"
# The serving container's environment variable naming that folder (the contract with the image).
BASE_MODEL_DIR_ENV = "SDFLOW_BASE_MODEL_DIR"


class _Payload(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class EvaluationResult(_Payload):
    """`$.evaluation`: job_events' answer for the evaluation job."""

    job_name: str
    evaluation_uri: str = Field(min_length=6)

    @property
    def scores_uri(self) -> str:
        return self.evaluation_uri.rstrip("/") + "/" + EVALUATION_FILE

    @property
    def grid_uri(self) -> str:
        return self.evaluation_uri.rstrip("/") + "/" + GRID_FILE


class RegisterTask(_Payload):
    execution_arn: str = Field(min_length=1)
    start_time: str | int
    redrive_count: int = Field(default=0, ge=0)
    config: RunConfig
    training: TrainingResult
    evaluation: EvaluationResult
    dataset: dict[str, Any] = Field(default_factory=dict)

    @property
    def run_hash(self) -> str:
        return names.run_hash(self.execution_arn, self.start_time)


class ApprovalTask(CallbackTask):
    model_package_arn: str = Field(min_length=20)
    run_id: str = Field(min_length=1)


def read_evaluation(s3: Any, evaluation: EvaluationResult) -> dict[str, Any]:
    """evaluation.json of the evaluation job; EvaluationJobFailed when it is missing or unreadable."""
    bucket, key = parse_s3_uri(evaluation.scores_uri)
    try:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        scores = json.loads(body)
        float(scores["prompt_adherence"])
    except ClientError as exc:
        raise EvaluationJobFailed(
            f"the evaluation job wrote no s3://{bucket}/{key} ({sagemaker_jobs.error_code(exc)}); see its log"
        ) from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise EvaluationJobFailed(f"s3://{bucket}/{key} holds no prompt_adherence score ({exc})") from exc
    return dict(scores)


def gate_status(score: float, minimum: float | None, mode: str) -> str:
    if minimum is not None and score < minimum:
        return REJECTED
    return PENDING if mode == "manual" else APPROVED


def _clip(value: Any) -> str:
    text = str(value)
    return text if len(text) <= METADATA_VALUE_LIMIT else text[: METADATA_VALUE_LIMIT - 1] + "…"


def _lora_summary(task: RegisterTask) -> str:
    """The adapter's shape in CustomerMetadataValue's characters (no commas: letters, digits, spaces, `_.:/=+-@`)."""
    lora = task.config.run.training.lora_options
    targets = " ".join(lora.target_modules) if lora.target_modules else "default"
    return (
        f"rank={lora.rank} alpha={lora.effective_alpha:g} dropout={lora.dropout:g} "
        f"text_encoder={str(lora.text_encoder).lower()} targets={targets}"
    )


def _model_metadata(task: RegisterTask) -> dict[str, Any]:
    """What the model is: its family, how it was trained, on which base (a LoRA model needs that base)."""
    run = task.config.run
    values: dict[str, Any] = {
        "sdflow:model_family": run.base_model_family,
        "sdflow:training_method": run.training.method,
        "sdflow:training_backend": run.training.backend,
        "sdflow:base_model_uri": sagemaker_jobs.tag_value(run.base_model_uri),
    }
    if run.training.method == "lora":
        values["sdflow:lora"] = _lora_summary(task)
    return values


def _metadata(task: RegisterTask, scores: dict[str, Any], image: str) -> dict[str, str]:
    """Metrics and lineage where the console's model registry shows them (CustomerMetadataProperties)."""
    options = task.config.run.evaluation
    values: dict[str, Any] = _model_metadata(task) | {
        "sdflow:image": sagemaker_jobs.tag_value(image),
        "sdflow:run_id": task.config.run_id,
        "sdflow:execution": task.execution_arn,
        "sdflow:training_job": task.training.job_name,
        "sdflow:evaluation_job": task.evaluation.job_name,
        "sdflow:dataset_index": task.dataset.get("index_uri", ""),
        "sdflow:prompt_adherence": f"{float(scores['prompt_adherence']):.4f}",
        "sdflow:base_prompt_adherence": f"{float(scores.get('base_prompt_adherence', 0.0)):.4f}",
        "sdflow:evaluation_prompts": scores.get("prompts", ""),
        "sdflow:min_prompt_adherence": "" if options.min_prompt_adherence is None else options.min_prompt_adherence,
        "sdflow:samples": task.evaluation.grid_uri,
    }
    loss = task.training.final_metrics.get(LOSS_METRIC_NAME)
    if loss is not None:
        values["sdflow:final_loss"] = f"{loss:.6f}"
    return {key: _clip(value) for key, value in values.items() if value != ""}


def base_model_folder(base_model_uri: str) -> str:
    """The base model's folder as an S3Prefix: "a valid key name prefix identified by S3Uri always ends
    with a forward slash" (SageMaker API Reference, S3ModelDataSource.S3DataType)."""
    return base_model_uri if base_model_uri.endswith("/") else f"{base_model_uri}/"


def serving_container(task: RegisterTask, settings: Settings) -> dict[str, Any]:
    """The package's container: the image of the run's backend (the model loads only in its stack) and the
    trained model (ModelDataSource: the uncompressed output's prefix, its files into /opt/ml/model); for
    LoRA also the base model, as an uncompressed S3 prefix in the `base_model` channel, and the variable
    naming where it lands."""
    run = task.config.run
    image = settings.image_uri(run.training.backend)
    container: dict[str, Any] = {
        "Image": image,
        "ModelDataSource": model_artifact.model_data_source(task.training.model_data_url),
    }
    if run.training.method == "lora":
        container["AdditionalModelDataSources"] = [
            {
                "ChannelName": BASE_MODEL_CHANNEL,
                "S3DataSource": {
                    "S3Uri": base_model_folder(run.base_model_uri),
                    "S3DataType": "S3Prefix",
                    "CompressionType": "None",
                },
            }
        ]
        container["Environment"] = {BASE_MODEL_DIR_ENV: BASE_MODEL_DIR}
    return container


def model_package_request(
    task: RegisterTask, settings: Settings, group: str, status: str, scores: dict[str, Any]
) -> dict[str, Any]:
    endpoint = task.config.run.endpoint
    container = serving_container(task, settings)
    return {
        "ModelPackageGroupName": group,
        "ModelPackageDescription": _clip(
            f"run {task.config.run_id}: training job {task.training.job_name}, prompt adherence "
            f"{float(scores['prompt_adherence']):.2f}"
        ),
        "InferenceSpecification": {
            "Containers": [container],
            "SupportedContentTypes": CONTENT_TYPES,
            "SupportedResponseMIMETypes": RESPONSE_TYPES,
            "SupportedRealtimeInferenceInstanceTypes": [endpoint.instance_type],
        },
        "ModelApprovalStatus": status,
        "MetadataProperties": {"GeneratedBy": task.execution_arn[:1024], "ProjectId": task.config.run_id[:1024]},
        "ModelMetrics": {
            "ModelQuality": {"Statistics": {"ContentType": "application/json", "S3Uri": task.evaluation.scores_uri}}
        },
        "CustomerMetadataProperties": _metadata(task, scores, container["Image"]),
        # 1-36 characters: the same for every attempt and redrive of this training + evaluation pair.
        "ClientToken": names.short_hash(task.run_hash, task.training.job_name, task.evaluation.job_name, length=32),
        "Tags": sagemaker_jobs.tags(task.config.run_id, task.run_hash),
    }


def ensure_group(sagemaker: Any, group: str, run_name: str | None) -> None:
    """The run_name's package group, created by its first run; later runs add versions to it."""
    try:
        sagemaker.describe_model_package_group(ModelPackageGroupName=group)
        return
    except ClientError as exc:
        if sagemaker_jobs.error_code(exc) != "ValidationException":
            raise
    try:
        sagemaker.create_model_package_group(
            ModelPackageGroupName=group,
            ModelPackageGroupDescription=_clip(f"sdflow models of run_name {run_name or '(none)'}"),
        )
    except ClientError as exc:
        # Another run of the same run_name created it since the describe: fine, it is shared.
        if "already exists" not in sagemaker_jobs.error_message(exc).lower():
            raise


def register_model(task: RegisterTask, settings: Settings, *, sagemaker: Any = None, s3: Any = None) -> dict[str, Any]:
    """Register the trained model and apply the quality gate (see the module docstring)."""
    settings.image_uri(task.config.run.training.backend)  # fails fast when the function lacks the run's image
    sagemaker = sagemaker or aws.client("sagemaker")
    scores = read_evaluation(s3 or aws.client("s3"), task.evaluation)
    score = float(scores["prompt_adherence"])
    run = task.config.run
    minimum = run.evaluation.min_prompt_adherence
    status = gate_status(score, minimum, run.approval.mode)
    group = names.model_package_group_name(run.run_name)
    ensure_group(sagemaker, group, run.run_name)
    request = model_package_request(task, settings, group, status, scores)
    arn = str(sagemaker.create_model_package(**request)["ModelPackageArn"])
    result = {
        "model_package_arn": arn,
        "model_package_group": group,
        "approval_status": status,
        "prompt_adherence": score,
        "base_prompt_adherence": float(scores.get("base_prompt_adherence", 0.0)),
        "min_prompt_adherence": minimum,
        "prompts": int(scores.get("prompts", 0)),
        "samples_uri": task.evaluation.grid_uri,
        "evaluation_uri": task.evaluation.evaluation_uri,
    }
    logger.info("model registered", extra=result)
    if status == REJECTED:
        raise QualityGateFailed(
            f"prompt adherence {score:.2f} is below the quality gate {minimum:.2f} "
            f"(evaluation.min_prompt_adherence): model package {arn} is registered as Rejected and was not "
            f"deployed; endpoint {run.endpoint.name} keeps serving its current model. Samples (base | trained "
            f"per prompt): {task.evaluation.grid_uri}; scores: {task.evaluation.scores_uri}"
        )
    return result


def await_approval(
    task: ApprovalTask,
    settings: Settings,
    *,
    store: TokenStore | None = None,
    sagemaker: Any = None,
    sfn: Any = None,
) -> dict[str, Any]:
    """Park the task token under the package's ARN until a person approves or rejects it. A package
    decided already (between Register model and now, or before a redrive) answers at once."""
    settings.require("token_table")
    store = store or TokenStore.from_settings(settings)
    sagemaker = sagemaker or aws.client("sagemaker")
    arn = task.model_package_arn
    store.claim(
        arn, task.token, task.execution_arn, "approval", {"run_id": task.run_id}, timeout_seconds=task.timeout_seconds
    )
    described = sagemaker.describe_model_package(ModelPackageName=arn)
    detail = ModelPackageDetail.model_validate(described)
    if detail.is_terminal():
        resolver = TaskResolver(store, sfn or aws.client("stepfunctions"), sagemaker)
        resolution: Resolution = resolver.resolve(detail)
        logger.info("model package already decided", extra=resolution.as_dict())
        return {"model_package_arn": arn, "waiting": False, "approval_status": detail.status}
    logger.info("waiting for approval", extra={"model_package_arn": arn, "timeout_seconds": task.timeout_seconds})
    return {"model_package_arn": arn, "waiting": True, "approval_status": detail.status}
