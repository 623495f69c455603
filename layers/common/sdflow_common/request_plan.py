"""Every SageMaker request a run will make, built at Validate run with the starters' own builders and checked
against the API's constraints (sdflow_common.request_limits) before anything is spent.

A run that SageMaker would refuse at Register model (a metadata value over 256 characters, a character a pattern
refuses) must fail before its downloads and its GPU instances are paid for. So `planned_requests` builds, from
`$.config` and the stack's Settings, the download job of the longest shard URI, the dedup job (when
deduplication.enabled), the training job, the evaluation job, the model package group, the model package, the
model, the endpoint config and both the CreateEndpoint and the UpdateEndpoint a deployment may send, each with
what is unknown until then at its worst:
- the names with the widest redrive and attempt counters a name is cut for (names._COUNTER_ROOM: r1000-a1000);
- the model package with a score for every gate metric and a loss written as the longest number text
  (`-1.797…e308` as `%.4f`, over 300 characters), so the metadata's shaping and cutting are what is checked;
- the model package ARN with a nine-digit version (the most its pattern allows).
`check_requests` refuses with InvalidRunDocument, each problem naming the run document's field (or
"(execution name)", or "(stack)" for the stack's own settings), SageMaker's limit in its words, and a fix.

What botocore's service model carries (and so what is checked here): string lengths and patterns, integer
maximums, list and map sizes, enums. What it does not (cross-field rules, the instance types a Region offers, the
account's quotas) is checked elsewhere at intake (model_family, quotas) or not at all."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sdflow_common import (
    dataset_manifest,
    dedup_job,
    evaluation,
    job_starters,
    model_artifact,
    model_registry,
    names,
    request_limits,
    sagemaker_jobs,
)
from sdflow_common.dataset_filters import filter_arguments
from sdflow_common.quality_gate import GATE_METRICS
from sdflow_common.run_config import RunConfig
from sdflow_common.run_document import RunDocument, invalid
from sdflow_common.settings import Settings

# The widest counters a name's readable part is cut for (names._COUNTER_ROOM): Step Functions allows 1,000
# redrives of an execution; no state of the pipeline retries 1,000 times.
WORST_REDRIVE = 1000
WORST_ATTEMPT = 1000
# The longest text `%.4f` / `%.6f` makes of a float: what a metric or the loss may put in the metadata.
WORST_NUMBER = -1.7976931348623157e308
WORST_COUNT = 10**9
WORST_PACKAGE_VERSION = 999_999_999  # CreateModel's ModelPackageName pattern: a version of 1 to 9 digits
EXECUTION_FIELD = "(execution name)"
STACK_FIELD = "(stack)"


@dataclass(frozen=True)
class PlannedRequest:
    """One request the run will send: the API operation, what it is for, the request itself, and which run
    document field each part of it comes from (AWS's member path prefix → field; the first match wins)."""

    operation: str
    label: str
    request: dict[str, Any]
    fields: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    default_field: str = EXECUTION_FIELD

    def field_of(self, path: str) -> str:
        for prefix, name in self.fields:
            if path == prefix or path.startswith((f"{prefix}.", f"{prefix}[")):
                return name
        return self.default_field


def worst_scores() -> dict[str, Any]:
    """evaluation.json with every gate metric, each number the longest text it can be, a held-out grid."""
    metrics = {name: {"trained": WORST_NUMBER, "base": WORST_NUMBER, "samples": WORST_COUNT} for name in GATE_METRICS}
    return {"metrics": metrics, "prompts": WORST_COUNT, "holdout": {"grid": "holdout.png", "samples": WORST_COUNT}}


@dataclass(frozen=True)
class Unknowns:
    """What Validate run cannot know yet: the counters a name will carry, the evaluation's scores, the final loss,
    the model package's version. The defaults are the worst; a test draws others (what a later call will carry)."""

    redrive: int = WORST_REDRIVE
    attempt: int = WORST_ATTEMPT
    scores: dict[str, Any] = field(default_factory=worst_scores)
    loss: float = WORST_NUMBER
    package_version: int = WORST_PACKAGE_VERSION


@dataclass(frozen=True)
class _Worst:
    """The run's identity and the unknowns: what every name and URI is built from."""

    config: RunConfig
    settings: Settings
    run_hash: str
    unknowns: Unknowns = field(default_factory=Unknowns)

    @property
    def run(self) -> RunDocument:
        return self.config.run

    @property
    def image(self) -> str:
        return self.settings.image_uri(self.run.training.backend)


# ---------------------------------------------------------------------------- fields


def _hyperparameter_field(name: str) -> str:
    """The run document field a training hyperparameter comes from (TrainingOptions.hyperparameters)."""
    special = {
        "base_model_uri": "base_model_uri",
        "model_family": "base_model_family",
        "train_text_encoder_lora": "training.lora.text_encoder",
        "training_method": "training.method",
        "dataset_dir": EXECUTION_FIELD,
        "dataset_index": EXECUTION_FIELD,
        "checkpoint_s3_uri": EXECUTION_FIELD,
    }
    if name in special:
        return special[name]
    if name.startswith("lora_"):
        return f"training.lora.{name.removeprefix('lora_')}"
    return f"training.{name}"


def _argument_fields(path: str, arguments: list[str], flag_fields: dict[str, str]) -> list[tuple[str, str]]:
    """Each ContainerArguments item (AWS numbers them from 1) → the field of the last flag before it (or itself)."""
    found, flag = [], ""
    for position, item in enumerate(arguments):
        flag = item if item.startswith("--") else flag
        found.append((f"{path}.{position + 1}.member", flag_fields.get(flag, EXECUTION_FIELD)))
    return found


# ---------------------------------------------------------------------------- requests


def _longest_shard(config: RunConfig, shards: list[dict[str, Any]] | None) -> tuple[dict[str, Any], str]:
    """The shard whose parquet URI is longest (all output URIs and shard ids have one length), and its field."""
    dataset = config.run.dataset
    if shards is None:
        uris = list(dataset.parquet_uris or [f"{(dataset.prefix or '').rstrip('/')}/part.parquet"])
        shards = [{"shard_id": f"{position:05d}", "parquet_uri": uri} for position, uri in enumerate(uris)]
    longest = max(shards, key=lambda shard: len(str(shard["parquet_uri"])))
    if dataset.parquet_uris is not None and longest["parquet_uri"] in dataset.parquet_uris:
        source = f"dataset.parquet_uris.{dataset.parquet_uris.index(longest['parquet_uri'])}"
    else:
        source = "dataset.prefix"
    root = f"s3://{config.bucket}/runs/{config.run_id}/dataset/shards/"
    return {**longest, "output_uri": longest.get("output_uri") or f"{root}{longest['shard_id']}/"}, source


def _download(worst: _Worst, shards: list[dict[str, Any]] | None) -> PlannedRequest:
    config, run = worst.config, worst.run
    shard, source = _longest_shard(config, shards)
    shard_id = str(shard["shard_id"])
    request = sagemaker_jobs.processing_job_request(
        job_name=names.download_job_name(
            worst.run_hash, config.run_id, shard_id, worst.unknowns.redrive, worst.unknowns.attempt
        ),
        run_id=config.run_id,
        run_hash=worst.run_hash,
        shard_id=shard_id,
        parquet_uri=str(shard["parquet_uri"]),
        output_uri=str(shard["output_uri"]),
        options=run.download,
        url_column=run.dataset.url_column,
        caption_column=run.dataset.caption_column,
        image_uri=worst.settings.training_image_uri,
        role_arn=worst.settings.sagemaker_role_arn,
        holdout_rate=config.holdout_rate,
        filters=filter_arguments(run.dataset.filters, run.dataset.caption_column),
    )
    arguments = list(request["AppSpecification"].get("ContainerArguments", []))
    flags = {
        "--url_col": "dataset.url_column",
        "--caption_col": "dataset.caption_column",
        "--filters": "dataset.filters",
    }
    flags |= {f"--{name}": f"download.{name}" for name in ("image_size", "resize_mode", "samples_per_shard")}
    flags |= {"--processes": "download.processes", "--threads": "download.threads", "--filters": "dataset.filters"}
    flags |= {"--url_timeout": "download.url_timeout_seconds", "--deadline_seconds": "download.max_runtime_seconds"}
    fields = (
        ("processingInputs", source),
        ("processingResources.clusterConfig.instanceType", "download.instance_type"),
        ("processingResources.clusterConfig.volumeSizeInGB", "download.samples_per_shard"),
        ("stoppingCondition", "download.max_runtime_seconds"),
        ("appSpecification.imageUri", STACK_FIELD),
        ("roleArn", STACK_FIELD),
        *_argument_fields("appSpecification.containerArguments", arguments, flags),
    )
    return PlannedRequest("CreateProcessingJob", "download job", dict(request), fields, EXECUTION_FIELD)


def _dedup(worst: _Worst) -> list[PlannedRequest]:
    """Find duplicates' job, when the run has one (deduplication.enabled)."""
    config, unknowns, stack = worst.config, worst.unknowns, worst.settings
    if not config.run.deduplication.enabled:
        return []
    name = names.dedup_job_name(worst.run_hash, config.run_id, unknowns.redrive, unknowns.attempt)
    request = dedup_job.dedup_job_request(
        job_name=name,
        config=config,
        run_hash=worst.run_hash,
        image_uri=stack.training_image_uri,
        role_arn=stack.sagemaker_role_arn,
    )
    fields = (*dedup_job.DOCUMENT_FIELDS, ("appSpecification.imageUri", STACK_FIELD), ("roleArn", STACK_FIELD))
    return [PlannedRequest("CreateProcessingJob", "dedup job", request, fields, EXECUTION_FIELD)]


def _training_job_name(worst: _Worst) -> str:
    return names.training_job_name(worst.run_hash, worst.config.run_id, worst.unknowns.redrive, worst.unknowns.attempt)


def _training(worst: _Worst) -> PlannedRequest:
    config = worst.config
    request = sagemaker_jobs.training_job_request(
        job_name=_training_job_name(worst),
        run_id=config.run_id,
        run_hash=worst.run_hash,
        bucket=config.bucket,
        dataset_prefix_uri=config.dataset_prefix_uri,
        run=config.run,
        image_uri=worst.image,
        role_arn=worst.settings.sagemaker_role_arn,
    )
    hyperparameters = request.get("HyperParameters", {})
    fields = (
        *((f"hyperParameters.{name}", _hyperparameter_field(name)) for name in hyperparameters),
        ("hyperParameters", "training"),
        ("inputDataConfig", "base_model_uri"),
        ("resourceConfig.instanceType", "training.instance_type"),
        ("resourceConfig.instanceCount", "training.instance_count"),
        ("resourceConfig.volumeSizeInGB", "training.volume_size_gb"),
        ("resourceConfig.keepAlivePeriodInSeconds", "training.keep_alive_seconds"),
        ("stoppingCondition.maxRuntimeInSeconds", "training.max_runtime_seconds"),
        ("stoppingCondition.maxWaitTimeInSeconds", "training.max_wait_seconds"),
        ("retryStrategy", "training.max_retry_attempts"),
        ("algorithmSpecification.trainingImage", STACK_FIELD),
        ("roleArn", STACK_FIELD),
    )
    return PlannedRequest("CreateTrainingJob", "training job", dict(request), fields, EXECUTION_FIELD)


def _training_result(worst: _Worst) -> job_starters.TrainingResult:
    config, name = worst.config, _training_job_name(worst)
    output = f"s3://{config.bucket}/runs/{config.run_id}/training/"
    return job_starters.TrainingResult(
        job_name=name,
        model_data_url=model_artifact.expected_location(output, name, model_artifact.UNCOMPRESSED),
        final_metrics={model_registry.LOSS_METRIC_NAME: worst.unknowns.loss},
    )


def _evaluation_job_name(worst: _Worst) -> str:
    return names.evaluation_job_name(
        worst.run_hash, worst.config.run_id, worst.unknowns.redrive, worst.unknowns.attempt
    )


def _prompts_uri(config: RunConfig) -> str | None:
    """The prompts' object the evaluation reads (evaluation._prompts_uri, without writing it)."""
    options = config.run.evaluation
    if not options.scene_adherence_on:
        return None
    if options.prompts_uri:
        return options.prompts_uri
    return None if options.prompts is None else f"s3://{config.bucket}/{evaluation.prompts_key(config.run_id)}"


def _evaluation(worst: _Worst) -> PlannedRequest:
    config = worst.config
    options = config.run.evaluation
    holdout = dataset_manifest.holdout_manifest_uri(config.dataset_prefix_uri) if options.holdout_samples else None
    request = evaluation.evaluation_job_request(
        job_name=_evaluation_job_name(worst),
        config=config,
        run_hash=worst.run_hash,
        model_data_url=_training_result(worst).model_data_url,
        prompts_uri=_prompts_uri(config),
        holdout_manifest_uri=holdout,
        image_uri=worst.image,
        role_arn=worst.settings.sagemaker_role_arn,
    )
    input_fields = {
        "base_model": "base_model_uri",
        "prompts": "evaluation.prompts_uri" if options.prompts_uri else "evaluation.prompts",
        "clip_model": "evaluation.clip_model_uri",
    }
    inputs = [
        (f"processingInputs.{position}.member", input_fields.get(str(item["InputName"]), EXECUTION_FIELD))
        for position, item in enumerate(request["ProcessingInputs"], start=1)
    ]
    flags = {
        "--num_inference_steps": "evaluation.num_inference_steps",
        "--guidance_scale": "evaluation.guidance_scale",
        "--seed": "training.seed",
        "--prompts_file": input_fields["prompts"],
        "--holdout_samples": "evaluation.holdout_samples",
    }
    arguments = list(request["AppSpecification"]["ContainerArguments"])
    fields = (
        *inputs,
        ("processingResources.clusterConfig.instanceType", "evaluation.instance_type"),
        ("stoppingCondition", "evaluation.max_runtime_seconds"),
        ("appSpecification.imageUri", STACK_FIELD),
        ("roleArn", STACK_FIELD),
        *_argument_fields("appSpecification.containerArguments", arguments, flags),
    )
    return PlannedRequest("CreateProcessingJob", "evaluation job", request, fields, EXECUTION_FIELD)


def _register_task(worst: _Worst) -> model_registry.RegisterTask:
    config, job = worst.config, _evaluation_job_name(worst)
    return model_registry.RegisterTask(
        execution_arn=config.execution_arn,
        start_time=config.started_at,
        redrive_count=worst.unknowns.redrive,
        config=config,
        training=_training_result(worst),
        evaluation=model_registry.EvaluationResult(
            job_name=job, evaluation_uri=evaluation.output_uri(config.bucket, config.run_id, job)
        ),
        dataset={"index_uri": dataset_manifest.index_uri(config.dataset_prefix_uri)},
    )


def _registry(worst: _Worst) -> list[PlannedRequest]:
    group = names.model_package_group_name(worst.run.run_name)
    package = model_registry.model_package_request(
        _register_task(worst), worst.settings, group, model_registry.PENDING, worst.unknowns.scores
    )
    fields = (
        ("modelPackageGroupName", "run_name"),
        ("inferenceSpecification.supportedRealtimeInferenceInstanceTypes", "endpoint.instance_type"),
        ("inferenceSpecification.containers.1.member.additionalModelDataSources", "base_model_uri"),
        ("inferenceSpecification.containers.1.member.image", STACK_FIELD),
        ("customerMetadataProperties.sdflow:lora", "training.lora.target_modules"),
        ("customerMetadataProperties.sdflow:base_model_uri", "base_model_uri"),
        ("customerMetadataProperties.sdflow:gate", "evaluation.gate"),
    )
    return [
        PlannedRequest(
            "CreateModelPackageGroup",
            "model package group",
            model_registry.model_package_group_request(group, worst.run.run_name),
            (),
            "run_name",
        ),
        PlannedRequest("CreateModelPackage", "model package", package, fields, EXECUTION_FIELD),
    ]


def _package_arn(worst: _Worst) -> str:
    """arn:aws:sagemaker:<region>:<account>:model-package/<group>/<version>, in the execution's Region and account."""
    parts = worst.config.execution_arn.split(":")
    region, account = (parts[3], parts[4]) if len(parts) > 4 else ("us-east-1", "000000000000")
    group = names.model_package_group_name(worst.run.run_name)
    return f"arn:aws:sagemaker:{region}:{account}:model-package/{group}/{worst.unknowns.package_version}"


def _deployment(worst: _Worst) -> list[PlannedRequest]:
    config, options = worst.config, worst.run.endpoint
    name = names.deployment_name(options.name, worst.run_hash, worst.unknowns.redrive, worst.unknowns.attempt)
    model = sagemaker_jobs.model_request(
        model_name=name,
        run_id=config.run_id,
        run_hash=worst.run_hash,
        model_package_arn=_package_arn(worst),
        role_arn=worst.settings.sagemaker_role_arn,
    )
    endpoint_config = sagemaker_jobs.endpoint_config_request(
        config_name=name,
        model_name=name,
        run_id=config.run_id,
        run_hash=worst.run_hash,
        options=options,
        backend=worst.run.training.backend,
    )
    create = sagemaker_jobs.create_endpoint_request(
        endpoint_name=options.name, config_name=name, run_id=config.run_id, run_hash=worst.run_hash
    )
    update = sagemaker_jobs.update_endpoint_request(
        endpoint_name=options.name,
        config_name=name,
        options=options,
        rollback_alarm_names=job_starters.rollback_alarm_names(),
    )
    variant = "productionVariants.1.member"
    return [
        PlannedRequest("CreateModel", "model", dict(model), (("executionRoleArn", STACK_FIELD),), "endpoint.name"),
        PlannedRequest(
            "CreateEndpointConfig",
            "endpoint config",
            dict(endpoint_config),
            (
                (f"{variant}.instanceType", "endpoint.instance_type"),
                (f"{variant}.initialInstanceCount", "endpoint.initial_instance_count"),
                ("tags", EXECUTION_FIELD),
            ),
            "endpoint.name",
        ),
        PlannedRequest(
            "CreateEndpoint", "endpoint (create)", dict(create), (("tags", EXECUTION_FIELD),), "endpoint.name"
        ),
        PlannedRequest(
            "UpdateEndpoint",
            "endpoint (update)",
            dict(update),
            (
                ("deploymentConfig.autoRollbackConfiguration", STACK_FIELD),
                ("deploymentConfig", "endpoint.max_wait_seconds"),
            ),
            "endpoint.name",
        ),
    ]


def planned_requests(
    config: dict[str, Any],
    settings: Settings,
    *,
    shards: list[dict[str, Any]] | None = None,
    unknowns: Unknowns | None = None,
) -> list[PlannedRequest]:
    """Every request the run of `config` (`$.config`, as Validate run returns it) will make, in the order it makes
    them; the download job for the shard of `shards` (shards.json's items) with the longest URI (default: the
    document's parquet_uris, or one file under its prefix); what is unknown yet at its worst (`unknowns`)."""
    parsed = RunConfig.model_validate(config)
    worst = _Worst(parsed, settings, names.run_hash(parsed.execution_arn, parsed.started_at), unknowns or Unknowns())
    return [
        _download(worst, shards),
        *_dedup(worst),
        _training(worst),
        _evaluation(worst),
        *_registry(worst),
        *_deployment(worst),
    ]


# ---------------------------------------------------------------------------- refusals


_AT = re.compile(r" at '([^']*)' failed to satisfy constraint")


def _fix(field_name: str) -> str:
    if field_name == EXECUTION_FIELD:
        return (
            "start the run under another execution name (shorter, or without the characters named): it is part of "
            "this value"
        )
    if field_name == STACK_FIELD:
        return "this value is the stack's (template parameters, the images' tags): fix the stack, not the document"
    return f"change {field_name} so that the value fits"


_ENUM = re.compile(r"^(?P<head>Value '(?P<value>[^']*)'.* enum value set: )\[(?P<values>[^\]]*)\]$")
ENUM_SHOWN = 8


def _short_enum(text: str) -> str:
    """An enum refusal with the values nearest the one given (same family: `ml.c5.` for ml.c5.3xlarge), not the
    hundreds an instance type's enum holds."""
    match = _ENUM.match(text)
    if match is None:
        return text
    values = match["values"].split(", ")
    family = match["value"].rsplit(".", 1)[0] + "."
    near = [value for value in values if value.startswith(family)] or values
    shown = ", ".join(near[:ENUM_SHOWN]) + (", ..." if len(near) > ENUM_SHOWN else "")
    return f"{match['head']}[{shown}] ({len(values)} values in all)"


def _problem(planned: PlannedRequest, text: str) -> dict[str, str]:
    text = _short_enum(text)
    match = _AT.search(text)
    field_name = planned.field_of(match.group(1)) if match else planned.default_field
    return {
        "field": field_name,
        "message": f"the {planned.label}'s {planned.operation} would be refused by SageMaker: {text}; "
        f"{_fix(field_name)}",
    }


def request_problems(requests: list[PlannedRequest]) -> list[dict[str, str]]:
    """Every constraint of botocore's model a planned request breaks, as run document problems."""
    return [
        _problem(planned, text)
        for planned in requests
        for text in request_limits.operation_problems(planned.operation, planned.request)
    ]


def _building(build: Callable[[], list[PlannedRequest]]) -> list[PlannedRequest]:
    """The requests, or the run document problem that kept one from being built."""
    try:
        return build()
    except names.InvalidNameInput as exc:
        raise invalid([{"field": EXECUTION_FIELD, "message": f"{exc}; start the run under another name"}]) from exc
    except sagemaker_jobs.DownloadVolumeTooLarge as exc:
        raise invalid([{"field": "download.samples_per_shard", "message": str(exc)}]) from exc


def check_requests(
    config: dict[str, Any], settings: Settings, *, shards: list[dict[str, Any]] | None = None
) -> list[PlannedRequest]:
    """Refuse (InvalidRunDocument) a run one of whose requests SageMaker would refuse; the requests otherwise."""
    requests = _building(lambda: planned_requests(config, settings, shards=shards))
    problems = request_problems(requests)
    if problems:
        raise invalid(problems)
    return requests
