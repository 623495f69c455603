"""Uncompressed model output in the local SageMaker, as SageMaker does it ("Uncompressed model output",
SageMaker developer guide): with OutputDataConfig.CompressionType NONE the job's /opt/ml/model is
uploaded file by file under the prefix the job reports (ModelArtifacts.S3ModelArtifacts); with GZIP or
no CompressionType, as model.tar.gz. A model's ModelDataSource S3Prefix puts each object back at its key
minus the prefix under /opt/ml/model, and an evaluation job's S3Prefix input gets the same files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from sdflow.local import runtime as runtime_module
from sdflow.local.sagemaker import endpoints as sagemaker_endpoints
from sdflow.local.sagemaker import engine as sagemaker_module
from sdflow.local.sagemaker.engine import LocalSageMaker
from sdflow.local.sagemaker.service import SageMakerStatusPublisher
from tests.constants import REGION
from tests.unit.local.helpers import (
    PROCESSING_REQUEST,
    TRAINING_REQUEST,
    client,
    events_queue,
    fake_training_image,
    received,
    wait_for,
)
from tests.unit.local.recorders import Recorder

S3_ENDPOINT = f"https://s3.{REGION}.amazonaws.com"
OUTPUT = "s3://data/runs/run/training/"
# The trained model, as a full run's pipeline folder lays it out (nested folders included).
MODEL_FILES = {
    "model_index.json": '{"_class_name": "StableDiffusionPipeline"}',
    "unet/config.json": '{"sample_size": 8}',
    "unet/diffusion_pytorch_model.safetensors": "weights",
    "sdflow_model.json": '{"format": 1, "method": "full"}',
}
TRAIN = f"""#!/usr/bin/env python3
import json, os, pathlib
root = pathlib.Path(os.environ["SDFLOW_OPT_ML"])
for name, text in {MODEL_FILES!r}.items():
    path = root / "model" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
(root / "output" / "data").mkdir(parents=True, exist_ok=True)
(root / "output" / "data" / "training_summary.json").write_text(json.dumps({{"steps": 1}}))
"""
# The evaluation job's stand-in: the relative paths of the model folder it was given, as its output.
EVALUATE = """#!/usr/bin/env python3
import json, os, pathlib
root = pathlib.Path(os.environ["SDFLOW_OPT_ML"]) / "processing"
model = root / "model"
files = sorted(p.relative_to(model).as_posix() for p in model.rglob("*") if p.is_file())
(root / "evaluation" / "files.json").write_text(json.dumps(files))
"""


class _Process:
    """The serving container, never started: the test reads the deployment's opt_ml/model."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> None:
        pass

    def wall_s(self) -> float:
        return 0.0


@pytest.fixture
def local_sagemaker(
    aws: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[LocalSageMaker, Recorder]]:
    monkeypatch.setattr(sagemaker_module, "free_port", lambda: 65000)  # no socket in unit tests
    monkeypatch.setattr(sagemaker_endpoints, "free_port", lambda: 65000)
    monkeypatch.setattr(sagemaker_endpoints, "ContainerProcess", _Process)
    boto3.client("s3", region_name=REGION).create_bucket(Bucket="data")
    image = fake_training_image(tmp_path, {"train": TRAIN, "evaluate": EVALUATE, "serve": "print('never')\n"})
    recorder = Recorder()
    sm = LocalSageMaker(tmp_path / "sm", S3_ENDPOINT, recorder, training_image_dir=image, stop_grace_s=0.5)
    monkeypatch.setattr(sm, "_wait_healthy", lambda deployment, cancelled=None: None)
    yield sm, recorder
    sm.shutdown()


def _train(sm: LocalSageMaker, recorder: Recorder, name: str, output: dict[str, Any]) -> str:
    request: dict[str, Any] = {**TRAINING_REQUEST, "TrainingJobName": name, "OutputDataConfig": output}
    request["ResourceConfig"] = dict(request["ResourceConfig"]) | {"InstanceCount": 1}
    sm.run_training_job(request)
    status, fields = wait_for(lambda: recorder.final(name), what="the training job to end")
    assert status == "Completed", fields
    return str(fields["ModelArtifacts"]["S3ModelArtifacts"])


def _keys(prefix: str) -> dict[str, bytes]:
    s3 = boto3.client("s3", region_name=REGION)
    listed = s3.list_objects_v2(Bucket="data", Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix) :]: s3.get_object(Bucket="data", Key=o["Key"])["Body"].read() for o in listed}


def test_training_uncompressed_output_uploads_model_files_under_reported_prefix(
    local_sagemaker: tuple[LocalSageMaker, Recorder],
) -> None:
    sm, recorder = local_sagemaker
    reported = _train(sm, recorder, "t-none", {"S3OutputPath": OUTPUT, "CompressionType": "NONE"})

    assert reported == f"{OUTPUT}t-none/output/model/"
    job = "runs/run/training/t-none/output/"
    assert _keys(f"{job}model/") == {name: text.encode() for name, text in MODEL_FILES.items()}
    assert _keys(f"{job}data/") == {"training_summary.json": b'{"steps": 1}'}
    assert not {"model.tar.gz", "output.tar.gz"} & set(_keys(job))


@pytest.mark.parametrize("compression", ["GZIP", None])
def test_training_gzip_or_default_output_uploads_model_tar_gz(
    local_sagemaker: tuple[LocalSageMaker, Recorder], compression: str | None
) -> None:
    sm, recorder = local_sagemaker
    output = {"S3OutputPath": OUTPUT} | ({"CompressionType": compression} if compression else {})
    reported = _train(sm, recorder, "t-gzip", output)

    assert reported == f"{OUTPUT}t-gzip/output/model.tar.gz"
    assert set(_keys("runs/run/training/t-gzip/output/")) == {"model.tar.gz", "output.tar.gz"}


def test_uncompressed_model_serves_and_evaluates_from_reported_prefix(
    local_sagemaker: tuple[LocalSageMaker, Recorder],
) -> None:
    sm, recorder = local_sagemaker
    prefix = _train(sm, recorder, "t-serve", {"S3OutputPath": OUTPUT, "CompressionType": "NONE"})

    source = {"S3DataSource": {"S3Uri": prefix, "S3DataType": "S3Prefix", "CompressionType": "None"}}
    model = {"ModelName": "m", "PrimaryContainer": {"Image": "image:tag", "ModelDataSource": source}}
    deployment = sm._start_serving("e", "c", model)
    model_dir = deployment.folder / "opt_ml" / "model"
    served = {p.relative_to(model_dir).as_posix(): p.read_text() for p in model_dir.rglob("*") if p.is_file()}
    assert served == MODEL_FILES

    evaluation = {
        **PROCESSING_REQUEST,
        "ProcessingJobName": "ev-t-serve",
        "AppSpecification": {"ImageUri": "image:tag", "ContainerEntrypoint": ["evaluate"]},
        "ProcessingInputs": [
            {
                "InputName": "model",
                "S3Input": {
                    "S3Uri": prefix,
                    "LocalPath": "/opt/ml/processing/model",
                    "S3DataType": "S3Prefix",
                    "S3InputMode": "File",
                },
            }
        ],
        "ProcessingOutputConfig": {
            "Outputs": [
                {
                    "OutputName": "evaluation",
                    "S3Output": {
                        "S3Uri": "s3://data/runs/run/evaluation/",
                        "LocalPath": "/opt/ml/processing/evaluation",
                        "S3UploadMode": "EndOfJob",
                    },
                }
            ]
        },
    }
    sm.run_processing_job(evaluation)
    status, fields = wait_for(lambda: recorder.final("ev-t-serve"), what="the evaluation job to end")
    assert status == "Completed", fields
    assert json.loads(_keys("runs/run/evaluation/")["files.json"]) == sorted(MODEL_FILES)


def test_start_serving_model_data_source_gzip_object_is_untarred(
    local_sagemaker: tuple[LocalSageMaker, Recorder],
) -> None:
    sm, recorder = local_sagemaker
    archive = _train(sm, recorder, "t-old", {"S3OutputPath": OUTPUT})

    source = {"S3DataSource": {"S3Uri": archive, "S3DataType": "S3Object", "CompressionType": "Gzip"}}
    model = {"ModelName": "m", "PrimaryContainer": {"Image": "image:tag", "ModelDataSource": source}}
    model_dir = sm._start_serving("e", "c", model).folder / "opt_ml" / "model"
    assert sorted(p.relative_to(model_dir).as_posix() for p in model_dir.rglob("*") if p.is_file()) == sorted(
        MODEL_FILES
    )


def _refusal(call: Any, **kwargs: Any) -> str:
    with pytest.raises(ClientError) as raised:
        call(**kwargs)
    assert raised.value.response["Error"]["Code"] == "ValidationException"
    return str(raised.value.response["Error"]["Message"])


def test_create_training_job_compression_outside_enum_is_refused(runtime: runtime_module.Runtime) -> None:
    request = {**TRAINING_REQUEST, "OutputDataConfig": {"S3OutputPath": OUTPUT, "CompressionType": "None"}}
    message = _refusal(client("sagemaker").create_training_job, **request)
    assert (
        "Value 'None' at 'outputDataConfig.compressionType' failed to satisfy constraint: "
        "Member must satisfy enum value set: [GZIP, NONE]"
    ) in message


def test_create_model_model_data_source_compression_outside_enum_is_refused(runtime: runtime_module.Runtime) -> None:
    # S3ModelDataSource spells it None | Gzip, OutputDataConfig GZIP | NONE: the training job's value does not fit.
    data = {"S3Uri": f"{OUTPUT}t/output/model/", "S3DataType": "S3Prefix", "CompressionType": "NONE"}
    source = {"S3DataSource": data}
    message = _refusal(
        client("sagemaker").create_model,
        ModelName="m",
        PrimaryContainer={"Image": "image:tag", "ModelDataSource": source},
        ExecutionRoleArn="arn:aws:iam::123456789012:role/sdflow",
    )
    assert "primaryContainer.modelDataSource.s3DataSource.compressionType" in message
    assert "[None, Gzip]" in message


def test_training_state_change_event_carries_uncompressed_prefix_and_compression(
    runtime: runtime_module.Runtime,
) -> None:
    sagemaker = client("sagemaker")
    queue_url = events_queue("SageMaker Training Job State Change")
    output = {"S3OutputPath": OUTPUT, "CompressionType": "NONE"}
    sagemaker.create_training_job(**{**TRAINING_REQUEST, "OutputDataConfig": output})
    prefix = f"{OUTPUT}sdf-tr-run-a0/output/model/"
    fields = {"ModelArtifacts": {"S3ModelArtifacts": prefix}}
    SageMakerStatusPublisher().job_status_changed("training", "sdf-tr-run-a0", "Completed", fields)

    described = sagemaker.describe_training_job(TrainingJobName="sdf-tr-run-a0")
    assert (described["ModelArtifacts"]["S3ModelArtifacts"], described["OutputDataConfig"]["CompressionType"]) == (
        prefix,
        "NONE",
    )
    details = wait_for(
        lambda: [e["detail"] for e in received(queue_url) if e["detail"]["TrainingJobStatus"] == "Completed"],
        what="the Completed event",
    )
    assert details[0]["ModelArtifacts"] == {"S3ModelArtifacts": prefix}
    assert details[0]["OutputDataConfig"]["CompressionType"] == "NONE"
