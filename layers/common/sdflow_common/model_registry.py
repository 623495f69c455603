"""Register model and Wait for approval: every trained model becomes a SageMaker model package.

Register model reads the evaluation job's `evaluation.json`, registers the model as a new version
in the model package group of its run_name (`sdf-<run name>`) with its metrics (final loss, every
metric of evaluation.json for the base and the trained model) and its lineage (the run, the training job,
the evaluation job, the dataset index), and applies the quality gate (`evaluation.gate`, with the
older `evaluation.min_prompt_adherence` as its `prompt_adherence.min`; quality_gate.evaluate_gate):
- any check failed: registered Rejected, then QualityGateFailed naming every failed rule with its
  numbers (the run fails before Deploy endpoint, so the endpoint keeps serving its current model);
- passed, `approval.mode` auto: registered Approved, deployed next;
- passed, `approval.mode` manual: registered PendingManualApproval; Wait for approval parks a task
  token keyed by the package ARN, and the "SageMaker Model Package State Change" event of a
  person's `update-model-package --model-approval-status Approved|Rejected` answers it (job_events).
CreateModelPackage's ClientToken makes a retried or redriven Register model find the package its
first attempt created instead of adding a version."""

from __future__ import annotations

import json
import unicodedata
from typing import Any

from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError
from pydantic import BaseModel, ConfigDict, Field

from sdflow_common import aws, curation, evaluation_report, model_artifact, names, sagemaker_jobs
from sdflow_common.errors import EvaluationJobFailed, QualityGateFailed
from sdflow_common.evaluation import EVALUATION_FILE, GRID_FILE
from sdflow_common.job_events import ModelPackageDetail, Resolution, TaskResolver
from sdflow_common.job_starters import CallbackTask, TrainingResult
from sdflow_common.quality_gate import GATE_METRICS, GateCheck, QualityGate, evaluate_gate, number
from sdflow_common.run_config import RunConfig
from sdflow_common.run_document import parse_s3_uri
from sdflow_common.settings import Settings
from sdflow_common.token_store import TokenStore

logger = Logger(child=True)

APPROVED, REJECTED, PENDING = "Approved", "Rejected", "PendingManualApproval"
# What the endpoint serves: JSON in, JSON (base64 PNGs) or a PNG out (docs/contracts.md "Serving").
CONTENT_TYPES = ["application/json"]
RESPONSE_TYPES = ["application/json", "image/png"]
# CustomerMetadataProperties values are at most 256 characters, and a package has at most 50 of them
# (SageMaker API Reference, CreateModelPackage: CustomerMetadataProperties, "Maximum number of 50 items").
METADATA_VALUE_LIMIT = 256
METADATA_ENTRY_LIMIT = 50
MODEL_DESCRIPTION_LIMIT = 1024
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
    """evaluation.json of the evaluation job; EvaluationJobFailed when it is missing, unreadable or holds no
    metric (neither `metrics` nor an older file's flat `prompt_adherence`)."""
    bucket, key = parse_s3_uri(evaluation.scores_uri)
    try:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        scores = json.loads(body)
    except ClientError as exc:
        raise EvaluationJobFailed(
            f"the evaluation job wrote no s3://{bucket}/{key} ({sagemaker_jobs.error_code(exc)}); see its log"
        ) from exc
    except ValueError as exc:
        raise EvaluationJobFailed(f"s3://{bucket}/{key} is not JSON ({exc}); see the evaluation job's log") from exc
    if not evaluation_report.metrics_of(scores):
        missing = "; ".join(evaluation_report.missing_line(item) for item in evaluation_report.missing_of(scores))
        raise EvaluationJobFailed(
            f"s3://{bucket}/{key} holds no metric: neither `metrics` with a trained score nor `prompt_adherence`"
            + (f" ({missing})" if missing else "")
            + "; see the evaluation job's log"
        )
    return dict(scores)


def run_gate(task: RegisterTask) -> QualityGate:
    """The gate the run applies: `evaluation.gate`, with `evaluation.min_prompt_adherence` as its
    `prompt_adherence.min` (the run document refuses giving both)."""
    return task.config.run.evaluation.effective_gate


def gate_status(checks: list[GateCheck], mode: str) -> str:
    if any(not check.passed for check in checks):
        return REJECTED
    return PENDING if mode == "manual" else APPROVED


CLIPPED = "..."  # three dots, not "…": CustomerMetadataValue's pattern allows `.`, no ellipsis character


def _clip(value: Any, limit: int = METADATA_VALUE_LIMIT) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - len(CLIPPED)] + CLIPPED


def metadata_value(value: Any) -> str:
    """`value` as a CustomerMetadataValue: at most 256 of letters, spaces, digits and `_.:/=+-@`
    (`[\\p{L}\\p{Z}\\p{N}_.:\\/=+\\-@]*`, TagValue's pattern too). An execution name may hold what it refuses
    (Step Functions allows `( ) ! '`), and every URI and ARN under runs/<name>/ with it: each such character
    becomes `_` (sagemaker_jobs.tag_value), and a longer value ends in "..." (the run document keeps it whole)."""
    text = str(value)
    shaped = sagemaker_jobs.tag_value(text)  # at most TAG_VALUE_MAX = METADATA_VALUE_LIMIT characters
    return shaped if len(text) <= METADATA_VALUE_LIMIT else shaped[: -len(CLIPPED)] + CLIPPED


def _lora_summary(task: RegisterTask) -> str:
    """The adapter's shape in CustomerMetadataValue's characters (no commas: letters, digits, spaces, `_.:/=+-@`)."""
    lora = task.config.run.training.lora_options
    targets = " ".join(lora.target_modules) if lora.target_modules else "default"
    return (
        f"rank={lora.rank} alpha={lora.effective_alpha:g} dropout={lora.dropout:g} "
        f"text_encoder={str(lora.text_encoder).lower()} targets={targets}"
    )


def description_value(text: str, limit: int = MODEL_DESCRIPTION_LIMIT) -> str:
    """`text` as an EntityDescription (`[\\p{L}\\p{M}\\p{Z}\\p{S}\\p{N}\\p{P}]*`, at most 1,024): a character of none
    of those classes (a format or private-use character an execution name may hold) becomes `_`."""
    shaped = "".join(c if unicodedata.category(c)[0] in "LMZSNP" else "_" for c in text)
    return _clip(shaped, limit)


def _model_metadata(task: RegisterTask) -> dict[str, Any]:
    """What the model is: its family, how it was trained, on which base (a LoRA model needs that base)."""
    run = task.config.run
    values: dict[str, Any] = {
        "sdflow:model_family": run.base_model_family,
        "sdflow:training_method": run.training.method,
        "sdflow:training_backend": run.training.backend,
        "sdflow:base_model_uri": run.base_model_uri,
    }
    if run.training.method == "lora":
        values["sdflow:lora"] = _lora_summary(task)
    return values


def gate_metadata(gate: QualityGate) -> str:
    """The gate in CustomerMetadataValue's characters (letters, digits, spaces, `_.:/=+-@`), e.g.
    `kid max_change=0 clip_score min_change=-1`; a long gate names each metric once
    (`kid max=0.1 max_change=0`), and one still over 256 characters is cut (the run document has it whole)."""
    rules = gate.rules()
    text = " ".join(f"{metric} {bound}={limit:g}" for metric, bound, limit in rules)
    if len(text) <= METADATA_VALUE_LIMIT:
        return text
    grouped = " ".join(
        " ".join([metric, *(f"{bound}={limit:g}" for name, bound, limit in rules if name == metric)])
        for metric in gate.metrics()
    )
    return metadata_value(grouped)


def _metric_metadata(scores: dict[str, Any]) -> dict[str, str]:
    """`sdflow:<metric>` and `sdflow:base_<metric>` (4 decimals) for each known metric evaluation.json holds:
    at most two entries per metric of GATE_METRICS, so the package stays within METADATA_ENTRY_LIMIT."""
    values = {}
    for name, entry in evaluation_report.metrics_of(scores).items():
        if name not in GATE_METRICS:
            continue
        values[f"sdflow:{name}"] = f"{float(entry['trained']):.4f}"
        base = number(entry.get("base"))
        if base is not None:
            values[f"sdflow:base_{name}"] = f"{base:.4f}"
    return values


def holdout_grid_uri(task: RegisterTask, scores: dict[str, Any]) -> str | None:
    name = evaluation_report.holdout_grid_name(scores)
    return f"{task.evaluation.evaluation_uri.rstrip('/')}/{name}" if name else None


def _metadata(task: RegisterTask, scores: dict[str, Any], image: str) -> dict[str, str]:
    """Metrics and lineage where the console's model registry shows them (CustomerMetadataProperties)."""
    options = task.config.run.evaluation
    adherence = "prompt_adherence" in evaluation_report.metrics_of(scores)
    holdout_samples = evaluation_report.holdout_samples_of(scores)
    values: dict[str, Any] = (
        _model_metadata(task)
        | {
            "sdflow:image": image,
            "sdflow:run_id": task.config.run_id,
            "sdflow:execution": task.execution_arn,
            "sdflow:training_job": task.training.job_name,
            "sdflow:evaluation_job": task.evaluation.job_name,
            "sdflow:dataset_index": task.dataset.get("index_uri", ""),
            # The data card: what was read, filtered, failed, held out, deduplicated and kept.
            "sdflow:data": curation.metadata_text(task.dataset.get("curation")),
        }
        | _metric_metadata(scores)
        | {
            "sdflow:holdout_samples": "" if holdout_samples is None else holdout_samples,
            "sdflow:holdout_grid": holdout_grid_uri(task, scores) or "",
            "sdflow:gate": gate_metadata(run_gate(task)),
            "sdflow:evaluation_prompts": scores.get("prompts", "") if adherence else "",
            "sdflow:min_prompt_adherence": "" if options.min_prompt_adherence is None else options.min_prompt_adherence,
            "sdflow:samples": task.evaluation.grid_uri if adherence else "",
        }
    )
    loss = task.training.final_metrics.get(LOSS_METRIC_NAME)
    if loss is not None:
        values["sdflow:final_loss"] = f"{loss:.6f}"
    return {key: metadata_value(value) for key, value in values.items() if value != ""}


def _description(task: RegisterTask, scores: dict[str, Any]) -> str:
    """The package's description: the run, the training job and the headline metrics base -> trained."""
    metrics = evaluation_report.metrics_of(scores)
    shown = []
    for name, entry in metrics.items():
        base = number(entry.get("base"))
        base_text = f"base {evaluation_report.shown(name, base)} → " if base is not None else ""
        shown.append(f"{name} {base_text}trained {evaluation_report.shown(name, float(entry['trained']))}")
    text = f"run {task.config.run_id}: training job {task.training.job_name}; " + "; ".join(shown)
    data = curation.description_text(task.dataset.get("curation"), curation.run_filters(task.config.run))
    return description_value(f"{text}. {data}" if data else text)


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
        "ModelPackageDescription": _description(task, scores),
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


def model_package_group_request(group: str, run_name: str | None) -> dict[str, str]:
    return {
        "ModelPackageGroupName": group,
        "ModelPackageGroupDescription": _clip(f"sdflow models of run_name {run_name or '(none)'}"),
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
        sagemaker.create_model_package_group(**model_package_group_request(group, run_name))
    except ClientError as exc:
        # Another run of the same run_name created it since the describe: fine, it is shared.
        if "already exists" not in sagemaker_jobs.error_message(exc).lower():
            raise


def model_result(
    task: RegisterTask, scores: dict[str, Any], checks: list[GateCheck], arn: str, group: str, status: str
) -> dict[str, Any]:
    """`$.registry.model` (docs/contracts.md): every metric, the missing ones, the gate's checks, the held-out
    grid; and, when the scene adherence ran, the older flat keys (`prompt_adherence`, ...)."""
    metrics = evaluation_report.metrics_of(scores)
    result: dict[str, Any] = {
        "model_package_arn": arn,
        "model_package_group": group,
        "approval_status": status,
        "evaluation_uri": task.evaluation.evaluation_uri,
        "metrics": metrics,
        "missing": evaluation_report.missing_of(scores),
        "gate": [evaluation_report.check_record(check) for check in checks],
        "holdout_samples": evaluation_report.holdout_samples_of(scores) or 0,
    }
    grid = holdout_grid_uri(task, scores)
    if grid:
        result["holdout_grid_uri"] = grid
    adherence = metrics.get("prompt_adherence")
    if adherence is not None:
        result |= {
            "prompt_adherence": float(adherence["trained"]),
            "base_prompt_adherence": float(adherence.get("base", 0.0)),
            "min_prompt_adherence": task.config.run.evaluation.min_prompt_adherence,
            "prompts": int(adherence.get("samples", 0)),
            "samples_uri": task.evaluation.grid_uri,
        }
    return result


def _metric_lines(scores: dict[str, Any]) -> list[str]:
    metrics = evaluation_report.metrics_of(scores)
    missing = evaluation_report.missing_of(scores)
    return [evaluation_report.metric_line(name, entry) for name, entry in metrics.items()] + [
        evaluation_report.missing_line(item) for item in missing
    ]


def gate_failure(task: RegisterTask, checks: list[GateCheck], arn: str, scores: dict[str, Any]) -> str:
    """QualityGateFailed's message: every failed rule with base, trained and limit, the package, the endpoint,
    and where the held-out grid and the scores are."""
    failed = [check for check in checks if not check.passed]
    grid = holdout_grid_uri(task, scores)
    where = [f"held-out grid (real | base | trained per caption): {grid}"] if grid else []
    if "prompt_adherence" in evaluation_report.metrics_of(scores):
        where.append(f"scene prompts grid (base | trained per prompt): {task.evaluation.grid_uri}")
    return "\n".join(
        [
            f"the trained model failed {len(failed)} of {len(checks)} quality gate checks (evaluation.gate):",
            *(f"  {evaluation_report.gate_line(check)}" for check in failed),
            "every metric, base → trained:",
            *(f"  {line}" for line in _metric_lines(scores)),
            f"Model package {arn} is registered as Rejected and was not deployed; endpoint "
            f"{task.config.run.endpoint.name} keeps serving its current model.",
            *where,
            f"scores: {task.evaluation.scores_uri}",
        ]
    )


def register_model(task: RegisterTask, settings: Settings, *, sagemaker: Any = None, s3: Any = None) -> dict[str, Any]:
    """Register the trained model and apply the quality gate (see the module docstring)."""
    settings.image_uri(task.config.run.training.backend)  # fails fast when the function lacks the run's image
    sagemaker = sagemaker or aws.client("sagemaker")
    scores = read_evaluation(s3 or aws.client("s3"), task.evaluation)
    run = task.config.run
    checks = evaluate_gate(run_gate(task), evaluation_report.metrics_of(scores))
    status = gate_status(checks, run.approval.mode)
    group = names.model_package_group_name(run.run_name)
    ensure_group(sagemaker, group, run.run_name)
    request = model_package_request(task, settings, group, status, scores)
    arn = str(sagemaker.create_model_package(**request)["ModelPackageArn"])
    result = model_result(task, scores, checks, arn, group, status)
    logger.info("model registered", extra=result)
    if status == REJECTED:
        raise QualityGateFailed(gate_failure(task, checks, arn, scores))
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
