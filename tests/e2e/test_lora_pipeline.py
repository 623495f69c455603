"""SDXL and SD 3 LoRA runs through the local cloud's pipeline, orchestration side: Validate run reads
the family from model_index.json, the training job gets the contract's hyperparameters, Register model
registers a package whose container carries the base model, and the endpoint's model is made from it.
SageMaker jobs are no-ops (sdflow.local.sagemaker.noop): what the image does with a LoRA run is the
image's tests' part."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sdflow.local.cloud import LocalCloud
from tests.e2e.clouds import CloudSpec
from tests.helpers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CLOUD = CloudSpec(dataset="lora", shards=1)
PIPELINES = {"sdxl": "StableDiffusionXLPipeline", "sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}


@pytest.fixture(scope="module", autouse=True)
def base_models(cloud: LocalCloud) -> None:
    s3 = cloud.client("s3")
    for folder, class_name in PIPELINES.items():
        body = json.dumps({"_class_name": class_name, "_diffusers_version": "0.29.0"}).encode()
        s3.put_object(Bucket=cloud.bucket, Key=f"models/{folder}/model_index.json", Body=body)
    # Validate run reads an SD 3 pipeline's transformer config too: no qk_norm, so SD 3, not SD 3.5.
    s3.put_object(Bucket=cloud.bucket, Key="models/sd3/transformer/config.json", Body=b'{"num_layers": 24}')


def document(cloud: LocalCloud, family: str, **lora: Any) -> dict[str, Any]:
    return {
        "dataset": {"prefix": f"s3://{cloud.bucket}/datasets/lora/"},
        "base_model_uri": f"s3://{cloud.bucket}/models/{family}/",
        "training": {"instance_type": "ml.m5.xlarge", "method": "lora", "lora": lora},
        "endpoint": {"name": f"sdflow-lora-{family}", "instance_type": "ml.m5.large"},
    }


def run(cloud: LocalCloud, name: str, raw: dict[str, Any]) -> dict[str, Any]:
    sfn = cloud.client("stepfunctions")
    arn = sfn.start_execution(stateMachineArn=cloud.state_machine_arn, name=name, input=json.dumps(raw))["executionArn"]

    def ended() -> dict[str, Any] | None:
        described = sfn.describe_execution(executionArn=arn)
        return described if described["status"] != "RUNNING" else None

    return dict(wait_for(ended, timeout_s=240.0, what=f"execution {name} to end", interval_s=0.5))


@pytest.mark.parametrize(("family", "rank"), [("sdxl", 8), ("sd3", 4)])
def test_lora_run_trains_registers_base_with_adapter_and_deploys(cloud: LocalCloud, family: str, rank: int) -> None:
    described = run(cloud, f"lora-{family}", document(cloud, family, rank=rank))
    assert described["status"] == "SUCCEEDED", described.get("cause")
    output = json.loads(described["output"])
    assert output["config"]["run"]["base_model_family"] == family

    sagemaker = cloud.client("sagemaker")
    job = sagemaker.describe_training_job(TrainingJobName=output["training"]["job_name"])
    hyperparameters = job["HyperParameters"]
    assert hyperparameters["model_family"] == family
    assert hyperparameters["training_method"] == "lora"
    assert hyperparameters["lora_rank"] == str(rank)
    assert hyperparameters["plugin"] == "torch_ddp"
    assert hyperparameters["base_model_uri"] == f"s3://{cloud.bucket}/models/{family}/"

    package = sagemaker.describe_model_package(ModelPackageName=output["registry"]["model"]["model_package_arn"])
    container = package["InferenceSpecification"]["Containers"][0]
    source = container["AdditionalModelDataSources"][0]
    assert source["ChannelName"] == "base_model"
    assert source["S3DataSource"]["S3Uri"] == f"s3://{cloud.bucket}/models/{family}/"
    assert package["CustomerMetadataProperties"]["sdflow:model_family"] == family
    assert package["CustomerMetadataProperties"]["sdflow:training_method"] == "lora"

    endpoint = sagemaker.describe_endpoint(EndpointName=f"sdflow-lora-{family}")
    assert endpoint["EndpointStatus"] == "InService"


def test_lora_run_of_unsupported_pipeline_fails_at_validate_run_naming_class(cloud: LocalCloud) -> None:
    described = run(cloud, "lora-flux", document(cloud, "flux"))
    assert described["status"] == "FAILED"
    assert "FluxPipeline" in described["cause"]
    assert "StableDiffusionXLPipeline (sdxl)" in described["cause"]
    listed = cloud.client("sagemaker").list_training_jobs(NameContains="lora-flux")["TrainingJobSummaries"]
    assert listed == []
