"""Fixtures for the local cloud's service patches, in-process (mock_aws; no sockets).

Two kinds of test per patch:
- test_moto_gap_*: moto without the patch still behaves as the patch assumes. When one fails
  after a moto upgrade, moto changed: review (and maybe delete) the patch, then the test.
- test_patch_*: with the patch installed, the behaviour is AWS's.
Functions run for real in worker processes (sdflow.local.lambda_runner) from tiny handlers
written into tmp_path; SageMaker work goes to a recording fake of LocalSageMaker."""

from __future__ import annotations

import io
import json
import stat
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws

from sdflow.local import patching
from sdflow.local import runtime as runtime_module
from sdflow.local.lambda_runner import LambdaRunner
from tests.conftest import wait_for

REGION = "us-east-1"
ACCOUNT = "123456789012"
CONFIG = {"stepfunctions": {"execute_state_machine": True}, "lambda": {"use_docker": False}}
ROLE = f"arn:aws:iam::{ACCOUNT}:role/test"

HANDLERS = '''
import json, os, time

class InvalidRunDocument(Exception):
    """Named like the pipeline's own errors, so Retry/Catch can match the class name."""

def lambda_handler(event, context):
    if event.get("record"):
        with open(os.environ["RECORD_FILE"], "a") as out:
            out.write(json.dumps(event) + "\\n")
    if event.get("fail"):
        raise InvalidRunDocument("dataset: is required")
    if event.get("sleep"):
        time.sleep(event["sleep"])
    return {
        "pid": os.getpid(),
        "greeting": os.environ.get("GREETING"),
        "endpoint": os.environ.get("AWS_ENDPOINT_URL"),
        "function": context.function_name,
        "remaining_ms": context.get_remaining_time_in_millis(),
        "leaked": os.environ.get("SDFLOW_TEST_PARENT_ONLY"),
    }
'''


def _client(service: str) -> Any:
    return boto3.client(service, region_name=REGION)


def _zip(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return buffer.getvalue()


def _wait_for(predicate: Callable[[], Any], what: str = "condition") -> Any:
    return wait_for(predicate, timeout_s=20.0, what=what, interval_s=0.05)


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


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
        _client("iam").create_role(RoleName="test", AssumeRolePolicyDocument=json.dumps(trust))
        yield


class FakeSageMaker:
    """Records what the patches hand to LocalSageMaker; runs nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def run_processing_job(self, request: dict[str, Any]) -> None:
        self.calls.append(("processing", request))

    def run_training_job(self, request: dict[str, Any]) -> None:
        self.calls.append(("training", request))

    def deploy_endpoint(self, endpoint_name: str, endpoint_config: dict[str, Any], model: dict[str, Any]) -> None:
        self.calls.append(("deploy", (endpoint_name, endpoint_config, model)))

    def invoke_endpoint(self, endpoint_name: str, body: bytes, content_type: str, accept: str) -> tuple[bytes, str]:
        self.calls.append(("invoke", (endpoint_name, body, content_type, accept)))
        return b"PNG:" + body, "image/png"

    def stop_job(self, kind: str, name: str) -> None:
        self.calls.append(("stop", (kind, name)))


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
    response = _client("lambda").create_function(
        FunctionName="probe",
        Runtime="python3.11",
        Role=ROLE,
        Handler="app.lambda_handler",
        Code={"ZipFile": _zip({"app.py": HANDLERS})},
        Timeout=3,
        Environment={"Variables": {"GREETING": "hello", "RECORD_FILE": str(tmp_path / "events.jsonl")}},
    )
    runtime.register_code("probe", code)
    return str(response["FunctionArn"])


# ------------------------------------------------------------------ shared by several service modules


def _lambda_model(name: str) -> Any:
    from moto.awslambda.utils import get_backend

    return get_backend(ACCOUNT, REGION).get_function(name)


def _rule_with_target(target: dict[str, Any], pattern: dict[str, Any]) -> None:
    events = _client("events")
    events.put_rule(Name="r", EventPattern=json.dumps(pattern))
    events.put_targets(Rule="r", Targets=[{"Id": "t", **target}])


def _stack(resources: dict[str, Any], outputs: dict[str, Any] | None = None) -> dict[str, str]:
    cfn = _client("cloudformation")
    template = {"AWSTemplateFormatVersion": "2010-09-09", "Resources": resources, "Outputs": outputs or {}}
    cfn.create_stack(StackName="s", TemplateBody=json.dumps(template), Capabilities=["CAPABILITY_IAM"])
    stack = cfn.describe_stacks(StackName="s")["Stacks"][0]
    return {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}


MACHINE = {
    "Type": "AWS::StepFunctions::StateMachine",
    "Properties": {
        "StateMachineName": "pipeline",
        "RoleArn": ROLE,
        "DefinitionString": json.dumps(
            {"StartAt": "P", "States": {"P": {"Type": "Pass", "Result": {"greeting": "${Greeting}"}, "End": True}}}
        ),
        "DefinitionSubstitutions": {"Greeting": "substituted"},
    },
}


MACHINE_ARN = f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:pipeline"


def _fail_waiting_task() -> dict[str, Any]:
    """A waitForTaskToken task (token handed over through SQS) failed with SendTaskFailure."""
    sfn, sqs = _client("stepfunctions"), _client("sqs")
    queue_url = sqs.create_queue(QueueName="tokens")["QueueUrl"]
    wait = {
        "Type": "Task",
        "Resource": "arn:aws:states:::sqs:sendMessage.waitForTaskToken",
        "Parameters": {"QueueUrl": queue_url, "MessageBody": {"token.$": "$$.Task.Token"}},
        "End": True,
    }
    definition = json.dumps({"StartAt": "Wait", "States": {"Wait": wait}})
    machine = sfn.create_state_machine(name="m", definition=definition, roleArn=ROLE)["stateMachineArn"]
    execution = sfn.start_execution(stateMachineArn=machine, name="x", input="{}")["executionArn"]
    message = _wait_for(lambda: sqs.receive_message(QueueUrl=queue_url).get("Messages"), what="the task token")
    token = json.loads(message[0]["Body"])["token"]
    sfn.send_task_failure(taskToken=token, error="DownloadJobFailed", cause="AlgorithmError: all URLs failed")
    return dict(
        _wait_for(
            lambda: (d := sfn.describe_execution(executionArn=execution))["status"] != "RUNNING" and d,
            what="the execution to fail",
        )
    )


PROCESSING_REQUEST = {
    "ProcessingJobName": "sdf-dl-run-00000-a0",
    "RoleArn": ROLE,
    "AppSpecification": {"ImageUri": "image:tag", "ContainerEntrypoint": ["download"]},
    "ProcessingResources": {
        "ClusterConfig": {"InstanceCount": 1, "InstanceType": "ml.m5.xlarge", "VolumeSizeInGB": 30}
    },
    "StoppingCondition": {"MaxRuntimeInSeconds": 3600},
}


TRAINING_REQUEST = {
    "TrainingJobName": "sdf-tr-run-a0",
    "RoleArn": ROLE,
    "AlgorithmSpecification": {
        "TrainingImage": "image:tag",
        "TrainingInputMode": "File",
        "MetricDefinitions": [{"Name": "train:loss", "Regex": "loss=([0-9.]+)"}],
    },
    "HyperParameters": {"max_train_steps": "10"},
    "OutputDataConfig": {"S3OutputPath": "s3://data/runs/run/training/"},
    "ResourceConfig": {"InstanceType": "ml.m5.xlarge", "InstanceCount": 2, "VolumeSizeInGB": 50},
    "StoppingCondition": {"MaxRuntimeInSeconds": 3600},
}


def _events_queue(detail_type: str) -> str:
    """An SQS queue receiving the SageMaker events of one detail type (moto's own SQS target)."""
    name = detail_type.replace(" ", "-")
    queue_url = str(_client("sqs").create_queue(QueueName=name)["QueueUrl"])
    events = _client("events")
    events.put_rule(Name=name, EventPattern=json.dumps({"source": ["aws.sagemaker"], "detail-type": [detail_type]}))
    events.put_targets(Rule=name, Targets=[{"Id": "q", "Arn": f"arn:aws:sqs:{REGION}:{ACCOUNT}:{name}"}])
    return queue_url


def _received(queue_url: str) -> list[dict[str, Any]]:
    messages = _client("sqs").receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10).get("Messages", [])
    return [json.loads(m["Body"]) for m in messages]


def fake_training_image(root: Path, scripts: dict[str, str]) -> Path:
    """A stand-in training_image folder: `bin/<entrypoint>` scripts with the given Python text."""
    image = root / "image"
    (image / "bin").mkdir(parents=True)
    for entrypoint, text in scripts.items():
        script = image / "bin" / entrypoint
        script.write_text(text)
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return image
