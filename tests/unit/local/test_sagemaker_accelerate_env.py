"""The second image's job environment: a job or model whose image is the stack's AccelerateImageUri runs in
.venv-accelerate ($SDFLOW_ACCELERATE_PYTHON), any other in the job environment; a missing accelerate
environment fails that job alone, naming `make setup`."""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from sdflow.local.sagemaker import engine as sagemaker_module
from sdflow.local.sagemaker import job_env
from sdflow.local.sagemaker.engine import LocalSageMaker
from tests.constants import REGION
from tests.unit.local.helpers import TRAINING_REQUEST, fake_training_image, wait_for
from tests.unit.local.recorders import Recorder

S3_ENDPOINT = f"https://s3.{REGION}.amazonaws.com"
ACCELERATE_IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/sdflow-training:v0.1.0-accelerate"

# The container: writes the folder of the Python that runs it (the head of its PATH) into its model.
DUMP_PYTHON = """#!/usr/bin/env python3
import json, os, pathlib
root = pathlib.Path(os.environ["SDFLOW_OPT_ML"])
(root / "model").mkdir(parents=True, exist_ok=True)
(root / "model" / "python.json").write_text(json.dumps({"bin": os.environ["PATH"].split(os.pathsep)[0]}))
"""


@pytest.fixture
def local_sagemaker(
    aws: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[LocalSageMaker, Recorder]]:
    monkeypatch.setattr(sagemaker_module, "free_port", lambda: 65000)  # no socket in unit tests
    boto3.client("s3", region_name=REGION).create_bucket(Bucket="data")
    image = fake_training_image(tmp_path, {"train": DUMP_PYTHON})
    recorder = Recorder()
    sm = LocalSageMaker(
        tmp_path / "sm", S3_ENDPOINT, recorder, training_image_dir=image, python=sys.executable, stop_grace_s=0.5
    )
    sm.use_accelerate_image(ACCELERATE_IMAGE)
    yield sm, recorder
    sm.shutdown()


def accelerate_venv(root: Path) -> Path:
    """A stand-in .venv-accelerate: bin/python, a link to this interpreter."""
    python = root / "venv-accelerate" / "bin" / "python"
    python.parent.mkdir(parents=True)
    os.symlink(sys.executable, python)
    return python


def train(sm: LocalSageMaker, recorder: Recorder, name: str, image: str) -> tuple[str, dict[str, Any]]:
    request: dict[str, Any] = {**TRAINING_REQUEST, "TrainingJobName": name}
    request["AlgorithmSpecification"] = dict(request["AlgorithmSpecification"]) | {"TrainingImage": image}
    request["ResourceConfig"] = dict(request["ResourceConfig"]) | {"InstanceCount": 1}
    sm.run_training_job(request)
    ended: tuple[str, dict[str, Any]] = wait_for(lambda: recorder.final(name), what="the training job to end")
    return ended


def python_bin_of(fields: dict[str, Any]) -> str:
    bucket, key = fields["ModelArtifacts"]["S3ModelArtifacts"].removeprefix("s3://").split("/", 1)
    archive = boto3.client("s3", region_name=REGION).get_object(Bucket=bucket, Key=key)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        member = tar.extractfile("python.json")
        assert member is not None
        return str(json.loads(member.read())["bin"])


def test_accelerate_image_job_runs_in_the_accelerate_python(
    local_sagemaker: tuple[LocalSageMaker, Recorder], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sm, recorder = local_sagemaker
    python = accelerate_venv(tmp_path)
    monkeypatch.setenv(job_env.ACCELERATE_PYTHON_ENV, str(python))
    status, fields = train(sm, recorder, "t-accelerate", ACCELERATE_IMAGE)
    assert status == "Completed", fields
    assert python_bin_of(fields) == str(python.parent)


def test_first_image_job_runs_in_the_job_environment_without_looking_for_accelerate(
    local_sagemaker: tuple[LocalSageMaker, Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    sm, recorder = local_sagemaker
    monkeypatch.setenv(job_env.ACCELERATE_PYTHON_ENV, "/nonexistent/python")
    status, fields = train(sm, recorder, "t-first", "123456789012.dkr.ecr.us-east-1.amazonaws.com/sdflow:v0.1.0")
    assert status == "Completed", fields
    assert python_bin_of(fields) == str(Path(sys.executable).parent)


def test_accelerate_image_job_without_its_environment_fails_naming_make_setup(
    local_sagemaker: tuple[LocalSageMaker, Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    sm, recorder = local_sagemaker
    monkeypatch.setenv(job_env.ACCELERATE_PYTHON_ENV, "/nonexistent/python")
    status, fields = train(sm, recorder, "t-missing", ACCELERATE_IMAGE)
    assert status == "Failed"
    reason = fields["FailureReason"]
    assert reason.startswith("ClientError: image ")
    assert "make setup" in reason
    assert "SDFLOW_ACCELERATE_PYTHON=/nonexistent/python" in reason


def test_accelerate_python_default_is_the_repositorys_venv_accelerate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(job_env.ACCELERATE_PYTHON_ENV, raising=False)
    monkeypatch.setattr(job_env, "DEFAULT_ACCELERATE_VENV", Path("/nonexistent/.venv-accelerate"))
    with pytest.raises(job_env.JobEnvironmentMissing) as caught:
        job_env.accelerate_python()
    message = str(caught.value)
    assert "/nonexistent/.venv-accelerate/bin/python" in message
    assert "run `make setup`" in message
    assert "requirements-accelerate.txt" in message
