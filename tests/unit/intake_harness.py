"""The pipeline's intake in moto: the real state machine, the real validate_run and notify handlers.

Every other task's function is a recorder that answers `{}`: intake must never reach it. What is
under test is what a user sees after StartExecution with any input: the execution's end, the
notification that reached the topic, and that no job was started."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws
from moto.awslambda_simple.models import LambdaSimpleBackend

from sdflow_common import aws
from tests.conftest import load_function_module
from tests.unit.conftest import ACCOUNT, DATA_BUCKET, IDEMPOTENCY_TABLE, REGION, FakeLambdaContext, create_table

ASL = Path(__file__).resolve().parents[2] / "statemachines" / "pipeline.asl.json"
REAL_HANDLERS = {"ValidateRunFunction": "validate_run", "NotifyFunction": "notify"}


def definition_for_tests() -> tuple[str, list[str]]:
    """The real definition, retry waits cut to one second (moto really sleeps), and its functions."""
    definition = json.loads(ASL.read_text())

    def shrink(node: Any) -> None:
        if isinstance(node, dict):
            for retrier in node.get("Retry", []):
                retrier["IntervalSeconds"] = 1
                retrier["BackoffRate"] = 1
                retrier.pop("MaxDelaySeconds", None)
                retrier.pop("JitterStrategy", None)
            for value in node.values():
                shrink(value)
        elif isinstance(node, list):
            for value in node:
                shrink(value)

    shrink(definition)
    text = json.dumps(definition)
    functions = sorted(set(re.findall(r"\$\{(\w+Function)Arn\}", text)))
    for name in functions:
        text = text.replace(f"${{{name}Arn}}", f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:{name}")
    text = re.sub(r"\$\{\w*Bucket\w*\}", DATA_BUCKET, text)
    leftover = re.findall(r"\$\{\w+\}", text)
    assert not leftover, f"DefinitionSubstitutions this harness does not know: {leftover}"
    return text, functions


@dataclass
class Intake:
    sfn: Any
    s3: Any
    sqs: Any
    sagemaker: Any
    arn: str
    inbox_url: str
    calls: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, raw_input: str) -> str:
        return str(
            self.sfn.start_execution(stateMachineArn=self.arn, name=f"run-{time.monotonic_ns()}", input=raw_input)[
                "executionArn"
            ]
        )

    def wait(self, execution_arn: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            description = self.sfn.describe_execution(executionArn=execution_arn)
            if description["status"] != "RUNNING":
                return dict(description)
            time.sleep(0.02)
        raise AssertionError(f"execution still running after {timeout} s")

    def notifications(self) -> list[dict[str, Any]]:
        """SNS envelopes that reached the topic since the last call."""
        out: list[dict[str, Any]] = []
        while True:
            batch = self.sqs.receive_message(QueueUrl=self.inbox_url, MaxNumberOfMessages=10).get("Messages", [])
            if not batch:
                return out
            for message in batch:
                out.append(json.loads(message["Body"]))
                self.sqs.delete_message(QueueUrl=self.inbox_url, ReceiptHandle=message["ReceiptHandle"])

    def jobs(self) -> list[str]:
        processing = self.sagemaker.list_processing_jobs()["ProcessingJobSummaries"]
        training = self.sagemaker.list_training_jobs()["TrainingJobSummaries"]
        endpoints = self.sagemaker.list_endpoints()["Endpoints"]
        return [
            *(job["ProcessingJobName"] for job in processing),
            *(job["TrainingJobName"] for job in training),
            *(endpoint["EndpointName"] for endpoint in endpoints),
        ]

    def other_calls(self) -> dict[str, int]:
        with self.lock:
            return {name: len(calls) for name, calls in self.calls.items() if name not in REAL_HANDLERS and calls}


def _handler_for(name: str) -> Callable[[dict[str, Any], Any], Any] | None:
    purpose = REAL_HANDLERS.get(name)
    return load_function_module(purpose).lambda_handler if purpose else None


@contextmanager
def intake_cloud(monkeypatch: pytest.MonkeyPatch) -> Iterator[Intake]:
    """moto with state machine execution on; the caller has set the functions' environment (aws_env)."""
    config = {"stepfunctions": {"execute_state_machine": True}, "lambda": {"use_docker": False}}
    with mock_aws(config=config):
        aws.reset_clients()
        s3 = boto3.client("s3", region_name=REGION)
        s3.create_bucket(Bucket=DATA_BUCKET)
        create_table(IDEMPOTENCY_TABLE, "id")
        sns = boto3.client("sns", region_name=REGION)
        topic_arn = sns.create_topic(Name="sdflow-notifications-test")["TopicArn"]
        monkeypatch.setenv("TOPIC_ARN", topic_arn)
        sqs = boto3.client("sqs", region_name=REGION)
        inbox_url = sqs.create_queue(QueueName="inbox")["QueueUrl"]
        inbox_arn = sqs.get_queue_attributes(QueueUrl=inbox_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        sns.subscribe(TopicArn=topic_arn, Protocol="sqs", Endpoint=inbox_arn)

        iam = boto3.client("iam", region_name=REGION)
        role = iam.create_role(RoleName="fn", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
        text, functions = definition_for_tests()
        awslambda = boto3.client("lambda", region_name=REGION)
        for name in functions:
            awslambda.create_function(
                FunctionName=name, Runtime="python3.11", Role=role, Handler="app.lambda_handler", Code={"ZipFile": b"x"}
            )
        sfn = boto3.client("stepfunctions", region_name=REGION)
        arn = sfn.create_state_machine(name="sdflow-intake-test", definition=text, roleArn=role)["stateMachineArn"]
        intake = Intake(
            sfn=sfn,
            s3=s3,
            sqs=sqs,
            sagemaker=boto3.client("sagemaker", region_name=REGION),
            arn=arn,
            inbox_url=inbox_url,
        )
        handlers = {name: _handler_for(name) for name in functions}

        def invoke(
            backend: Any, function_name: str, qualifier: Any, body: Any, headers: Any, response_headers: Any
        ) -> bytes:
            name = function_name.split(":")[-1]
            payload = json.loads(body.decode() if isinstance(body, bytes) else body)
            with intake.lock:
                intake.calls[name].append(payload)
            handler = handlers[name]
            if handler is None:
                return b"{}"
            try:
                result = handler(payload, FakeLambdaContext(function_name=name))
            except Exception as exc:  # what the Lambda runtime does with any unhandled exception
                response_headers["x-amz-function-error"] = "Unhandled"
                return json.dumps({"errorMessage": str(exc), "errorType": type(exc).__name__}).encode()
            return json.dumps(result).encode()

        monkeypatch.setattr(LambdaSimpleBackend, "invoke", invoke)
        yield intake
        aws.reset_clients()
