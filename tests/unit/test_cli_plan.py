"""`sdflow plan`: the execution name an upload would get, the plan in words and as JSON, exit 0 / 2. The stack's
Validate run environment comes from the local cloud in tests/e2e/test_cli_plan.py; here it is the template's
environment the unit tests give every function (conftest aws_env)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import boto3
import pytest

from sdflow import plan as plan_module
from sdflow.session import Session
from sdflow_common.start_pipeline import ManifestRef, execution_name
from tests.constants import REGION
from tests.unit.helpers import DATA_BUCKET, STATE_MACHINE_ARN, AwsWorld
from tests.unit.parquet_files import parquet_bytes


@pytest.fixture
def session(mocked_aws: AwsWorld, monkeypatch: pytest.MonkeyPatch) -> Session:
    mocked_aws.put_json("models/tiny-sd/model_index.json", {"_class_name": "StableDiffusionPipeline"})
    mocked_aws.s3.put_object(Bucket=DATA_BUCKET, Key="datasets/a.parquet", Body=parquet_bytes())
    # cmd_plan sets the stack's prefix in the environment, as the function has it: restored after the test.
    monkeypatch.setenv("ENDPOINT_NAME_PREFIX", "sdflow")
    stack = dict(os.environ)
    monkeypatch.setattr(plan_module, "stack_environment", lambda _session, _name=None: stack)
    return Session(
        client=lambda name, **options: boto3.client(name, region_name=REGION, **options),
        bucket=DATA_BUCKET,
        state_machine_arn=STATE_MACHINE_ARN,
        region=REGION,
    )


def manifest(tmp_path: Path, **changes: Any) -> Path:
    document = {
        "run_name": "plan-me",
        "dataset": {"parquet_uris": [f"s3://{DATA_BUCKET}/datasets/a.parquet"]},
        "base_model_uri": f"s3://{DATA_BUCKET}/models/tiny-sd/",
        **changes,
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(document))
    return path


def test_upload_name_is_the_name_start_pipeline_gives_the_uploaded_manifest(
    mocked_aws: AwsWorld, tmp_path: Path
) -> None:
    path = manifest(tmp_path)
    put = mocked_aws.s3.put_object(Bucket=DATA_BUCKET, Key="manifests/run.json", Body=path.read_bytes())
    uploaded = ManifestRef(DATA_BUCKET, "manifests/run.json", etag=put["ETag"].strip('"'))

    assert plan_module.upload_name(path, path.read_bytes(), DATA_BUCKET, "plan-me") == execution_name(
        uploaded, "plan-me"
    )


def test_cmd_plan_run_that_would_start_prints_choices_requests_memory_and_exits_0(
    session: Session, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = plan_module.cmd_plan(session, manifest(tmp_path), name=None, as_json=False, stack_name=None)

    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("Validate run would start run plan-me-")
    assert "family sd, full training on colossalai (plugin gemini, fp16)" in out
    assert "CreateTrainingJob" in out
    assert "ml.g5.12xlarge x 1" in out
    assert "training.instance_type" in out
    assert "fits" in out


def test_cmd_plan_refused_run_prints_every_refusal_as_json_and_exits_2(
    session: Session, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = manifest(tmp_path, endpoint={"name": "sdflow-x", "instance_type": "ml.c5.3xlarge"})

    code = plan_module.cmd_plan(session, path, name="my-run", as_json=True, stack_name=None)

    found = json.loads(capsys.readouterr().out)
    assert code == 2
    assert found["would_start"] is False
    assert found["execution_name"] == "my-run"
    assert {problem["field"] for problem in found["problems"]} == {"endpoint.instance_type"}
