"""The pipeline's intake in moto: the real state machine, the real validate_run and notify handlers.

Every other task's function is a recorder that answers `{}`: intake must never reach it. The
notify handler gets the execution's "Step Functions Execution Status Change" event, as the
template's rule delivers it, once the execution has ended. What is under test is what a user
sees after StartExecution with any input: the execution's end, the notification that reached the
topic, and that no job was started."""

from __future__ import annotations

import json
import re
import tempfile
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

from sdflow.local import patching
from sdflow.local.clock import Clock
from sdflow.local.lambda_runner import InvocationResult
from sdflow.local.runtime import Runtime
from sdflow_common import aws
from tests.constants import ACCOUNT, REGION, TIME_SCALE
from tests.helpers import load_function_module
from tests.unit.helpers import DATA_BUCKET, IDEMPOTENCY_TABLE, TOKEN_TABLE, FakeLambdaContext, create_table

ASL = Path(__file__).resolve().parents[2] / "statemachines" / "pipeline.asl.json"
REAL_HANDLERS = {"ValidateRunFunction": "validate_run", "NotifyFunction": "notify"}
STATUS_CHANGE = "Step Functions Execution Status Change"


def pipeline_definition() -> tuple[str, list[str]]:
    """The real definition as written (its Retry intervals play out on a scaled clock: the
    runtimes here run on Clock(scale=TIME_SCALE)), its ARNs substituted, and its functions."""
    text = ASL.read_text()
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
        """The execution's end, after its status event reached the notify handler (the rule's target)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            description = self.sfn.describe_execution(executionArn=execution_arn)
            if description["status"] != "RUNNING":
                self.deliver_status_event(dict(description))
                return dict(description)
            time.sleep(0.02)
        raise AssertionError(f"execution still running after {timeout} s")

    def deliver_status_event(self, description: dict[str, Any]) -> Any:
        """What EventBridge hands the notify function for this execution's end."""
        detail = {
            "executionArn": description["executionArn"],
            "stateMachineArn": description["stateMachineArn"],
            "name": description["name"],
            "status": description["status"],
            "startDate": int(description["startDate"].timestamp() * 1000),
            "stopDate": int(description["stopDate"].timestamp() * 1000),
            "input": description.get("input"),
            "output": description.get("output"),
            "inputDetails": {"included": True},
            "outputDetails": {"included": True} if "output" in description else None,
            "error": description.get("error"),
            "cause": description.get("cause"),
            "redriveCount": description.get("redriveCount", 0),
        }
        event = {
            "version": "0",
            "id": f"event-{time.monotonic_ns()}",
            "detail-type": STATUS_CHANGE,
            "source": "aws.states",
            "account": ACCOUNT,
            "time": description["stopDate"].strftime("%Y-%m-%dT%H:%M:%SZ"),
            "region": REGION,
            "resources": [description["executionArn"]],
            "detail": detail,
        }
        with self.lock:
            self.calls["NotifyFunction"].append(event)
        handler = _handler_for("NotifyFunction")
        assert handler is not None
        return handler(event, FakeLambdaContext(function_name="NotifyFunction"))

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


class InProcessRunner:
    """Stands in for sdflow.local.lambda_runner.LambdaRunner: the patched Lambda service hands each
    invocation here and `handle(function name, payload)` answers it in this process. An exception
    becomes Lambda's error payload, its `error_type` attribute (or class name) the errorType that
    Retry and Catch match, as the Lambda runtime reports an unhandled exception."""

    def __init__(self, handle: Callable[[str, dict[str, Any]], Any]) -> None:
        self.handle = handle

    def invoke(self, spec: Any, event: bytes | str, request_id: str | None = None) -> InvocationResult:
        text = event.decode() if isinstance(event, bytes) else event
        try:
            result = self.handle(spec.name, json.loads(text) if text else {})
        except Exception as exc:
            error_type = getattr(exc, "error_type", type(exc).__name__)
            body = json.dumps({"errorMessage": str(exc), "errorType": error_type}).encode()
            return InvocationResult(body, "Unhandled")
        return InvocationResult(json.dumps(result).encode())

    def shutdown(self) -> None:
        """Nothing runs in the background."""


def _answer_with_real_handlers(intake: Intake) -> Callable[[str, dict[str, Any]], Any]:
    """Validate run and notify run for real; any other function records its payload and answers {}."""

    def handle(name: str, payload: dict[str, Any]) -> Any:
        with intake.lock:
            intake.calls[name].append(payload)
        handler = _handler_for(name)
        return {} if handler is None else handler(payload, FakeLambdaContext(function_name=name))

    return handle


@contextmanager
def intake_cloud(monkeypatch: pytest.MonkeyPatch) -> Iterator[Intake]:
    """moto with state machine execution on; the caller has set the functions' environment (aws_env)."""
    config = {"stepfunctions": {"execute_state_machine": True}, "lambda": {"use_docker": False}}
    with mock_aws(config=config):
        aws.reset_clients()
        s3 = boto3.client("s3", region_name=REGION)
        s3.create_bucket(Bucket=DATA_BUCKET)
        create_table(IDEMPOTENCY_TABLE, "id")
        create_table(TOKEN_TABLE, "resource_name")
        sns = boto3.client("sns", region_name=REGION)
        topic_arn = sns.create_topic(Name="sdflow-notifications-test")["TopicArn"]
        monkeypatch.setenv("TOPIC_ARN", topic_arn)
        sqs = boto3.client("sqs", region_name=REGION)
        inbox_url = sqs.create_queue(QueueName="inbox")["QueueUrl"]
        inbox_arn = sqs.get_queue_attributes(QueueUrl=inbox_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        sns.subscribe(TopicArn=topic_arn, Protocol="sqs", Endpoint=inbox_arn)

        iam = boto3.client("iam", region_name=REGION)
        role = iam.create_role(RoleName="fn", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
        text, functions = pipeline_definition()
        sfn = boto3.client("stepfunctions", region_name=REGION)
        intake = Intake(
            sfn=sfn,
            s3=s3,
            sqs=sqs,
            sagemaker=boto3.client("sagemaker", region_name=REGION),
            arn="",
            inbox_url=inbox_url,
        )
        # The definition runs on the local cloud's Step Functions (as under `sdflow local up`);
        # the functions run in this process.
        with tempfile.TemporaryDirectory() as workdir:
            runtime = Runtime(
                workdir=Path(workdir),
                lambda_runner=InProcessRunner(_answer_with_real_handlers(intake)),  # type: ignore[arg-type]
                async_retry_delays_s=(),
                clock=Clock(scale=TIME_SCALE),
            )
            with patching.patched(runtime):
                awslambda = boto3.client("lambda", region_name=REGION)
                for name in functions:
                    awslambda.create_function(
                        FunctionName=name,
                        Runtime="python3.11",
                        Role=role,
                        Handler="app.lambda_handler",
                        Code={"ZipFile": b"x"},
                    )
                    runtime.register_code(name, Path(workdir))
                intake.arn = sfn.create_state_machine(name="sdflow-intake-test", definition=text, roleArn=role)[
                    "stateMachineArn"
                ]
                yield intake
        aws.reset_clients()
