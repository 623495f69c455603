"""The "Validate run" task: check the run document against the stack, resolve the dataset, write
the shard list the Distributed Map reads, and return the small `$.config` every later state uses.

Errors are named (InvalidRunDocument, DatasetNotFound) so the state machine's Catch can turn them
into a failure notification that tells the user what to fix; both carry a JSON list of
`{"field", "message"}` problems. start_pipeline runs the same checks (`check_inputs`) before it
starts an execution, so an uploaded manifest that would fail here starts nothing."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError
from pydantic import BaseModel, ConfigDict, Field

from sdflow_common import aws, dataset_files, evaluation_checks, model_checks, model_family, names, quotas, request_plan
from sdflow_common.errors import DatasetNotFound, InvalidRunDocument
from sdflow_common.resume import add_cache_keys, apply_resume
from sdflow_common.run_config import RunConfig
from sdflow_common.run_document import RunDocument, invalid, parse_run_document, parse_s3_uri
from sdflow_common.sagemaker_jobs import task_timeouts
from sdflow_common.settings import Settings

log = logging.getLogger(__name__)

# Prefixes holding the pipeline's own outputs: img2dataset writes NNNNN.parquet files under runs/,
# so a dataset prefix there would feed one run's outputs into the next as input.
RESERVED_PREFIXES = ("runs/", "rejected/", "manifests/")
MODEL_INDEX = "model_index.json"
LIST_PAGE_SIZE = 1000  # S3's maximum; tests lower it to exercise pagination


class ValidateRunRequest(BaseModel):
    """The task's payload: the execution input plus the execution's identity from the context object."""

    model_config = ConfigDict(extra="forbid")

    run: Any = Field(description="The execution input (a run document, not yet validated).")
    execution_name: str = Field(min_length=1, max_length=80)
    execution_arn: str = Field(min_length=1)
    start_time: str = Field(min_length=1)


def run_prefix(execution_name: str) -> str:
    return f"runs/{execution_name}/"


def shard_items(parquet_uris: list[str], bucket: str, execution_name: str) -> list[dict[str, Any]]:
    """Shard items per docs/contracts.md: sorted by URI, `shard_id` = 5-digit position."""
    dataset_root = f"s3://{bucket}/{run_prefix(execution_name)}dataset/shards/"
    items: list[dict[str, Any]] = []
    for position, uri in enumerate(sorted(parquet_uris)):
        shard_id = f"{position:05d}"
        items.append({"shard_id": shard_id, "parquet_uri": uri, "output_uri": f"{dataset_root}{shard_id}/"})
    return items


def _invalid(problems: list[dict[str, str]]) -> InvalidRunDocument:
    return invalid(problems)


def _not_found(field: str, message: str) -> DatasetNotFound:
    return DatasetNotFound(json.dumps([{"field": field, "message": message}]))


def _outside_bucket(field: str, uri: str, data_bucket: str, folder: str) -> dict[str, str]:
    return {
        "field": field,
        "message": f"'{uri}' is outside this stack's bucket; the pipeline may read only "
        f"s3://{data_bucket}/ (least privilege): copy it under s3://{data_bucket}/{folder}/ and use that URI",
    }


def folder_readings(key: str) -> tuple[str, str]:
    """The folders a dataset prefix's key can mean: S3's own reading and a path tool's.

    S3 keys are literal and case-sensitive ("Naming Amazon S3 objects", S3 user guide): `runs`
    is listed as `runs/` (list_parquet adds the slash), while `/runs/`, `./runs/` or `x/../runs/`
    are other keys to S3. Tools that treat keys as paths (the AWS CLI's and fsspec's path
    handling, URL dot-segment removal) collapse `//`, drop `.` and resolve `..`, and read those
    as `runs/`. Both readings are returned, each ending in "/" ("" is the whole bucket)."""
    literal = key if not key or key.endswith("/") else f"{key}/"
    parts: list[str] = []
    for part in key.split("/"):
        if part == "..":
            if parts:
                parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    normalised = "/".join(parts) + "/" if parts else ""
    return literal, normalised


def is_reserved_folder(key: str) -> bool:
    """Whether a dataset prefix could reach the pipeline's own files under either reading.

    Case is kept: S3 keys are case-sensitive, so `RUNS/` can never list an object under `runs/`
    and is an ordinary folder of the user's."""
    return any(not folder or folder.startswith(RESERVED_PREFIXES) for folder in folder_readings(key))


def _endpoint_problems(document: RunDocument, endpoint_name_prefix: str) -> list[dict[str, str]]:
    """The endpoint must be one of this stack's: its deploy role may touch only names under the prefix."""
    name = document.endpoint.name
    if name.startswith(endpoint_name_prefix):
        return []
    suggestion = f"{endpoint_name_prefix.rstrip('-')}-{name}"[:48].rstrip("-")
    return [
        {
            "field": "endpoint.name",
            "message": f"'{name}' does not start with '{endpoint_name_prefix}', the prefix this stack may deploy "
            f"(template parameter EndpointNamePrefix; the deploy role can create or update no other endpoint); "
            f"name it e.g. '{suggestion}'",
        }
    ]


def check_locations(document: RunDocument, data_bucket: str, endpoint_name_prefix: str | None = None) -> None:
    """Every input must live in the stack's bucket, a dataset prefix not among the pipeline's
    outputs, and the endpoint under the stack's endpoint name prefix (default: the function's
    ENDPOINT_NAME_PREFIX, through Settings)."""
    if endpoint_name_prefix is None:
        endpoint_name_prefix = Settings.from_env().endpoint_name_prefix
    problems: list[dict[str, str]] = []
    bucket, _key = parse_s3_uri(document.base_model_uri)
    if bucket != data_bucket:
        problems.append(_outside_bucket("base_model_uri", document.base_model_uri, data_bucket, "models"))
    dataset = document.dataset
    for position, uri in enumerate(dataset.parquet_uris or []):
        bucket, _key = parse_s3_uri(uri)
        if bucket != data_bucket:
            field = f"dataset.parquet_uris.{position}"
            problems.append(_outside_bucket(field, uri, data_bucket, "datasets"))
    if dataset.prefix is not None:
        bucket, key = parse_s3_uri(dataset.prefix)
        if bucket != data_bucket:
            problems.append(_outside_bucket("dataset.prefix", dataset.prefix, data_bucket, "datasets"))
        elif is_reserved_folder(key):
            problems.append(
                {
                    "field": "dataset.prefix",
                    "message": f"'{dataset.prefix}' would include the pipeline's own files (the bucket's root, "
                    f"{', '.join(RESERVED_PREFIXES)}, however written); give the folder that holds only your "
                    f"parquet files, e.g. s3://{data_bucket}/datasets/<name>/",
                }
            )
    prompts_uri = document.evaluation.prompts_uri
    if prompts_uri is not None and parse_s3_uri(prompts_uri)[0] != data_bucket:
        problems.append(_outside_bucket("evaluation.prompts_uri", prompts_uri, data_bucket, "datasets"))
    # The evaluation job reads the CLIP model through a ProcessingInput, with the same role as the base model.
    clip_model_uri = document.evaluation.clip_model_uri
    if clip_model_uri is not None and parse_s3_uri(clip_model_uri)[0] != data_bucket:
        problems.append(_outside_bucket("evaluation.clip_model_uri", clip_model_uri, data_bucket, "models"))
    problems += _endpoint_problems(document, endpoint_name_prefix)
    if problems:
        raise _invalid(problems)


def _exists(uri: str) -> bool:
    bucket, key = parse_s3_uri(uri)
    try:
        aws.client("s3").head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if dataset_files.missing_or_unreadable(exc):
            return False
        raise
    return True


def _read_small(bucket: str, key: str) -> bytes:
    """A config file of the model: a few hundred bytes, or a few kB; a larger object is no config (it would be
    refused anyway)."""
    return aws.read_range(bucket, key, 0, 65535)


def check_base_model(base_model_uri: str) -> model_family.BaseModelIndex:
    """The model's family (model_family.FAMILY_OF_CLASS), from its model_index.json, and for an SD 3 or FLUX.2
    pipeline from its transformer/config.json too (SD 3 or SD 3.5; which size)."""
    bucket, key = parse_s3_uri(base_model_uri)
    folder = key if not key or key.endswith("/") else f"{key}/"
    name = MODEL_INDEX
    try:
        found = model_family.family_of_index(_read_small(bucket, f"{folder}{name}"), f"s3://{bucket}/{folder}{name}")
        if found.family not in model_family.TRANSFORMER_CONFIG_FAMILIES:
            return found
        name = model_family.TRANSFORMER_CONFIG
        body = _read_small(bucket, f"{folder}{name}")
        return model_family.family_of_transformer(found, body, f"s3://{bucket}/{folder}{name}")
    except ClientError as exc:
        if not dataset_files.missing_or_unreadable(exc):
            raise
        raise _not_found(
            "base_model_uri",
            f"s3://{bucket}/{folder}{name} does not exist or is not readable; base_model_uri must be the "
            f"folder of a diffusers-format model (the folder holding {MODEL_INDEX}, unet/ or transformer/, vae/, "
            "text_encoder/, tokenizer/, scheduler/), e.g. saved with pipeline.save_pretrained() and "
            "copied with `aws s3 sync`",
        ) from None


def list_parquet(prefix_uri: str, max_shards: int) -> list[str]:
    """Every *.parquet object below the prefix (a folder: a trailing "/" is implied)."""
    bucket, key = parse_s3_uri(prefix_uri)
    folder = key if key.endswith("/") else f"{key}/"
    paginator = aws.client("s3").get_paginator("list_objects_v2")
    uris: list[str] = []
    pages = paginator.paginate(Bucket=bucket, Prefix=folder, PaginationConfig={"PageSize": LIST_PAGE_SIZE})
    for page in pages:
        for obj in page.get("Contents", []):
            if obj["Key"].lower().endswith(".parquet"):
                uris.append(f"s3://{bucket}/{obj['Key']}")
        if len(uris) > max_shards:
            raise _invalid(
                [
                    {
                        "field": "dataset.prefix",
                        "message": f"holds more than {max_shards} parquet files, this stack's maximum "
                        "(MaxShards parameter); point it at a smaller folder or split the dataset",
                    }
                ]
            )
    if not uris:
        raise _not_found(
            "dataset.prefix",
            f"no *.parquet objects below s3://{bucket}/{folder}; upload the parquet files there or fix the prefix",
        )
    return uris


def resolve_dataset(document: RunDocument, max_shards: int) -> list[str]:
    dataset = document.dataset
    if dataset.parquet_uris is not None:
        return list(dataset.parquet_uris)
    assert dataset.prefix is not None  # the model guarantees exactly one source
    return list_parquet(dataset.prefix, max_shards)


@dataclass(frozen=True)
class CheckedInputs:
    parquet_uris: list[str]
    # Problems with a few parquet files that the run tolerates (download.tolerated_failure_percent).
    warnings: list[dict[str, str]]
    # The document with base_model_family resolved from the model (model_family.resolve_family), and the evaluation's
    # instance_type, holdout_samples and scene_adherence (evaluation_checks).
    document: RunDocument
    # The held-out share of the dataset (RunConfig.holdout_rate).
    holdout_rate: float = 0.0


def check_inputs(document: RunDocument, *, data_bucket: str, max_shards: int) -> CheckedInputs:
    """The document's inputs checked against the stack and S3.

    Locations first (no request leaves the bucket), then the base and the CLIP model, the instances, then every
    parquet object's existence and schema (dataset_files), and last the evaluation's held-out split and gate,
    which depend on the dataset's rows. Both doors run this: start_pipeline before StartExecution, Validate run
    again at the start of the execution (the data may change in between)."""
    check_locations(document, data_bucket)
    index = check_base_model(document.base_model_uri)
    document = model_family.resolve_family(document, index.family)
    model_family.check_family_settings(document, index.family)
    model_checks.check_model(document, index)  # components present, LoRA targets, resolution multiple
    clip_uri = document.evaluation.clip_model_uri
    clip = evaluation_checks.read_clip_model(clip_uri) if clip_uri is not None else None
    document = evaluation_checks.resolve_instance(document, index, clip)
    model_family.check_instances(
        document,
        index.family,
        with_t5=index.with_t5,
        variant=index.variant,
        clip_bytes=clip.weight_bytes if clip else 0,
    )
    model_family.check_memory(document, index.family, with_t5=index.with_t5, variant=index.variant)
    prompts_uri = document.evaluation.prompts_uri
    if prompts_uri is not None and not _exists(prompts_uri):
        raise _not_found(
            "evaluation.prompts_uri",
            f"{prompts_uri} does not exist or is not readable; upload the prompts (a JSON list, or one a line) "
            "there, or list them in evaluation.prompts",
        )
    parquet_uris = resolve_dataset(document, max_shards)
    source = "dataset.parquet_uris" if document.dataset.parquet_uris is not None else "dataset.prefix"
    tolerated = document.download.tolerated_failure_percent
    parquet = dataset_files.check_parquet_objects(parquet_uris, document.dataset, source, tolerated)
    document, holdout = evaluation_checks.resolve_evaluation(document, parquet.rows, clip)
    batch = model_checks.batch_warnings(document, parquet.rows, holdout.rate)
    return CheckedInputs(
        parquet_uris=parquet_uris,
        warnings=parquet.warnings + holdout.warnings + batch,
        document=document,
        holdout_rate=holdout.rate,
    )


def _same_start(stored: Any, current: str) -> bool:
    try:
        return names.start_millis(stored) == names.start_millis(current)
    except (TypeError, ValueError):
        return False


def check_run_prefix(request: ValidateRunRequest, data_bucket: str) -> None:
    """`runs/<execution name>/` belongs to one execution: its run.json names the execution's ARN and
    start time. Step Functions lets a closed execution's name be used again after 90 days (StartExecution,
    Step Functions API Reference); that new execution must not find the old run's `_SUCCESS` markers,
    checkpoints and model. A redrive (same ARN, same start time) or a retried Validate run passes."""
    key = f"{run_prefix(request.execution_name)}run.json"
    try:
        stored = json.loads(aws.client("s3").get_object(Bucket=data_bucket, Key=key)["Body"].read())
    except ClientError as exc:
        if str(exc.response.get("Error", {}).get("Code", "")) in ("NoSuchKey", "404"):
            return
        raise
    except ValueError:
        stored = None
    if (
        isinstance(stored, dict)
        and stored.get("execution_arn") == request.execution_arn
        and _same_start(stored.get("start_time"), request.start_time)
    ):
        return
    earlier = (
        f"the execution started at {stored.get('start_time')}"
        if isinstance(stored, dict) and stored.get("start_time")
        else "an earlier execution"
    )
    name = request.execution_name
    message = (
        f"execution name '{name}' was used before: s3://{data_bucket}/{key} belongs to {earlier} "
        f"(Step Functions allows a name again 90 days after its execution closed), and its files must not "
        f"count for this run; start this run under a new name, e.g. '{name[:76]}-new'"
    )
    raise _invalid([{"field": "(execution name)", "message": message}])


def run_record(request: ValidateRunRequest, document: RunDocument) -> dict[str, Any]:
    """runs/<name>/run.json: which execution owns the prefix, and the normalized document it ran."""
    record: dict[str, Any] = {"execution_arn": request.execution_arn, "start_time": request.start_time}
    if document.resume_from is not None:
        record["resume_from"] = document.resume_from
    record["run"] = document.model_dump(mode="json")
    return record


@dataclass(frozen=True)
class PreparedRun:
    """What Validate run decided, before it writes anything: `$.config`, the shard list, run.json's record and
    every SageMaker request the run will make (checked)."""

    config: dict[str, Any]
    shards: list[dict[str, Any]]
    record: dict[str, Any]
    requests: list[request_plan.PlannedRequest]


def prepare_run(
    request: ValidateRunRequest, *, data_bucket: str, max_shards: int, settings: Settings | None = None
) -> PreparedRun:
    """Every check of Validate run, reading only: the document, the run's prefix, the inputs, the instance quotas,
    then every request the run will make (request_plan.check_requests). `sdflow plan` runs this too."""
    document = parse_run_document(request.run, max_shards=max_shards)
    check_run_prefix(request, data_bucket)
    checked = check_inputs(document, data_bucket=data_bucket, max_shards=max_shards)
    document = checked.document  # base_model_family as the model says: every later state reads it here
    shards = shard_items(checked.parquet_uris, data_bucket, request.execution_name)
    add_cache_keys(shards, document)
    resume = apply_resume(document, shards, bucket=data_bucket, execution_arn=request.execution_arn)
    config = RunConfig(
        run_id=request.execution_name,
        execution_arn=request.execution_arn,
        started_at=request.start_time,
        bucket=data_bucket,
        shard_list_key=f"{run_prefix(request.execution_name)}shards.json",
        shard_count=len(shards),
        dataset_prefix_uri=f"s3://{data_bucket}/{run_prefix(request.execution_name)}dataset/",
        timeouts=task_timeouts(document),
        run=document,
        warnings=checked.warnings,
        holdout_rate=checked.holdout_rate,
        resume=resume,
    )
    dumped = quotas.apply_instance_quotas(config.model_dump(mode="json"))
    requests = request_plan.check_requests(dumped, settings or Settings.from_env(), shards=shards)
    return PreparedRun(config=dumped, shards=shards, record=run_record(request, document), requests=requests)


def validate_run(
    request: ValidateRunRequest, *, data_bucket: str, max_shards: int, settings: Settings | None = None
) -> dict[str, Any]:
    """Validate, resolve, write run.json and shards.json; return `$.config` (docs/contracts.md)."""
    prepared = prepare_run(request, data_bucket=data_bucket, max_shards=max_shards, settings=settings)
    config, shards = prepared.config, prepared.shards
    s3 = aws.client("s3")
    s3.put_object(
        Bucket=data_bucket,
        Key=f"{run_prefix(request.execution_name)}run.json",
        Body=json.dumps(prepared.record, indent=2).encode(),
        ContentType="application/json",
    )
    shard_list_key = config["shard_list_key"]
    s3.put_object(
        Bucket=data_bucket,
        Key=shard_list_key,
        Body=json.dumps(shards).encode(),
        ContentType="application/json",
    )
    log.info(
        "run %s: %d shards listed at s3://%s/%s",
        request.execution_name,
        len(shards),
        data_bucket,
        shard_list_key,
    )
    return config
