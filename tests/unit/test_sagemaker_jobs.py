"""Request builders: valid against SageMaker's API model and faithful to docs/contracts.md."""

from __future__ import annotations

from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdflow_common import sagemaker_jobs
from sdflow_common.run_document import DownloadOptions, EndpointOptions, RunDocument
from tests.unit.helpers import DATA_BUCKET, SAGEMAKER_ROLE_ARN, TRAINING_IMAGE_URI
from tests.unit.job_requests import assert_valid_request

RUN_ID = "demo-0123456789"
RUN_HASH = "47de834dd8"


def run_document(**overrides: Any) -> RunDocument:
    raw: dict[str, Any] = {
        "dataset": {"parquet_uris": [f"s3://{DATA_BUCKET}/datasets/part-00000.parquet"]},
        "base_model_uri": f"s3://{DATA_BUCKET}/models/tiny-sd/",
    }
    raw.update(overrides)
    return RunDocument.model_validate(raw)


PROCESSING_KWARGS: dict[str, Any] = {
    "job_name": "sdf-dl-demo-0123456789-00003-a0",
    "run_id": RUN_ID,
    "run_hash": RUN_HASH,
    "shard_id": "00003",
    "parquet_uri": f"s3://{DATA_BUCKET}/datasets/part-00003.parquet",
    "output_uri": f"s3://{DATA_BUCKET}/runs/{RUN_ID}/dataset/shards/00003/",
    "url_column": "url",
    "caption_column": "caption",
    "image_uri": TRAINING_IMAGE_URI,
    "role_arn": SAGEMAKER_ROLE_ARN,
}


def processing_request(options: DownloadOptions) -> dict[str, Any]:
    return sagemaker_jobs.processing_job_request(**PROCESSING_KWARGS, options=options)


def training_request(run: RunDocument) -> dict[str, Any]:
    return sagemaker_jobs.training_job_request(
        job_name="sdf-tr-demo-0123456789-a0",
        run_id=RUN_ID,
        run_hash=RUN_HASH,
        bucket=DATA_BUCKET,
        dataset_prefix_uri=f"s3://{DATA_BUCKET}/runs/{RUN_ID}/dataset/",
        run=run,
        image_uri=TRAINING_IMAGE_URI,
        role_arn=SAGEMAKER_ROLE_ARN,
    )


def test_processing_job_request_follows_download_contract() -> None:
    options = DownloadOptions(image_size=384, processes=2, threads=8, max_runtime_seconds=3600)
    request = processing_request(options)
    assert_valid_request("CreateProcessingJob", request)
    app = request["AppSpecification"]
    assert app["ContainerEntrypoint"] == ["download"]
    assert app["ImageUri"] == TRAINING_IMAGE_URI
    args = app["ContainerArguments"]
    as_pairs = dict(zip(args[::2], args[1::2], strict=True))
    assert as_pairs == {
        "--input": "/opt/ml/processing/input/parquet",
        "--output_uri": f"s3://{DATA_BUCKET}/runs/{RUN_ID}/dataset/shards/00003/",
        "--work_dir": "/opt/ml/processing/work",
        "--shard_id": "00003",
        "--url_col": "url",
        "--caption_col": "caption",
        "--image_size": "384",
        "--resize_mode": "center_crop",
        "--samples_per_shard": "1000",
        "--processes": "2",
        "--threads": "8",
        "--url_timeout": "10",
        "--deadline_seconds": "3300",
        "--holdout_rate": "0.0",
    }
    s3_input = request["ProcessingInputs"][0]["S3Input"]
    assert s3_input["S3Uri"].endswith("part-00003.parquet")
    assert s3_input["LocalPath"] == "/opt/ml/processing/input/parquet"
    # the container uploads each finished shard itself: no SageMaker upload at the job's end
    assert "ProcessingOutputConfig" not in request
    assert request["NetworkConfig"]["EnableNetworkIsolation"] is False
    assert request["StoppingCondition"] == {"MaxRuntimeInSeconds": 3600}
    assert request["ProcessingResources"]["ClusterConfig"]["InstanceCount"] == 1
    assert {"Key": "sdflow:execution", "Value": RUN_ID} in request["Tags"]
    assert {"Key": "sdflow:run", "Value": RUN_HASH} in request["Tags"]


def test_processing_job_request_carries_holdout_rate() -> None:
    request = sagemaker_jobs.processing_job_request(**PROCESSING_KWARGS, options=DownloadOptions(), holdout_rate=0.0375)
    args = request["AppSpecification"]["ContainerArguments"]
    assert args[-2:] == ["--holdout_rate", "0.0375"]
    assert_valid_request("CreateProcessingJob", request)


@pytest.mark.parametrize("execution_name", ["cats (copy)!", "it's-mine", "a/b:c=d+e@f", "Zürich 東京"])
def test_job_tags_hold_any_execution_name_step_functions_allows(execution_name: str) -> None:
    """Step Functions allows `( ) ! '` in an execution name; SageMaker's TagValue does not."""
    request = sagemaker_jobs.processing_job_request(
        **{**PROCESSING_KWARGS, "run_id": execution_name}, options=DownloadOptions()
    )
    assert_valid_request("CreateProcessingJob", request)
    assert {t["Key"]: t["Value"] for t in request["Tags"]}["sdflow:execution"] == sagemaker_jobs.tag_value(
        execution_name
    )
    assert sagemaker_jobs.tag_value("cats (copy)!") == "cats _copy__"
    assert sagemaker_jobs.tag_value("Zürich 東京") == "Zürich 東京"


def test_download_volume_defaults_hold_input_and_two_shards_per_process() -> None:
    # 4 processes x 2 shards x 1,000 samples x 256^2 px x 1 byte/px = 0.52 GB, plus 10 GB for the input
    assert sagemaker_jobs.download_volume_gb(DownloadOptions()) == 11
    request = processing_request(DownloadOptions())
    assert request["ProcessingResources"]["ClusterConfig"]["VolumeSizeInGB"] == 11


def test_download_volume_grows_with_shard_size_not_shard_count() -> None:
    small = sagemaker_jobs.download_volume_gb(DownloadOptions(samples_per_shard=1000, image_size=512))
    large = sagemaker_jobs.download_volume_gb(DownloadOptions(samples_per_shard=10_000, image_size=512))
    assert large > small
    # 4 processes x 2 x 10,000 x 512^2 = 21 GB of shards + 10 GB input
    assert large == 31


def test_download_volume_over_sagemaker_limit_names_the_fields() -> None:
    options = DownloadOptions(samples_per_shard=100_000, image_size=2048, processes=96)
    with pytest.raises(sagemaker_jobs.DownloadVolumeTooLarge, match=r"download\.samples_per_shard=100000") as caught:
        sagemaker_jobs.download_volume_gb(options)
    assert "16384 GB (VolumeSizeInGB)" in str(caught.value)


@pytest.mark.parametrize("max_runtime", [60, 600, 3600, 28 * 24 * 3600])
def test_download_deadline_leaves_time_before_max_runtime(max_runtime: int) -> None:
    deadline = sagemaker_jobs.download_deadline_seconds(max_runtime)
    assert 0 < deadline < max_runtime


@pytest.mark.parametrize("backend", ["colossalai", "accelerate"])
@pytest.mark.parametrize("method", ["full", "lora"])
def test_training_job_request_any_backend_and_method_asks_for_uncompressed_model_output(
    backend: str, method: str
) -> None:
    mixed_precision = "bf16" if backend == "accelerate" else "fp16"
    run = run_document(training={"backend": backend, "method": method, "mixed_precision": mixed_precision})
    request = training_request(run)
    assert_valid_request("CreateTrainingJob", request)
    assert request["OutputDataConfig"]["CompressionType"] == "NONE"


def test_training_job_request_on_demand_has_no_spot_fields() -> None:
    run = run_document(training={"instance_count": 2, "plugin": "torch_ddp", "max_runtime_seconds": 7200})
    request = training_request(run)
    assert_valid_request("CreateTrainingJob", request)
    assert request["EnableManagedSpotTraining"] is False
    assert request["StoppingCondition"] == {"MaxRuntimeInSeconds": 7200}
    assert "KeepAlivePeriodInSeconds" not in request["ResourceConfig"]
    assert request["ResourceConfig"]["InstanceCount"] == 2
    assert request["HyperParameters"]["plugin"] == "torch_ddp"
    assert all(isinstance(value, str) for value in request["HyperParameters"].values())
    channels = {c["ChannelName"]: c["DataSource"]["S3DataSource"] for c in request["InputDataConfig"]}
    assert {name: source["S3Uri"] for name, source in channels.items()} == {
        "base_model": f"s3://{DATA_BUCKET}/models/tiny-sd/",
    }
    assert channels["base_model"]["S3DataType"] == "S3Prefix"
    assert request["OutputDataConfig"] == {
        "S3OutputPath": f"s3://{DATA_BUCKET}/runs/{RUN_ID}/training/",
        "CompressionType": "NONE",
    }
    assert request["CheckpointConfig"] == {
        "S3Uri": f"s3://{DATA_BUCKET}/runs/{RUN_ID}/checkpoints/sdf-tr-demo-0123456789-a0/",
        "LocalPath": "/opt/ml/checkpoints",
    }
    assert request["AlgorithmSpecification"]["MetricDefinitions"] == [
        {"Name": "train:loss", "Regex": "loss=([0-9.eE+-]+)"},
        {"Name": "eval:prompt_adherence", "Regex": "eval:prompt_adherence=([0-9.]+)"},
        {"Name": "eval:base_prompt_adherence", "Regex": "eval:base_prompt_adherence=([0-9.]+)"},
    ]
    assert request["EnableNetworkIsolation"] is False  # the container streams its shards from S3
    assert request["EnableInterContainerTrafficEncryption"] is True
    assert request["RetryStrategy"] == {"MaximumRetryAttempts": 2}


def test_training_job_request_streams_dataset_from_runs_prefix_without_a_channel() -> None:
    """No dataset channel (File mode would copy every shard to every node before step 0): the
    container reads index.json at `dataset_index` below `dataset_dir` = `s3://<bucket>/runs/`, the root
    of every tar path in the index, so a resumed run's shards in earlier runs' folders are reached too."""
    request = training_request(run_document())
    assert_valid_request("CreateTrainingJob", request)
    assert [c["ChannelName"] for c in request["InputDataConfig"]] == ["base_model"]
    hyperparameters = request["HyperParameters"]
    assert hyperparameters["dataset_dir"] == f"s3://{DATA_BUCKET}/runs/"
    assert hyperparameters["dataset_index"] == f"{RUN_ID}/dataset/index.json"
    assert all(isinstance(value, str) for value in hyperparameters.values())


def test_training_job_request_passes_checkpoint_uri_for_pruning() -> None:
    request = training_request(run_document())
    assert request["HyperParameters"]["checkpoint_s3_uri"] == request["CheckpointConfig"]["S3Uri"]


def test_training_job_request_volume_is_run_documents_whatever_the_dataset() -> None:
    request = training_request(run_document(training={"volume_size_gb": 75}))
    assert request["ResourceConfig"]["VolumeSizeInGB"] == 75


def test_training_job_request_dataset_outside_runs_folder_raises_naming_it() -> None:
    with pytest.raises(ValueError, match=r"s3://elsewhere/x/dataset/index\.json is not below s3://"):
        sagemaker_jobs.training_job_request(
            job_name="j", run_id=RUN_ID, run_hash=RUN_HASH, bucket=DATA_BUCKET,
            dataset_prefix_uri="s3://elsewhere/x/dataset/", run=run_document(),
            image_uri=TRAINING_IMAGE_URI, role_arn=SAGEMAKER_ROLE_ARN,
        )  # fmt: skip


def test_training_job_request_spot_sets_max_wait() -> None:
    run = run_document(training={"use_spot": True, "max_runtime_seconds": 3600, "max_wait_seconds": 7200})
    request = training_request(run)
    assert_valid_request("CreateTrainingJob", request)
    assert request["EnableManagedSpotTraining"] is True
    assert request["StoppingCondition"] == {"MaxRuntimeInSeconds": 3600, "MaxWaitTimeInSeconds": 7200}


def test_training_job_request_keep_alive_sets_warm_pool() -> None:
    request = training_request(run_document(training={"keep_alive_seconds": 900}))
    assert_valid_request("CreateTrainingJob", request)
    assert request["ResourceConfig"]["KeepAlivePeriodInSeconds"] == 900


def test_deploy_requests_are_valid_and_use_one_variant() -> None:
    options = EndpointOptions(name="sdflow-test", instance_type="ml.g5.2xlarge", initial_instance_count=2)
    package = "arn:aws:sagemaker:us-east-1:123456789012:model-package/sdf-cats/2"
    model = sagemaker_jobs.model_request(
        model_name="m", run_id=RUN_ID, run_hash=RUN_HASH, model_package_arn=package, role_arn=SAGEMAKER_ROLE_ARN,
    )  # fmt: skip
    config = sagemaker_jobs.endpoint_config_request(
        config_name="c", model_name="m", run_id=RUN_ID, run_hash=RUN_HASH, options=options
    )
    create = sagemaker_jobs.create_endpoint_request(
        endpoint_name="sdflow-test", config_name="c", run_id=RUN_ID, run_hash=RUN_HASH
    )
    for request in (model, config, create):
        assert {"Key": "sdflow:run", "Value": RUN_HASH} in request["Tags"]
    assert_valid_request("CreateModel", model)
    assert_valid_request("CreateEndpointConfig", config)
    assert_valid_request("CreateEndpoint", create)
    # The image and the artifact come from the approved package's inference specification.
    assert model["PrimaryContainer"] == {"ModelPackageName": package}
    assert model["EnableNetworkIsolation"] is True
    assert config["ProductionVariants"] == [
        {"VariantName": "AllTraffic", "ModelName": "m", "InstanceType": "ml.g5.2xlarge", "InitialInstanceCount": 2}
    ]


def test_update_endpoint_request_is_blue_green_without_alarms_by_default() -> None:
    request = sagemaker_jobs.update_endpoint_request(
        endpoint_name="sdflow", config_name="c2", options=EndpointOptions(max_wait_seconds=300)
    )
    assert_valid_request("UpdateEndpoint", request)
    policy = request["DeploymentConfig"]["BlueGreenUpdatePolicy"]
    assert policy["TrafficRoutingConfiguration"]["Type"] == "ALL_AT_ONCE"
    # 300 s is below SageMaker's 600 s minimum for the blue/green execution timeout.
    assert policy["MaximumExecutionTimeoutInSeconds"] == 600
    assert "AutoRollbackConfiguration" not in request["DeploymentConfig"]


def test_update_endpoint_request_with_alarms_enables_auto_rollback() -> None:
    request = sagemaker_jobs.update_endpoint_request(
        endpoint_name="sdflow", config_name="c2", options=EndpointOptions(), rollback_alarm_names=["errors", ""]
    )
    assert_valid_request("UpdateEndpoint", request)
    assert request["DeploymentConfig"]["AutoRollbackConfiguration"] == {"Alarms": [{"AlarmName": "errors"}]}


def test_task_timeouts_exceed_the_jobs_own_limits() -> None:
    on_demand = run_document(training={"max_runtime_seconds": 3600})
    spot = run_document(training={"use_spot": True, "max_runtime_seconds": 3600, "max_wait_seconds": 10_000})
    timeouts = sagemaker_jobs.task_timeouts(on_demand)
    assert set(timeouts) == {"download", "dedup", "training", "evaluation", "approval", "endpoint"}
    assert timeouts["dedup"] > on_demand.deduplication.max_runtime_seconds
    assert timeouts["evaluation"] > on_demand.evaluation.max_runtime_seconds
    assert timeouts["approval"] == on_demand.approval.timeout_seconds
    assert timeouts["download"] > on_demand.download.max_runtime_seconds
    assert timeouts["training"] > 3600
    assert sagemaker_jobs.task_timeouts(spot)["training"] > 10_000
    assert timeouts["endpoint"] > on_demand.endpoint.max_wait_seconds


def client_error(code: str, message: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message}}, "CreateTrainingJob")


@pytest.mark.parametrize(
    ("code", "message", "throttled"),
    [
        ("ThrottlingException", "Rate exceeded", True),
        ("ValidationException", "Rate exceeded", True),
        (
            "ResourceLimitExceeded",
            "The account-level service limit 'ml.g5.12xlarge for training job usage' is 0",
            False,
        ),
        ("ValidationException", "1 validation error detected", False),
        ("ResourceInUse", "Training job names must be unique", False),
    ],
)
def test_is_throttling_classifies_sagemaker_errors(code: str, message: str, throttled: bool) -> None:
    assert sagemaker_jobs.is_throttling(client_error(code, message)) is throttled


QUOTA_MESSAGE = (
    "The account-level service limit 'ml.c5.xlarge for processing job usage' is 4 Instances, with current "
    "utilization of 4 Instances and a request delta of 1 Instances. Please use AWS Service Quotas to request "
    "an increase for this quota. If AWS Service Quotas is not available, contact AWS support to request an "
    "increase for this quota."
)


def test_quota_refusal_reads_sagemaker_resource_limit_message() -> None:
    error = client_error("ResourceLimitExceeded", QUOTA_MESSAGE)

    refusal = sagemaker_jobs.quota_refusal(error)

    assert sagemaker_jobs.is_quota_exceeded(error)
    assert refusal == sagemaker_jobs.QuotaRefusal("ml.c5.xlarge for processing job usage", 4, 4, 1)
    assert not refusal.never_fits, "instances held by other jobs free up"


def test_quota_refusal_request_above_the_quota_never_fits() -> None:
    message = QUOTA_MESSAGE.replace("is 4 Instances", "is 0 Instances").replace("utilization of 4", "utilization of 0")

    refusal = sagemaker_jobs.quota_refusal(client_error("ResourceLimitExceeded", message))

    assert refusal is not None
    assert refusal.never_fits


def test_quota_refusal_unknown_wording_is_none_and_throttling_is_not_quota() -> None:
    assert sagemaker_jobs.quota_refusal(client_error("ResourceLimitExceeded", "limit exceeded")) is None
    assert not sagemaker_jobs.is_quota_exceeded(client_error("ThrottlingException", "Rate exceeded"))


def test_is_already_exists_and_is_not_found_match_sagemaker_messages() -> None:
    assert sagemaker_jobs.is_already_exists(client_error("ValidationException", "Cannot create already existing model"))
    assert sagemaker_jobs.is_already_exists(client_error("ResourceInUse", "job exists"))
    assert not sagemaker_jobs.is_already_exists(client_error("ValidationException", "bad instance type"))
    assert sagemaker_jobs.is_not_found(client_error("ValidationException", "Could not find endpoint 'x'."))
    assert not sagemaker_jobs.is_not_found(client_error("ValidationException", "bad instance type"))


@pytest.mark.parametrize(
    ("reason", "capacity"),
    [
        ("CapacityError: Unable to provision requested ML compute capacity. Please retry using a different "
         "ML instance type.", True),
        ("InsufficientCapacityError: We currently do not have sufficient capacity in the Availability Zone "
         "you requested.", True),
        ("EC2InsufficientCapacityError: Instance type 'ml.g5.48xlarge' is temporarily unavailable in supported "
         "availability zones [euw1-az1]. Try again in a few minutes, or try a different instance type.", True),
        ("Unable to provision requested ML compute capacity", True),
        ("AlgorithmError: CapacityError: the script printed this", False),
        ("AlgorithmError: ExecuteUserScriptError: CUDA out of memory", False),
        ("ClientError: Data download failed: NoSuchKey", False),
        (None, False),
        ("", False),
    ],
)  # fmt: skip
def test_is_capacity_failure_matches_sagemakers_capacity_reasons_only(reason: str | None, capacity: bool) -> None:
    assert sagemaker_jobs.is_capacity_failure(reason) is capacity
