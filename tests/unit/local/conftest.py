"""Fixtures for the local cloud's service patches, in-process (mock_aws; no sockets).

Two kinds of test per patch:
- test_moto_gap_*: moto without the patch still behaves as the patch assumes. When one fails
  after a moto upgrade, moto changed: review (and maybe delete) the patch, then the test.
- test_patch_*: with the patch installed, the behaviour is AWS's.
Functions run for real in worker processes (sdflow.local.lambda_runner) from tiny handlers
written into tmp_path; SageMaker work goes to a recording fake of LocalSageMaker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from moto import mock_aws

from sdflow.local import patching
from sdflow.local import runtime as runtime_module
from sdflow.local.lambda_runner import LambdaRunner
from tests.constants import REGION
from tests.unit.local.helpers import HANDLERS, ROLE, FakeSageMaker, client, zip_files

CONFIG = {"stepfunctions": {"execute_state_machine": True}, "lambda": {"use_docker": False}}


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with mock_aws(config=CONFIG):
        trust = {
            "Statement": [
                {"Effect": "Allow", "Principal": {"Service": "lambda.amazonaws.com"}, "Action": "sts:AssumeRole"}
            ]
        }
        client("iam").create_role(RoleName="test", AssumeRolePolicyDocument=json.dumps(trust))
        yield


@pytest.fixture
def runtime(tmp_path: Path, aws: None) -> Iterator[runtime_module.Runtime]:
    runner = LambdaRunner("http://127.0.0.1:9", REGION, tmp_path / "logs", max_workers_per_function=2)
    rt = runtime_module.Runtime(
        workdir=tmp_path, lambda_runner=runner, sagemaker=FakeSageMaker(), async_retry_delays_s=()
    )
    with patching.patched(rt):
        yield rt
    runner.shutdown()


@pytest.fixture
def function_arn(tmp_path: Path, runtime: runtime_module.Runtime) -> str:
    """A deployed function whose code is the HANDLERS module, recording events in a file."""
    code = tmp_path / "fn"
    code.mkdir()
    (code / "app.py").write_text(HANDLERS)
    response = client("lambda").create_function(
        FunctionName="probe",
        Runtime="python3.11",
        Role=ROLE,
        Handler="app.lambda_handler",
        Code={"ZipFile": zip_files({"app.py": HANDLERS})},
        Timeout=3,
        Environment={"Variables": {"GREETING": "hello", "RECORD_FILE": str(tmp_path / "events.jsonl")}},
    )
    runtime.register_code("probe", code)
    return str(response["FunctionArn"])
