"""SageMaker's enumerations from its service model, refused as AWS refuses them (botocore sends any string; moto
keeps it): ProductionVariant.InferenceAmiVersion outside ProductionVariantInferenceAmiVersion's values is a
ValidationException before the endpoint config exists."""

from __future__ import annotations

from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdflow.local import runtime as runtime_module
from sdflow_common.instance_types import CUDA13_INFERENCE_AMI
from tests.unit.local.helpers import ROLE, client


def _with_model() -> Any:
    sagemaker = client("sagemaker")
    sagemaker.create_model(
        ModelName="m",
        PrimaryContainer={"Image": "123456789012.dkr.ecr.us-east-1.amazonaws.com/i:1"},
        ExecutionRoleArn=ROLE,
    )
    return sagemaker


def _config(name: str, ami: str | None) -> dict[str, Any]:
    variant: dict[str, Any] = {
        "VariantName": "AllTraffic",
        "ModelName": "m",
        "InstanceType": "ml.g4dn.xlarge",  # moto 5.2.5's own list of endpoint instance types has no g5
        "InitialInstanceCount": 1,
    }
    if ami is not None:
        variant["InferenceAmiVersion"] = ami
    return {"EndpointConfigName": name, "ProductionVariants": [variant]}


def test_endpoint_config_inference_ami_outside_enum_is_refused_naming_values(runtime: runtime_module.Runtime) -> None:
    sagemaker = _with_model()
    with pytest.raises(ClientError) as refused:
        sagemaker.create_endpoint_config(**_config("bad-ami", "al2023-ami-sagemaker-inference-gpu-9"))
    error: Any = refused.value.response["Error"]
    assert error["Code"] == "ValidationException"
    assert error["Message"].startswith(
        "1 validation error detected: Value 'al2023-ami-sagemaker-inference-gpu-9' at "
        "'productionVariants.1.member.inferenceAmiVersion' failed to satisfy constraint: Member must satisfy enum "
        "value set: [al2-ami-sagemaker-inference-gpu-2, "
    )
    assert CUDA13_INFERENCE_AMI in error["Message"]
    with pytest.raises(ClientError, match="Could not find"):
        sagemaker.describe_endpoint_config(EndpointConfigName="bad-ami")


def test_endpoint_config_cuda13_inference_ami_is_accepted(runtime: runtime_module.Runtime) -> None:
    sagemaker = _with_model()
    sagemaker.create_endpoint_config(**_config("cuda13", CUDA13_INFERENCE_AMI))
    assert sagemaker.describe_endpoint_config(EndpointConfigName="cuda13")["EndpointConfigName"] == "cuda13"
