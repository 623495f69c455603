"""A run on the accelerate backend through the local cloud's pipeline, orchestration side: a FLUX.2 [klein]
model's run gets `training.backend: accelerate` (and plugin fsdp2) from Validate run, its training job, its
evaluation job and its model package name the stack's second image (AccelerateImageUri) while the download
jobs keep the first, the registry records the backend, and the endpoint an SD run created before is updated
blue/green to the other backend's model. SageMaker jobs are no-ops (sdflow.local.sagemaker.noop): what the
second image does with the run is its own tests' part (tests/image_accelerate, test_accelerate_local.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sdflow.local.cloud import LocalCloud
from tests.e2e.clouds import CloudSpec
from tests.helpers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CLOUD = CloudSpec(dataset="accelerate", shards=1)
ENDPOINT = "sdflow-backends"


@pytest.fixture(scope="module", autouse=True)
def flux2_model(cloud: LocalCloud) -> None:
    s3 = cloud.client("s3")
    index = {"_class_name": "Flux2KleinPipeline", "_diffusers_version": "0.42.1"}
    s3.put_object(Bucket=cloud.bucket, Key="models/flux2/model_index.json", Body=json.dumps(index).encode())
    # FLUX.2 [klein] 4B's transformer: 24 attention heads of 128 (Validate run sizes the memory check by it).
    config = {"_class_name": "Flux2Transformer2DModel", "num_attention_heads": 24, "num_layers": 5}
    s3.put_object(Bucket=cloud.bucket, Key="models/flux2/transformer/config.json", Body=json.dumps(config).encode())


def document(cloud: LocalCloud, model: str, **training: Any) -> dict[str, Any]:
    return {
        "run_name": "backends",
        "dataset": {"prefix": f"s3://{cloud.bucket}/datasets/accelerate/"},
        "base_model_uri": f"s3://{cloud.bucket}/models/{model}/",
        "training": {"instance_type": "ml.m5.xlarge", **training},
        # On CPU as the training: FLUX.2 [klein] 4B's float32 evaluation outgrows the default ml.g5.xlarge.
        "evaluation": {"instance_type": "ml.m5.xlarge"},
        "endpoint": {"name": ENDPOINT, "instance_type": "ml.m5.large"},
    }


def run(cloud: LocalCloud, name: str, raw: dict[str, Any]) -> dict[str, Any]:
    sfn = cloud.client("stepfunctions")
    arn = sfn.start_execution(stateMachineArn=cloud.state_machine_arn, name=name, input=json.dumps(raw))["executionArn"]

    def ended() -> dict[str, Any] | None:
        described = sfn.describe_execution(executionArn=arn)
        return described if described["status"] != "RUNNING" else None

    described = dict(wait_for(ended, timeout_s=240.0, what=f"execution {name} to end", interval_s=0.5))
    assert described["status"] == "SUCCEEDED", described.get("cause")
    return dict(json.loads(described["output"]))


def images(cloud: LocalCloud) -> tuple[str, str]:
    """The stack's first and second image, as its template builds them."""
    outputs = cloud.deployment.outputs if cloud.deployment is not None else {}
    second = outputs["AccelerateImageUri"]
    return f"{outputs['TrainingRepositoryUri']}:v0.1.0", second


def served_image(cloud: LocalCloud) -> str:
    """The image of the model package the endpoint's current config serves."""
    sagemaker = cloud.client("sagemaker")
    config = sagemaker.describe_endpoint(EndpointName=ENDPOINT)["EndpointConfigName"]
    model = sagemaker.describe_endpoint_config(EndpointConfigName=config)["ProductionVariants"][0]["ModelName"]
    package = sagemaker.describe_model(ModelName=model)["PrimaryContainer"]["ModelPackageName"]
    container = sagemaker.describe_model_package(ModelPackageName=package)["InferenceSpecification"]["Containers"][0]
    return str(container["Image"])


@pytest.fixture(scope="module")
def sd_run(cloud: LocalCloud) -> dict[str, Any]:
    """A run on the first image (an SD model: colossalai) that creates the endpoint."""
    return run(cloud, "backend-sd", document(cloud, "tiny"))


def test_accelerate_run_jobs_and_package_use_the_second_image_and_swap_the_endpoint_blue_green(
    cloud: LocalCloud, sd_run: dict[str, Any]
) -> None:
    first, second = images(cloud)
    assert sd_run["config"]["run"]["training"]["backend"] == "colossalai"
    assert served_image(cloud) == first
    sagemaker = cloud.client("sagemaker")
    before = sagemaker.describe_endpoint(EndpointName=ENDPOINT)["EndpointConfigName"]

    output = run(cloud, "backend-flux2", document(cloud, "flux2", method="lora"))
    training = output["config"]["run"]["training"]
    assert output["config"]["run"]["base_model_family"] == "flux2"
    assert (training["backend"], training["plugin"], training["mixed_precision"]) == ("accelerate", "ddp", "bf16")

    job = sagemaker.describe_training_job(TrainingJobName=output["training"]["job_name"])
    assert job["AlgorithmSpecification"]["TrainingImage"] == second
    assert job["HyperParameters"]["backend"] == "accelerate"
    assert job["HyperParameters"]["plugin"] == "ddp"
    assert job["HyperParameters"]["model_family"] == "flux2"
    evaluation = sagemaker.describe_processing_job(ProcessingJobName=output["evaluation"]["job_name"])
    assert evaluation["AppSpecification"]["ImageUri"] == second
    downloads = [
        sagemaker.describe_processing_job(ProcessingJobName=summary["ProcessingJobName"])
        for summary in sagemaker.list_processing_jobs()["ProcessingJobSummaries"]
        if summary["ProcessingJobName"].startswith("sdf-dl-")
    ]
    assert downloads
    assert {job["AppSpecification"]["ImageUri"] for job in downloads} == {first}

    package = sagemaker.describe_model_package(ModelPackageName=output["registry"]["model"]["model_package_arn"])
    assert package["InferenceSpecification"]["Containers"][0]["Image"] == second
    metadata = package["CustomerMetadataProperties"]
    assert (metadata["sdflow:training_backend"], metadata["sdflow:image"]) == ("accelerate", second)
    assert metadata["sdflow:model_family"] == "flux2"

    endpoint = sagemaker.describe_endpoint(EndpointName=ENDPOINT)
    assert endpoint["EndpointStatus"] == "InService"
    assert endpoint["EndpointConfigName"] != before
    assert served_image(cloud) == second


def test_accelerate_backend_named_for_an_sd_model_with_a_colossalai_plugin_fails_at_validate_run(
    cloud: LocalCloud,
) -> None:
    sfn = cloud.client("stepfunctions")
    raw = document(cloud, "tiny", backend="accelerate", plugin="gemini")
    arn = sfn.start_execution(stateMachineArn=cloud.state_machine_arn, name="backend-bad", input=json.dumps(raw))
    described = wait_for(
        lambda: (d := sfn.describe_execution(executionArn=arn["executionArn"]))["status"] != "RUNNING" and d,
        timeout_s=120.0,
        what="the refused run to end",
        interval_s=0.5,
    )
    assert described["status"] == "FAILED"
    assert "training.plugin" in described["cause"]
    assert "set training.backend to 'colossalai'" in described["cause"]
    assert cloud.client("sagemaker").list_training_jobs(NameContains="backend-bad")["TrainingJobSummaries"] == []
