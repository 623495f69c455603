"""What the local cloud's patch tests share besides fixtures: a probe function, clients, waits, requests, stacks."""

from __future__ import annotations

import io
import json
import stat
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3

from tests import helpers as shared
from tests.constants import ACCOUNT, REGION

ROLE = f"arn:aws:iam::{ACCOUNT}:role/test"

# The probe function's module (conftest.py `function_arn` deploys it): records, fails or sleeps when asked.
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
        "now": time.time(),
        "leaked": os.environ.get("SDFLOW_TEST_PARENT_ONLY"),
    }
'''


def client(service: str) -> Any:
    return boto3.client(service, region_name=REGION)


def zip_files(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return buffer.getvalue()


def wait_for(predicate: Callable[[], Any], what: str = "condition") -> Any:
    """tests.helpers.wait_for with these tests' timeout (20 s) and polling interval."""
    return shared.wait_for(predicate, timeout_s=20.0, what=what, interval_s=0.05)


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


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


def lambda_model(name: str) -> Any:
    from moto.awslambda.utils import get_backend

    return get_backend(ACCOUNT, REGION).get_function(name)


def rule_with_target(target: dict[str, Any], pattern: dict[str, Any]) -> None:
    events = client("events")
    events.put_rule(Name="r", EventPattern=json.dumps(pattern))
    events.put_targets(Rule="r", Targets=[{"Id": "t", **target}])


def stack(resources: dict[str, Any], outputs: dict[str, Any] | None = None) -> dict[str, str]:
    cfn = client("cloudformation")
    template = {"AWSTemplateFormatVersion": "2010-09-09", "Resources": resources, "Outputs": outputs or {}}
    cfn.create_stack(StackName="s", TemplateBody=json.dumps(template), Capabilities=["CAPABILITY_IAM"])
    described = cfn.describe_stacks(StackName="s")["Stacks"][0]
    return {o["OutputKey"]: o["OutputValue"] for o in described.get("Outputs", [])}


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


def start_waiting_task() -> tuple[str, str]:
    """An execution whose one state is a waitForTaskToken task, the token handed over through SQS:
    (execution ARN, task token) once the task waits."""
    sfn, sqs = client("stepfunctions"), client("sqs")
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
    message = wait_for(lambda: sqs.receive_message(QueueUrl=queue_url).get("Messages"), what="the task token")
    return execution, json.loads(message[0]["Body"])["token"]


def fail_waiting_task() -> dict[str, Any]:
    """A waitForTaskToken task (token handed over through SQS) failed with SendTaskFailure."""
    sfn = client("stepfunctions")
    execution, token = start_waiting_task()
    sfn.send_task_failure(taskToken=token, error="DownloadJobFailed", cause="AlgorithmError: all URLs failed")
    return dict(
        wait_for(
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


def events_queue(detail_type: str) -> str:
    """An SQS queue receiving the SageMaker events of one detail type (moto's own SQS target)."""
    name = detail_type.replace(" ", "-")
    queue_url = str(client("sqs").create_queue(QueueName=name)["QueueUrl"])
    events = client("events")
    events.put_rule(Name=name, EventPattern=json.dumps({"source": ["aws.sagemaker"], "detail-type": [detail_type]}))
    events.put_targets(Rule=name, Targets=[{"Id": "q", "Arn": f"arn:aws:sqs:{REGION}:{ACCOUNT}:{name}"}])
    return queue_url


def received(queue_url: str) -> list[dict[str, Any]]:
    messages = client("sqs").receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10).get("Messages", [])
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
