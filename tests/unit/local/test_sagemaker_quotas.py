"""SageMaker's instance quotas (ResourceLimitExceeded) and Create* throttling, as AWS answers them."""

from __future__ import annotations

import time
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdflow.local import runtime as runtime_module
from sdflow.local.sagemaker import quotas
from sdflow.local.sagemaker.service import SageMakerStatusPublisher
from tests.unit.local.helpers import PROCESSING_REQUEST, ROLE, TRAINING_REQUEST, client

QUOTA_ADVICE = (
    "Please use AWS Service Quotas to request an increase for this quota. If AWS Service Quotas is not "
    "available, contact AWS support to request an increase for this quota."
)


def _processing(name: str) -> dict[str, Any]:
    return {**PROCESSING_REQUEST, "ProcessingJobName": name}


def _error(exc: pytest.ExceptionInfo[ClientError]) -> tuple[str, int, str]:
    response: Any = exc.value.response
    return response["Error"]["Code"], response["ResponseMetadata"]["HTTPStatusCode"], response["Error"]["Message"]


def test_processing_jobs_over_default_quota_refused_until_one_ends(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    for i in range(4):
        sagemaker.create_processing_job(**_processing(f"job-{i}"))
    with pytest.raises(ClientError) as refused:
        sagemaker.create_processing_job(**_processing("job-4"))
    assert _error(refused) == (
        "ResourceLimitExceeded",
        400,
        "The account-level service limit 'ml.m5.xlarge for processing job usage' is 4 Instances, with current "
        f"utilization of 4 Instances and a request delta of 1 Instances. {QUOTA_ADVICE}",
    )
    with pytest.raises(ClientError, match=r"ResourceNotFound|Could not find"):
        sagemaker.describe_processing_job(ProcessingJobName="job-4")  # a refused job is not recorded

    SageMakerStatusPublisher().job_status_changed("processing", "job-1", "Completed", {})
    sagemaker.create_processing_job(**_processing("job-4"))
    assert runtime.sagemaker_quotas.usage("ml.m5.xlarge for processing job usage") == 4


def test_training_quota_counts_instances_and_spot_has_its_own(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    sagemaker.create_training_job(**TRAINING_REQUEST)  # 2 instances: the whole default quota
    with pytest.raises(ClientError) as refused:
        sagemaker.create_training_job(**{**TRAINING_REQUEST, "TrainingJobName": "second"})
    code, status, message = _error(refused)
    assert (code, status) == ("ResourceLimitExceeded", 400)
    assert "'ml.m5.xlarge for training job usage' is 2 Instances, with current utilization of 2 Instances and a " in (
        message
    )
    assert "request delta of 2 Instances" in message
    spot = {**TRAINING_REQUEST, "TrainingJobName": "spot", "EnableManagedSpotTraining": True}
    spot["StoppingCondition"] = {"MaxRuntimeInSeconds": 3600, "MaxWaitTimeInSeconds": 3600}
    sagemaker.create_training_job(**spot)
    assert runtime.sagemaker_quotas.usage("ml.m5.xlarge for spot training job usage") == 2
    SageMakerStatusPublisher().job_status_changed("training", "sdf-tr-run-a0", "Failed", {})
    sagemaker.create_training_job(**{**TRAINING_REQUEST, "TrainingJobName": "second"})


def test_quota_overrides_by_use_and_by_name_apply(runtime: runtime_module.Runtime) -> None:
    runtime.sagemaker_quotas = quotas.SageMakerQuotas(
        overrides={"processing job": 1, "ml.m5.xlarge for training job usage": 8}
    )
    sagemaker = client("sagemaker")
    sagemaker.create_processing_job(**_processing("only"))
    with pytest.raises(ClientError, match="is 1 Instances, with current utilization of 1 Instances"):
        sagemaker.create_processing_job(**_processing("over"))
    for i in range(4):
        sagemaker.create_training_job(**{**TRAINING_REQUEST, "TrainingJobName": f"t{i}"})


def _model_and_config(sagemaker: Any, suffix: str, instances: int = 1) -> None:
    sagemaker.create_model(ModelName=f"m-{suffix}", ExecutionRoleArn=ROLE, PrimaryContainer={"Image": "image:tag"})
    variant = {
        "VariantName": "AllTraffic",
        "ModelName": f"m-{suffix}",
        "InitialInstanceCount": instances,
        "InstanceType": "ml.m5.xlarge",
    }
    sagemaker.create_endpoint_config(EndpointConfigName=f"c-{suffix}", ProductionVariants=[variant])


def test_endpoint_update_holds_both_fleets_until_in_service_and_delete_frees(
    runtime: runtime_module.Runtime,
) -> None:
    sagemaker, publisher = client("sagemaker"), SageMakerStatusPublisher()
    for suffix in ("a", "b", "c"):
        _model_and_config(sagemaker, suffix)
    sagemaker.create_endpoint(EndpointName="e", EndpointConfigName="c-a")
    publisher.job_status_changed("endpoint", "e", "InService", {"EndpointConfigName": "c-a"})
    sagemaker.update_endpoint(EndpointName="e", EndpointConfigName="c-b")  # blue/green: 2 of 2 in use
    with pytest.raises(ClientError) as refused:
        sagemaker.create_endpoint(EndpointName="other", EndpointConfigName="c-c")
    assert _error(refused)[:2] == ("ResourceLimitExceeded", 400)
    assert "'ml.m5.xlarge for endpoint usage' is 2 Instances, with current utilization of 2" in _error(refused)[2]

    publisher.job_status_changed("endpoint", "e", "InService", {"EndpointConfigName": "c-b"})
    sagemaker.create_endpoint(EndpointName="other", EndpointConfigName="c-c")
    sagemaker.delete_endpoint(EndpointName="e")
    assert runtime.sagemaker_quotas.usage("ml.m5.xlarge for endpoint usage") == 1
    assert ("stop", ("endpoint", "e")) in runtime.sagemaker.calls  # type: ignore[union-attr]


def test_create_calls_over_rate_throttled(runtime: runtime_module.Runtime) -> None:
    runtime.sagemaker_quotas = quotas.SageMakerQuotas(create_rate_per_s=0.01, create_burst=2)
    sagemaker = client("sagemaker")
    sagemaker.create_processing_job(**_processing("one"))
    sagemaker.create_processing_job(**_processing("two"))
    with pytest.raises(ClientError) as throttled:
        sagemaker.create_processing_job(**_processing("three"))
    assert _error(throttled) == ("ThrottlingException", 400, "Rate exceeded")


def test_list_job_calls_over_their_own_rate_throttled_creates_unaffected(runtime: runtime_module.Runtime) -> None:
    """ListProcessingJobs / ListTrainingJobs share a bucket of their own (AWS: ListTrainingJobs at
    2 calls a second, account-wide, as users report it); Create* calls keep theirs."""
    runtime.sagemaker_quotas = quotas.SageMakerQuotas(list_rate_per_s=0.01, list_burst=2)
    sagemaker = client("sagemaker")
    sagemaker.list_processing_jobs()
    sagemaker.list_training_jobs()
    with pytest.raises(ClientError) as throttled:
        sagemaker.list_processing_jobs()
    assert _error(throttled) == ("ThrottlingException", 400, "Rate exceeded")
    sagemaker.create_processing_job(**_processing("still-created"))
    assert runtime.sagemaker_quotas.list_calls >= 3


def test_default_list_rate_is_two_a_second_with_a_burst_of_ten() -> None:
    bucket = quotas.SageMakerQuotas()
    for _ in range(10):
        bucket.take_list_token()
    with pytest.raises(quotas.RateExceeded):
        bucket.take_list_token()
    assert (bucket.list_rate_per_s, bucket.list_burst) == (2.0, 10)


def test_token_bucket_refills_at_its_rate() -> None:
    bucket = quotas.SageMakerQuotas(create_rate_per_s=50.0, create_burst=1)
    bucket.take_create_token()
    with pytest.raises(quotas.RateExceeded):
        bucket.take_create_token()
    time.sleep(0.05)
    bucket.take_create_token()


def test_quota_override_unknown_name_or_bad_value_names_the_fix() -> None:
    with pytest.raises(quotas.QuotaConfigError, match=r"unknown SageMaker quota 'procesing job'.*processing job"):
        quotas.SageMakerQuotas(overrides={"procesing job": 3})
    with pytest.raises(quotas.QuotaConfigError, match="whole number"):
        quotas.parse_overrides({"endpoint": -1})
    assert quotas.overrides_from_env('{"ml.g5.xlarge for endpoint usage": 1}') == {"ml.g5.xlarge for endpoint usage": 1}
    with pytest.raises(quotas.QuotaConfigError, match=quotas.QUOTAS_ENV):
        quotas.overrides_from_env("processing job=3")
    assert quotas.overrides_from_flags(["processing job=8", "ml.m5.large for training job usage = 0"]) == {
        "processing job": 8,
        "ml.m5.large for training job usage": 0,
    }
