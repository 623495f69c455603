"""A LoRA model's base in the local SageMaker: AdditionalModelDataSources checked as SageMaker checks
them, and downloaded to the serving container's additional-model-data-sources/<channel>/ folder."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdflow.local import runtime as runtime_module
from sdflow.local.sagemaker import endpoints as sagemaker_endpoints
from sdflow.local.sagemaker.engine import DeploymentFailed, JobSetupError, LocalSageMaker
from sdflow.local.sagemaker.service import SageMakerStatusPublisher
from tests.unit.local.helpers import client, fake_training_image

GROUP = "sdflow-lora"
ARTIFACT = "s3://data/runs/run/training/sdf-tr-run-a0/output/model.tar.gz"
BASE = "s3://data/models/sdxl/"


def base_source(uri: str = BASE, **changes: Any) -> dict[str, Any]:
    s3 = {"S3Uri": uri, "S3DataType": "S3Prefix", "CompressionType": "None"} | changes
    return {"ChannelName": "base_model", "S3DataSource": s3}


def container(*sources: dict[str, Any]) -> dict[str, Any]:
    return {
        "Image": "image:tag",
        "ModelDataUrl": ARTIFACT,
        "AdditionalModelDataSources": list(sources),
        "Environment": {"SDFLOW_BASE_MODEL_DIR": "/opt/ml/additional-model-data-sources/base_model"},
    }


def register(sagemaker: Any, *sources: dict[str, Any]) -> str:
    inference = {
        "Containers": [container(*sources)],
        "SupportedContentTypes": ["application/json"],
        "SupportedResponseMIMETypes": ["image/png"],
    }
    request = {"ModelPackageGroupName": GROUP, "InferenceSpecification": inference, "ModelApprovalStatus": "Approved"}
    return str(sagemaker.create_model_package(**request)["ModelPackageArn"])


def refusal(call: Any, **kwargs: Any) -> str:
    with pytest.raises(ClientError) as raised:
        call(**kwargs)
    assert raised.value.response["Error"]["Code"] == "ValidationException"
    return str(raised.value.response["Error"]["Message"])


def test_create_model_package_lora_container_keeps_base_model_source(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    sagemaker.create_model_package_group(ModelPackageGroupName=GROUP)
    arn = register(sagemaker, base_source())
    described = sagemaker.describe_model_package(ModelPackageName=arn)
    assert described["InferenceSpecification"]["Containers"][0]["AdditionalModelDataSources"] == [base_source()]


@pytest.mark.parametrize(
    ("source", "words"),
    [
        (base_source("s3://data/models/sdxl"), "must end with a forward slash"),
        (base_source(CompressionType="Gzip"), "use CompressionType None with S3DataType S3Prefix"),
        ({**base_source(), "ChannelName": "base model"}, "regular expression pattern"),
    ],
)
def test_create_model_package_malformed_base_source_is_refused(
    runtime: runtime_module.Runtime, source: dict[str, Any], words: str
) -> None:
    sagemaker = client("sagemaker")
    sagemaker.create_model_package_group(ModelPackageGroupName=GROUP)
    with pytest.raises(ClientError) as raised:
        register(sagemaker, source)
    assert raised.value.response["Error"]["Code"] == "ValidationException"
    assert words in str(raised.value.response["Error"]["Message"])


def test_create_model_package_six_sources_are_refused(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    sagemaker.create_model_package_group(ModelPackageGroupName=GROUP)
    sources = [{**base_source(), "ChannelName": f"c{i}"} for i in range(6)]
    with pytest.raises(ClientError) as raised:
        register(sagemaker, *sources)
    assert "length less than or equal to 5" in str(raised.value.response["Error"]["Message"])


def test_create_model_malformed_base_source_is_refused(runtime: runtime_module.Runtime) -> None:
    message = refusal(
        client("sagemaker").create_model,
        ModelName="m",
        PrimaryContainer=container(base_source("s3://data/models/sdxl")),
        ExecutionRoleArn="arn:aws:iam::123456789012:role/sdflow",
    )
    assert "primaryContainer.additionalModelDataSources.1.member.s3DataSource.s3Uri" in message


class _FakeS3:
    """The model's S3 access: a LoRA archive for the artifact, a model folder for the base prefix."""

    def __init__(self) -> None:
        self.prefixes: list[str] = []

    def download_file(self, url: str, dest: Path, field: str) -> None:
        payload = b'{"format": 1, "method": "lora"}'
        with tarfile.open(dest, "w:gz") as tar:
            info = tarfile.TarInfo("sdflow_model.json")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))

    def download_prefix(self, uri: str, dest: Path, field: str) -> list[str]:
        if uri != BASE:
            raise JobSetupError(f"no S3 objects found under {field} {uri}")
        self.prefixes.append(uri)
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
        return ["model_index.json"]


class _Process:
    started: list[dict[str, str]] = []

    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> None:
        _Process.started.append(env)

    def wall_s(self) -> float:
        return 0.0


@pytest.fixture
def local_sagemaker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(sagemaker_endpoints, "free_port", lambda: 65000)  # no socket in unit tests
    monkeypatch.setattr(sagemaker_endpoints, "ContainerProcess", _Process)
    _Process.started = []
    image = fake_training_image(tmp_path, {"serve": "print('never started')\n"})
    sm = LocalSageMaker(tmp_path / "sm", "http://127.0.0.1:9", SageMakerStatusPublisher(), training_image_dir=image)
    monkeypatch.setattr(sm, "_s3_for", lambda role: _FakeS3())
    monkeypatch.setattr(sm, "_wait_healthy", lambda deployment, cancelled=None: None)
    yield sm
    sm.shutdown()


def test_start_serving_lora_package_puts_base_model_in_channel_folder_and_names_it(
    runtime: runtime_module.Runtime, local_sagemaker: LocalSageMaker
) -> None:
    sagemaker = client("sagemaker")
    sagemaker.create_model_package_group(ModelPackageGroupName=GROUP)
    arn = register(sagemaker, base_source())

    deployment = local_sagemaker._start_serving(
        "e", "c", {"ModelName": "m", "PrimaryContainer": {"ModelPackageName": arn}}
    )

    base_dir = Path(_Process.started[0]["SDFLOW_BASE_MODEL_DIR"])
    assert base_dir == deployment.folder / "opt_ml" / "additional-model-data-sources" / "base_model"
    assert json.loads((base_dir / "model_index.json").read_text())["_class_name"] == "StableDiffusionXLPipeline"
    assert (deployment.folder / "opt_ml" / "model" / "sdflow_model.json").is_file()


def test_start_serving_full_model_passes_no_base_model_dir(local_sagemaker: LocalSageMaker) -> None:
    model = {"ModelName": "m", "PrimaryContainer": {"Image": "image:tag", "ModelDataUrl": ARTIFACT}}
    local_sagemaker._start_serving("e", "c", model)
    assert "SDFLOW_BASE_MODEL_DIR" not in _Process.started[0]


def test_start_serving_unreadable_base_model_fails_deployment_naming_channel(local_sagemaker: LocalSageMaker) -> None:
    model = {"ModelName": "m", "PrimaryContainer": container(base_source("s3://data/models/missing/"))}
    with pytest.raises(DeploymentFailed, match=r"model m, channel base_model: no S3 objects found"):
        local_sagemaker._start_serving("e", "c", model)
