"""SageMaker API requests built from the run document: pure functions, no AWS calls.

Also the timeouts the state machine's callback tasks need (derived from the jobs' own limits)
and the classification of SageMaker errors the starters and the reconciler act on.

Requests are typed by boto3-stubs' TypedDicts (mypy only: nothing at run time or in the layer), not
sagemaker-core's shapes: sagemaker-core 2.27.0 with its closure (scipy, pandas, numpy …) is 383 MiB
unzipped, over Lambda's 250 MB for function plus layers, and imports in ~1.3 s / ~185 MB RSS against
~0.25 s / 56 MB for a boto3 client (bench/bench_sdk_core_layer.py)."""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from botocore.exceptions import ClientError

from sdflow_common import dataset_manifest, instance_types, model_artifact
from sdflow_common.run_document import (
    DownloadOptions,
    EndpointOptions,
    EvaluationOptions,
    RunDocument,
    TrainingOptions,
)

# The instance types are cast to the stubs' enums: the run document checks their form, SageMaker the
# set itself (which grows before the stubs learn of it).
if TYPE_CHECKING:  # boto3-stubs (dev venv only): the layer imports nothing from them at run time
    from mypy_boto3_sagemaker.literals import (
        ProcessingInstanceTypeType,
        ProductionVariantInferenceAmiVersionType,
        ProductionVariantInstanceTypeType,
        TrainingInstanceTypeType,
    )
    from mypy_boto3_sagemaker.type_defs import (
        CreateEndpointConfigInputTypeDef,
        CreateEndpointInputTypeDef,
        CreateModelInputTypeDef,
        CreateProcessingJobRequestTypeDef,
        CreateTrainingJobRequestTypeDef,
        DeploymentConfigTypeDef,
        MetricDefinitionTypeDef,
        ProductionVariantTypeDef,
        ResourceConfigTypeDef,
        StoppingConditionTypeDef,
        TagTypeDef,
        UpdateEndpointInputTypeDef,
    )

# Container paths of the download job (docs/contracts.md "The download job").
PROCESSING_INPUT_DIR = "/opt/ml/processing/input/parquet"
# Shards in progress: on the job's volume, beside the input (SageMaker puts a processing job's
# local paths under /opt/ml/processing). The container uploads each finished shard itself.
PROCESSING_WORK_DIR = "/opt/ml/processing/work"
CHECKPOINT_LOCAL_PATH = "/opt/ml/checkpoints"
DOWNLOAD_ENTRYPOINT = ["download"]
# The download job's volume holds the parquet file (and img2dataset's split of it) plus the shards
# on the disk at once: one being written per img2dataset process and, at worst, one finished per
# process waiting for its upload (the container uploads each shard when it ends, then deletes it).
DOWNLOAD_INPUT_ALLOWANCE_GB = 10
# A stored sample's bytes per pixel: JPEG at img2dataset's quality 95 is well under 1 (about 0.3
# for photos; 1,000 samples at 256 px measured ~50 MB with their json and txt), so 1.0 bounds it.
DOWNLOAD_BYTES_PER_PIXEL = 1.0
# CreateProcessingJob: ProcessingClusterConfig.VolumeSizeInGB, valid range 1 to 16384.
PROCESSING_VOLUME_MAX_GB = 16384
# One instance per shard: a shard is one parquet file, img2dataset parallelises within it.
DOWNLOAD_INSTANCE_COUNT = 1
LOSS_METRIC: MetricDefinitionTypeDef = {"Name": "train:loss", "Regex": "loss=([0-9.eE+-]+)"}
# Printed once at the end of training by sdflow_image.training.outputs (held-out prompts).
ADHERENCE_METRICS: tuple[MetricDefinitionTypeDef, ...] = (
    {"Name": "eval:prompt_adherence", "Regex": "eval:prompt_adherence=([0-9.]+)"},
    {"Name": "eval:base_prompt_adherence", "Regex": "eval:base_prompt_adherence=([0-9.]+)"},
)
VARIANT_NAME = "AllTraffic"
TAG_EXECUTION = "sdflow:execution"
# The run hash (sdflow_common.names.run_hash): tells a run from an older one of the same name.
TAG_RUN = "sdflow:run"
TAG_SHARD = "sdflow:shard"

# Callback-task margins on top of the job's own limit: instance provisioning, image pull and
# the upload of outputs happen outside MaxRuntimeInSeconds.
DOWNLOAD_TASK_MARGIN_SECONDS = 900
TRAINING_TASK_MARGIN_SECONDS = 1800
DEPLOY_TASK_MARGIN_SECONDS = 900
EVALUATION_TASK_MARGIN_SECONDS = 900
DEDUP_TASK_MARGIN_SECONDS = 900
# Blue/green: how long the old fleet stays up after traffic moved, ready for a rollback.
BLUE_GREEN_TERMINATION_WAIT_SECONDS = 300
# SageMaker's bounds for BlueGreenUpdatePolicy.MaximumExecutionTimeoutInSeconds.
BLUE_GREEN_MIN_TIMEOUT, BLUE_GREEN_MAX_TIMEOUT = 600, 28800

THROTTLING_CODES = frozenset(
    {
        "ThrottlingException",
        "Throttling",
        "ThrottledException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "CapacityError",
        "InsufficientCapacityError",
    }
)


# ---------------------------------------------------------------------------- errors


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def error_message(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Message", ""))


def is_throttling(exc: ClientError) -> bool:
    """Rate limits and capacity: worth retrying soon, with a new attempt. Not quotas (see below)."""
    message = error_message(exc).lower()
    return error_code(exc) in THROTTLING_CODES or "rate exceeded" in message or "insufficient capacity" in message


@dataclass(frozen=True)
class QuotaRefusal:
    """SageMaker's ResourceLimitExceeded, read from its message: "The account-level service limit
    'ml.m5.large for processing job usage' is 4 Instances, with current utilization of 4 Instances
    and a request delta of 1 Instances." (the wording SageMaker uses for every instance quota)."""

    quota_name: str
    limit: float
    used: float
    requested: float

    @property
    def never_fits(self) -> bool:
        """The request alone exceeds the quota: waiting for other jobs to end cannot help."""
        return self.requested > self.limit


_QUOTA_MESSAGE = re.compile(
    r"service limit '(?P<name>[^']+)' is (?P<limit>[\d.]+) \w+, with current utilization of "
    r"(?P<used>[\d.]+) \w+ and a request delta of (?P<requested>[\d.]+)"
)


def is_quota_exceeded(exc: ClientError) -> bool:
    """ResourceLimitExceeded: an account quota (instances in use), not a request rate. It lasts
    as long as the jobs holding the quota run, so it needs a different, much longer backoff."""
    return error_code(exc) == "ResourceLimitExceeded"


def quota_refusal(exc: ClientError) -> QuotaRefusal | None:
    """The quota's name, limit, use and the request's size, when the message says them."""
    match = _QUOTA_MESSAGE.search(error_message(exc))
    if not match:
        return None
    return QuotaRefusal(
        quota_name=match["name"],
        limit=float(match["limit"]),
        used=float(match["used"]),
        requested=float(match["requested"]),
    )


def is_already_exists(exc: ClientError) -> bool:
    """SageMaker says 'already exists' / 'already existing' (ResourceInUse or ValidationException)."""
    return error_code(exc) == "ResourceInUse" or "already exist" in error_message(exc).lower()


# A training job that failed because SageMaker found no instances says so at the start of its
# FailureReason: "CapacityError: Unable to provision requested ML compute capacity. Please retry
# using a different ML instance type." (AWS Batch's user guide, "Jobs stuck in RUNNABLE due to
# capacity": a SageMaker training job FAILED whose failedReason begins with CapacityError), or
# "InsufficientCapacityError: …" / "EC2InsufficientCapacityError: Instance type … is temporarily
# unavailable". A container's own failure file arrives as "AlgorithmError: …", so the codes are
# matched only at the start: text a training script printed cannot pass for a capacity failure.
_CAPACITY_FAILURE = re.compile(
    r"^\s*(?:[A-Za-z0-9]*CapacityError|InsufficientCapacity[A-Za-z]*)\b"
    r"|^\s*Unable to provision requested ML compute capacity",
    re.IGNORECASE,
)
# Job statuses that still hold instances (and bill): such a job is stopped, adopted or waited for.
ACTIVE_JOB_STATUSES = frozenset({"InProgress", "Stopping"})


def is_capacity_failure(failure_reason: str | None) -> bool:
    """The job failed for want of instances, not because of anything in it: worth a new job later."""
    return bool(failure_reason) and _CAPACITY_FAILURE.search(failure_reason or "") is not None


def is_not_found(exc: ClientError) -> bool:
    """Describe* of a missing resource: ValidationException 'Could not find …' (or ResourceNotFound)."""
    message = error_message(exc).lower()
    return error_code(exc) == "ResourceNotFound" or "could not find" in message or "not found" in message


# ---------------------------------------------------------------------------- requests


# SageMaker's TagValue: at most 256 of letters, spaces, digits and `_ . : / = + - @`
# (`[\p{L}\p{Z}\p{N}_.:/=+\-@]*`, SageMaker's API model). An execution name may hold more:
# Step Functions allows `( ) ! '` and others, which would fail every Create call of the run.
TAG_VALUE_MAX = 256
TAG_VALUE_MARKS = frozenset("_.:/=+-@")


def tag_value(text: str) -> str:
    """`text` as a SageMaker tag value: each character the pattern refuses becomes `_`."""
    allowed = (c if c in TAG_VALUE_MARKS or unicodedata.category(c)[0] in "LZN" else "_" for c in text)
    return "".join(allowed)[:TAG_VALUE_MAX]


def tags(run_id: str, run_hash: str, **extra: str) -> list[TagTypeDef]:
    tags: list[TagTypeDef] = [{"Key": TAG_EXECUTION, "Value": tag_value(run_id)}, {"Key": TAG_RUN, "Value": run_hash}]
    tags.extend({"Key": f"sdflow:{key}", "Value": tag_value(value)} for key, value in extra.items())
    return tags


def checkpoint_uri(bucket: str, run_id: str, job_name: str) -> str:
    """`runs/<run>/checkpoints/<job name>/`: CheckpointConfig of one training job."""
    return f"s3://{bucket}/runs/{run_id}/checkpoints/{job_name}/"


def download_deadline_seconds(max_runtime_seconds: int) -> int:
    """The container's own hard stop: before MaxRuntime, so it can still write `_SUCCESS` and
    exit cleanly instead of being killed (img2dataset URLs can hang for ever, img2dataset#437)."""
    reserve = min(300, max_runtime_seconds // 5)
    return max(30, max_runtime_seconds - reserve)


class DownloadVolumeTooLarge(ValueError):
    """The shards a download job holds at once would not fit the largest processing volume."""


def download_volume_gb(options: DownloadOptions) -> int:
    """VolumeSizeInGB of a download job: the input allowance plus two shards per img2dataset
    process (see DOWNLOAD_INPUT_ALLOWANCE_GB); independent of how many shards the parquet makes."""
    shard_gb = options.samples_per_shard * options.image_size**2 * DOWNLOAD_BYTES_PER_PIXEL / 1e9
    size = math.ceil(DOWNLOAD_INPUT_ALLOWANCE_GB + 2 * options.processes * shard_gb)
    if size > PROCESSING_VOLUME_MAX_GB:
        raise DownloadVolumeTooLarge(
            f"download.processes={options.processes} shards of download.samples_per_shard="
            f"{options.samples_per_shard} images at download.image_size={options.image_size} px need a "
            f"{size} GB volume, over SageMaker's {PROCESSING_VOLUME_MAX_GB} GB (VolumeSizeInGB); lower "
            f"samples_per_shard or processes"
        )
    return size


def download_container_arguments(
    options: DownloadOptions,
    url_column: str,
    caption_column: str,
    *,
    output_uri: str,
    shard_id: str,
    holdout_rate: float = 0.0,
    filters: Sequence[str] = (),
) -> list[str]:
    """`ContainerArguments` of docs/contracts.md "The download job", in that order: the flag names
    of sdflow_image.download.download.FLAGS (snake_case, as the shared flags module spells them).
    `holdout_rate` is the run's `$.config.holdout_rate` (Validate run chose it). `filters`, the
    dataset's filters one JSON object each (dataset_filters.filter_arguments), follow `--filters`
    when there are any: each is an item of its own, as no item may pass 256 characters."""
    filter_flag = ["--filters", *filters] if filters else []
    return [
        "--input", PROCESSING_INPUT_DIR,
        "--output_uri", output_uri,
        "--work_dir", PROCESSING_WORK_DIR,
        "--shard_id", shard_id,
        "--url_col", url_column,
        "--caption_col", caption_column,
        "--image_size", str(options.image_size),
        "--resize_mode", options.resize_mode,
        "--samples_per_shard", str(options.samples_per_shard),
        "--processes", str(options.processes),
        "--threads", str(options.threads),
        "--url_timeout", str(options.url_timeout_seconds),
        "--deadline_seconds", str(download_deadline_seconds(options.max_runtime_seconds)),
        "--holdout_rate", str(holdout_rate),
        *filter_flag,
    ]  # fmt: skip


def processing_job_request(
    *,
    job_name: str,
    run_id: str,
    run_hash: str,
    shard_id: str,
    parquet_uri: str,
    output_uri: str,
    options: DownloadOptions,
    url_column: str,
    caption_column: str,
    image_uri: str,
    role_arn: str,
    holdout_rate: float = 0.0,
    filters: Sequence[str] = (),
) -> CreateProcessingJobRequestTypeDef:
    """CreateProcessingJob for one shard. No network isolation: it downloads from the internet,
    and it writes each finished shard to `output_uri` itself (boto3 with the job's role), so there
    is no ProcessingOutput: SageMaker's own upload (ProcessingS3Output.S3UploadMode) is either at
    the job's end (EndOfJob) or continuous, which knows no finished shard from one being written;
    neither frees the disk, and neither lets a retried job see what an earlier attempt finished."""
    return {
        "ProcessingJobName": job_name,
        "ProcessingInputs": [
            {
                "InputName": "parquet",
                "S3Input": {
                    "S3Uri": parquet_uri,
                    "LocalPath": PROCESSING_INPUT_DIR,
                    "S3DataType": "S3Prefix",
                    "S3InputMode": "File",
                    "S3DataDistributionType": "FullyReplicated",
                },
            }
        ],
        "ProcessingResources": {
            "ClusterConfig": {
                "InstanceCount": DOWNLOAD_INSTANCE_COUNT,
                "InstanceType": cast("ProcessingInstanceTypeType", options.instance_type),
                "VolumeSizeInGB": download_volume_gb(options),
            }
        },
        "StoppingCondition": {"MaxRuntimeInSeconds": options.max_runtime_seconds},
        "AppSpecification": {
            "ImageUri": image_uri,
            "ContainerEntrypoint": list(DOWNLOAD_ENTRYPOINT),
            "ContainerArguments": download_container_arguments(
                options,
                url_column,
                caption_column,
                output_uri=output_uri,
                shard_id=shard_id,
                holdout_rate=holdout_rate,
                filters=filters,
            ),
        },
        "NetworkConfig": {"EnableNetworkIsolation": False},
        "RoleArn": role_arn,
        "Tags": tags(run_id, run_hash, shard=shard_id),
    }


def family_hyperparameters(run: RunDocument) -> dict[str, str]:
    """`model_family` and `base_model_uri` (the contract with the image, docs/contracts.md). Validate run
    resolves `base_model_family` from the model's model_index.json before any job starts, so every job
    of the pipeline names its family; a document that never went through it ("auto") leaves the family
    to the image's own reading of the model."""
    values = {"base_model_uri": run.base_model_uri}
    if run.base_model_family != "auto":
        values["model_family"] = run.base_model_family
    return values


def training_job_request(
    *,
    job_name: str,
    run_id: str,
    run_hash: str,
    bucket: str,
    dataset_prefix_uri: str,
    run: RunDocument,
    image_uri: str,
    role_arn: str,
) -> CreateTrainingJobRequestTypeDef:
    """CreateTrainingJob: `docker run IMAGE train` with the base_model channel; the dataset streams from S3.

    No dataset channel: in File mode SageMaker copies a channel to every instance's volume before the
    container starts (a 10,000-shard LAION dataset is ~500 GB per node, and the first step waits for it).
    The container instead reads index.json and streams its own share of the tars with GetObject
    (`dataset_dir` = `s3://<bucket>/runs/`, the root every path in the index is relative to, so a
    resumed run's shards in earlier runs' folders are found too; sdflow_image.training.data_source).

    VolumeSizeInGB stays the run document's `training.volume_size_gb`: the volume now holds only the
    base model channel, the checkpoints (checkpoints_total_limit, plus one being written) and the
    output model, none of which depends on the dataset, so the index has nothing to size it by."""
    options = run.training
    resources: ResourceConfigTypeDef = {
        "InstanceType": cast("TrainingInstanceTypeType", options.instance_type),
        "InstanceCount": options.instance_count,
        "VolumeSizeInGB": options.volume_size_gb,
    }
    if options.keep_alive_seconds > 0:
        resources["KeepAlivePeriodInSeconds"] = options.keep_alive_seconds
    stopping: StoppingConditionTypeDef = {"MaxRuntimeInSeconds": options.max_runtime_seconds}
    if options.use_spot and options.max_wait_seconds is not None:
        stopping["MaxWaitTimeInSeconds"] = options.max_wait_seconds
    checkpoints = checkpoint_uri(bucket, run_id, job_name)

    return {
        "TrainingJobName": job_name,
        "AlgorithmSpecification": {
            "TrainingImage": image_uri,
            "TrainingInputMode": "File",
            "MetricDefinitions": [metric.copy() for metric in (LOSS_METRIC, *ADHERENCE_METRICS)],
        },
        "RoleArn": role_arn,
        "HyperParameters": options.hyperparameters()
        | family_hyperparameters(run)
        | {
            "dataset_dir": dataset_manifest.runs_prefix_uri(bucket),
            "dataset_index": dataset_manifest.index_in_channel(dataset_prefix_uri, bucket),
            # The trainer prunes old checkpoints there too (SageMaker's sync only ever adds files).
            "checkpoint_s3_uri": checkpoints,
        },
        "InputDataConfig": [
            {
                "ChannelName": "base_model",
                "DataSource": {
                    "S3DataSource": {
                        "S3DataType": "S3Prefix",
                        "S3Uri": run.base_model_uri,
                        "S3DataDistributionType": "FullyReplicated",  # every node loads the whole model
                    }
                },
                "InputMode": "File",
            }
        ],
        # Uncompressed: SageMaker uploads /opt/ml/model file by file instead of gzipping a full pipeline (tens
        # of GB) on one core at the end of the paid job, and the endpoint and evaluation job read the files as
        # they are (sdflow_common.model_artifact; "Uncompressed model output", SageMaker developer guide).
        "OutputDataConfig": {
            "S3OutputPath": f"s3://{bucket}/runs/{run_id}/training/",
            "CompressionType": model_artifact.UNCOMPRESSED,
        },
        "ResourceConfig": resources,
        "StoppingCondition": stopping,
        "EnableManagedSpotTraining": options.use_spot,
        # Per job: two jobs of one run (a retry, a redrive) must never overwrite each other's
        # checkpoints; resuming from an earlier job's checkpoints is a deliberate act, not an accident.
        "CheckpointConfig": {"S3Uri": checkpoints, "LocalPath": CHECKPOINT_LOCAL_PATH},
        "RetryStrategy": {"MaximumRetryAttempts": options.max_retry_attempts},
        # Off: the container streams its shards from S3 and prunes checkpoints there itself. With network
        # isolation on, "the training container does not have network access" (SageMaker API Reference,
        # CreateTrainingJob, EnableNetworkIsolation), S3 included. What it may reach is bounded by the
        # job role (template.yaml SageMakerExecutionRole: the data bucket and the training image only).
        "EnableNetworkIsolation": False,
        "EnableInterContainerTrafficEncryption": True,
        "Tags": tags(run_id, run_hash),
    }


def model_request(
    *, model_name: str, run_id: str, run_hash: str, model_package_arn: str, role_arn: str
) -> CreateModelInputTypeDef:
    """CreateModel from the run's approved model package: its inference specification names the
    training image (`docker run IMAGE serve`) and the trained artifact."""
    return {
        "ModelName": model_name,
        "PrimaryContainer": {"ModelPackageName": model_package_arn},
        "ExecutionRoleArn": role_arn,
        "EnableNetworkIsolation": True,
        "Tags": tags(run_id, run_hash),
    }


def endpoint_config_request(
    *,
    config_name: str,
    model_name: str,
    run_id: str,
    run_hash: str,
    options: EndpointOptions,
    backend: str = "colossalai",
) -> CreateEndpointConfigInputTypeDef:
    """The accelerate image's CUDA 13 needs an R580 driver: on a GPU instance its variant names the inference AMI that
    has one (instance_types.endpoint_ami); the default hosts' R470-R550 would fail it with CannotStartContainerError."""
    variant: ProductionVariantTypeDef = {
        "VariantName": VARIANT_NAME,
        "ModelName": model_name,
        "InstanceType": cast("ProductionVariantInstanceTypeType", options.instance_type),
        "InitialInstanceCount": options.initial_instance_count,
    }
    ami = instance_types.endpoint_ami(backend)
    if ami is not None and instance_types.gpu_of(options.instance_type) is not None:
        variant["InferenceAmiVersion"] = cast("ProductionVariantInferenceAmiVersionType", ami)
    return {"EndpointConfigName": config_name, "ProductionVariants": [variant], "Tags": tags(run_id, run_hash)}


def create_endpoint_request(
    *, endpoint_name: str, config_name: str, run_id: str, run_hash: str
) -> CreateEndpointInputTypeDef:
    """The endpoint's tags are those of the run that created it; an update changes only its config."""
    return {"EndpointName": endpoint_name, "EndpointConfigName": config_name, "Tags": tags(run_id, run_hash)}


def blue_green_timeout_seconds(options: EndpointOptions) -> int:
    return max(BLUE_GREEN_MIN_TIMEOUT, min(BLUE_GREEN_MAX_TIMEOUT, options.max_wait_seconds))


def update_endpoint_request(
    *,
    endpoint_name: str,
    config_name: str,
    options: EndpointOptions,
    rollback_alarm_names: Sequence[str] = (),
) -> UpdateEndpointInputTypeDef:
    """UpdateEndpoint, blue/green, all traffic at once.

    SageMaker rolls back by itself when the new fleet fails to come up; CloudWatch alarms add
    rollback on bad metrics during the bake time (TerminationWaitInSeconds), so they are
    passed only when the stack configures some (AutoRollbackConfiguration needs ≥ 1)."""
    deployment: DeploymentConfigTypeDef = {
        "BlueGreenUpdatePolicy": {
            "TrafficRoutingConfiguration": {"Type": "ALL_AT_ONCE", "WaitIntervalInSeconds": 0},
            "TerminationWaitInSeconds": BLUE_GREEN_TERMINATION_WAIT_SECONDS,
            "MaximumExecutionTimeoutInSeconds": blue_green_timeout_seconds(options),
        }
    }
    alarms = [name for name in rollback_alarm_names if name][:10]
    if alarms:
        deployment["AutoRollbackConfiguration"] = {"Alarms": [{"AlarmName": name} for name in alarms]}
    return {
        "EndpointName": endpoint_name,
        "EndpointConfigName": config_name,
        "DeploymentConfig": deployment,
    }


# ---------------------------------------------------------------------------- timeouts


def download_task_timeout_seconds(options: DownloadOptions) -> int:
    return options.max_runtime_seconds + DOWNLOAD_TASK_MARGIN_SECONDS


def training_task_timeout_seconds(options: TrainingOptions) -> int:
    """MaxRuntime covers the whole job including RetryStrategy attempts; spot adds waiting."""
    limit = options.max_runtime_seconds
    if options.use_spot and options.max_wait_seconds is not None:
        limit = max(limit, options.max_wait_seconds)
    return limit + TRAINING_TASK_MARGIN_SECONDS


def deploy_task_timeout_seconds(options: EndpointOptions) -> int:
    """Covers both a create (max_wait_seconds) and a blue/green update with its bake time."""
    update = blue_green_timeout_seconds(options) + BLUE_GREEN_TERMINATION_WAIT_SECONDS
    return max(options.max_wait_seconds, update) + DEPLOY_TASK_MARGIN_SECONDS


def evaluation_task_timeout_seconds(options: EvaluationOptions) -> int:
    return options.max_runtime_seconds + EVALUATION_TASK_MARGIN_SECONDS


def task_timeouts(run: RunDocument) -> dict[str, int]:
    """TimeoutSeconds of the callback tasks, for `$.config.timeouts` (TimeoutSecondsPath)."""
    return {
        "download": download_task_timeout_seconds(run.download),
        "training": training_task_timeout_seconds(run.training),
        "evaluation": evaluation_task_timeout_seconds(run.evaluation),
        "dedup": run.deduplication.max_runtime_seconds + DEDUP_TASK_MARGIN_SECONDS,
        # Manual approval waits on a person, not a job: the document says how long.
        "approval": run.approval.timeout_seconds,
        "endpoint": deploy_task_timeout_seconds(run.endpoint),
    }
