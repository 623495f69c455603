"""What a local job container finds in its environment to reach AWS: the local cloud's endpoint
(AWS_ENDPOINT_URL, read by boto3 itself) and the job role's credentials, as a SageMaker container gets
its role's. Training streams its shards from S3 and downloads write theirs, so both need them."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from sdflow.local.sagemaker import engine as sagemaker_module
from sdflow.local.sagemaker.engine import LocalSageMaker
from tests.constants import REGION
from tests.unit.local.helpers import TRAINING_REQUEST, fake_training_image, wait_for
from tests.unit.local.recorders import Recorder

S3_ENDPOINT = f"https://s3.{REGION}.amazonaws.com"
AWS_KEYS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")

# The container: writes the AWS variables it was given into its model.
DUMP_ENV = f"""#!/usr/bin/env python3
import json, os, pathlib
root = pathlib.Path(os.environ["SDFLOW_OPT_ML"])
(root / "model").mkdir(parents=True, exist_ok=True)
(root / "model" / "env.json").write_text(json.dumps({{k: os.environ.get(k) for k in {AWS_KEYS!r}}}))
"""


@pytest.fixture
def local_sagemaker(
    aws: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[LocalSageMaker, Recorder]]:
    monkeypatch.setattr(sagemaker_module, "free_port", lambda: 65000)  # no socket in unit tests
    boto3.client("s3", region_name=REGION).create_bucket(Bucket="data")
    image = fake_training_image(tmp_path, {"train": DUMP_ENV})
    recorder = Recorder()
    sm = LocalSageMaker(tmp_path / "sm", S3_ENDPOINT, recorder, training_image_dir=image, stop_grace_s=0.5)
    yield sm, recorder
    sm.shutdown()


def _container_env(sm: LocalSageMaker, recorder: Recorder, name: str) -> dict[str, Any]:
    request: dict[str, Any] = {**TRAINING_REQUEST, "TrainingJobName": name}
    request["ResourceConfig"] = dict(request["ResourceConfig"]) | {"InstanceCount": 1}
    sm.run_training_job(request)
    status, fields = wait_for(lambda: recorder.final(name), what="the training job to end")
    assert status == "Completed", fields
    bucket, key = fields["ModelArtifacts"]["S3ModelArtifacts"].removeprefix("s3://").split("/", 1)
    archive = boto3.client("s3", region_name=REGION).get_object(Bucket=bucket, Key=key)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        member = tar.extractfile("env.json")
        assert member is not None
        env: dict[str, Any] = json.loads(member.read())
    return env


def test_job_environment_without_iam_has_endpoint_and_testing_keys(
    local_sagemaker: tuple[LocalSageMaker, Recorder],
) -> None:
    sm, recorder = local_sagemaker
    assert _container_env(sm, recorder, "t-env") == {
        "AWS_ENDPOINT_URL": S3_ENDPOINT,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
    }


def test_job_environment_with_iam_has_the_job_roles_credentials(
    local_sagemaker: tuple[LocalSageMaker, Recorder],
) -> None:
    sm, recorder = local_sagemaker
    asked: list[str] = []

    def role_credentials(role_arn: str) -> dict[str, str]:
        asked.append(role_arn)
        return {"AWS_ACCESS_KEY_ID": "ASIAROLE", "AWS_SECRET_ACCESS_KEY": "secret", "AWS_SESSION_TOKEN": "token"}

    sm.role_credentials = role_credentials
    env = _container_env(sm, recorder, "t-env-role")
    assert env == {
        "AWS_ENDPOINT_URL": S3_ENDPOINT,
        "AWS_ACCESS_KEY_ID": "ASIAROLE",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_SESSION_TOKEN": "token",
    }
    assert TRAINING_REQUEST["RoleArn"] in asked
