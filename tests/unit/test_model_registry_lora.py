"""Register model for LoRA runs: the package carries the base model as an additional model data source,
and the registry's metadata records family, method and base model for every run."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from sdflow_common.evaluation import EVALUATION_FILE
from sdflow_common.model_registry import RegisterTask, model_package_request, register_model
from sdflow_common.settings import Settings
from tests.unit.helpers import AwsWorld, load_event
from tests.unit.job_requests import assert_valid_request

SCORES = {"prompt_adherence": 0.86, "base_prompt_adherence": 0.11, "prompts": 48}
BASE = "s3://sdflow-data-test/models/stable-diffusion-xl-base-1.0"
pytestmark = pytest.mark.usefixtures("aws_env")  # the template's environment: the training image URI


def task_event(method: str, **lora: Any) -> dict[str, Any]:
    event = copy.deepcopy(load_event("register_model_task.json"))
    run = event["config"]["run"]
    run["base_model_uri"] = BASE
    run["base_model_family"] = "sdxl"
    run["training"] = {**run.get("training", {}), "method": method, "plugin": "torch_ddp"}
    if lora:
        run["training"]["lora"] = lora
    return event


def package(event: dict[str, Any]) -> dict[str, Any]:
    return model_package_request(RegisterTask.model_validate(event), Settings.from_env(), "sdf-g", "Approved", SCORES)


def put_scores(world: AwsWorld, event: dict[str, Any]) -> None:
    bucket, _, prefix = event["evaluation"]["evaluation_uri"].removeprefix("s3://").partition("/")
    world.put_json(prefix + EVALUATION_FILE, SCORES, bucket=bucket)


def test_model_package_lora_container_carries_base_model_channel_and_its_folder() -> None:
    request = package(task_event("lora"))
    container = request["InferenceSpecification"]["Containers"][0]
    assert container["AdditionalModelDataSources"] == [
        {
            "ChannelName": "base_model",
            "S3DataSource": {"S3Uri": BASE + "/", "S3DataType": "S3Prefix", "CompressionType": "None"},
        }
    ]
    assert container["Environment"] == {"SDFLOW_BASE_MODEL_DIR": "/opt/ml/additional-model-data-sources/base_model"}
    assert_valid_request("CreateModelPackage", request)


def test_model_package_full_container_has_no_base_model_channel() -> None:
    container = package(task_event("full"))["InferenceSpecification"]["Containers"][0]
    assert set(container) == {"Image", "ModelDataSource"}


@pytest.mark.parametrize("method", ["full", "lora"])
def test_model_package_any_method_reads_trained_model_as_uncompressed_prefix(method: str) -> None:
    event = task_event(method)
    request = package(event)
    container = request["InferenceSpecification"]["Containers"][0]
    assert "ModelDataUrl" not in container
    assert container["ModelDataSource"] == {
        "S3DataSource": {
            "S3Uri": event["training"]["model_data_url"],
            "S3DataType": "S3Prefix",
            "CompressionType": "None",
        }
    }
    assert_valid_request("CreateModelPackage", request)


def test_model_package_older_model_tar_gz_is_read_as_gzip_object() -> None:
    event = task_event("full")
    event["training"]["model_data_url"] = "s3://b/runs/old/training/job/output/model.tar.gz"
    container = package(event)["InferenceSpecification"]["Containers"][0]
    assert container["ModelDataSource"]["S3DataSource"] == {
        "S3Uri": "s3://b/runs/old/training/job/output/model.tar.gz",
        "S3DataType": "S3Object",
        "CompressionType": "Gzip",
    }


@pytest.mark.parametrize("method", ["full", "lora"])
def test_model_package_metadata_records_family_method_and_base(method: str) -> None:
    metadata = package(task_event(method))["CustomerMetadataProperties"]
    assert metadata["sdflow:model_family"] == "sdxl"
    assert metadata["sdflow:training_method"] == method
    assert metadata["sdflow:base_model_uri"] == BASE
    assert ("sdflow:lora" in metadata) == (method == "lora")


def test_model_package_lora_metadata_lists_targets_without_commas() -> None:
    event = task_event("lora", rank=16, target_modules=["to_q", "to_out.0"], text_encoder=True)
    request = package(event)
    summary = request["CustomerMetadataProperties"]["sdflow:lora"]
    assert summary == "rank=16 alpha=16 dropout=0 text_encoder=true targets=to_q to_out.0"
    assert_valid_request("CreateModelPackage", request)


def test_register_model_lora_package_is_registered_with_its_base(mocked_aws: AwsWorld) -> None:
    event = task_event("lora")
    put_scores(mocked_aws, event)
    result = register_model(RegisterTask.model_validate(event), Settings.from_env())
    described = mocked_aws.sagemaker.describe_model_package(ModelPackageName=result["model_package_arn"])
    sources = described["InferenceSpecification"]["Containers"][0]["AdditionalModelDataSources"]
    assert sources[0]["S3DataSource"]["S3Uri"] == BASE + "/"
