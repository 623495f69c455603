"""sdflow.local.patches against the pinned moto, in-process (mock_aws; no sockets).

Two kinds of test per patch:
- test_moto_gap_*: moto without the patch still behaves as the patch assumes. When one fails
  after a moto upgrade, moto changed: review (and maybe delete) the patch, then the test.
- test_patch_*: with the patch installed, the behaviour is AWS's.
Functions run for real in worker processes (sdflow.local.lambda_runner) from tiny handlers
written into tmp_path; SageMaker work goes to a recording fake of LocalSageMaker."""

from __future__ import annotations

import io
import json
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import moto
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws

from sdflow.local import patches
from sdflow.local.lambda_runner import FunctionSpec, LambdaRunner
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
def runtime(tmp_path: Path, aws: None) -> Iterator[patches.Runtime]:
    runner = LambdaRunner("http://127.0.0.1:9", REGION, tmp_path / "logs", max_workers_per_function=2)
    rt = patches.Runtime(workdir=tmp_path, lambda_runner=runner, sagemaker=FakeSageMaker(), async_retry_delays_s=())
    with patches.patched(rt):
        yield rt
    runner.shutdown()


@pytest.fixture
def function_arn(tmp_path: Path, runtime: patches.Runtime) -> str:
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


# ------------------------------------------------------------------------------------ pinned moto


def test_moto_gap_pinned_version_is_the_one_the_patches_were_written_for() -> None:
    assert moto.__version__ == patches.MOTO_VERSION


# ------------------------------------------------------------------------------------ (a) Lambda


def test_moto_gap_simple_lambda_backend_echoes_instead_of_running_the_handler(aws: None) -> None:
    _client("lambda").create_function(
        FunctionName="echo",
        Runtime="python3.11",
        Role=ROLE,
        Handler="app.lambda_handler",
        Code={"ZipFile": _zip({"app.py": "def lambda_handler(e, c):\n    raise RuntimeError('never runs')\n"})},
    )
    response = _client("lambda").invoke(FunctionName="echo", Payload=b'{"a": 1}')
    assert "FunctionError" not in response
    assert response["Payload"].read() == b'{"a": 1}'


def test_patch_lambda_invoke_runs_handler_with_function_env_only(
    function_arn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SDFLOW_TEST_PARENT_ONLY", "must not leak")
    first = json.loads(_client("lambda").invoke(FunctionName=function_arn, Payload=b"{}")["Payload"].read())
    second = json.loads(_client("lambda").invoke(FunctionName="probe", Payload=b"{}")["Payload"].read())
    assert first["greeting"] == "hello"
    assert first["endpoint"] == "http://127.0.0.1:9"
    assert first["function"] == "probe"
    assert first["leaked"] is None
    assert 0 < first["remaining_ms"] <= 3000
    assert second["pid"] == first["pid"], "a warm worker is reused"


def test_patch_lambda_invoke_unhandled_exception_becomes_lambda_error_payload(function_arn: str) -> None:
    response = _client("lambda").invoke(FunctionName=function_arn, Payload=b'{"fail": true}')
    body = json.loads(response["Payload"].read())
    assert response["FunctionError"] == "Unhandled"
    assert body["errorType"] == "InvalidRunDocument"
    assert body["errorMessage"] == "dataset: is required"
    assert any("app.py" in frame for frame in body["stackTrace"])


def test_patch_lambda_invoke_past_timeout_kills_worker_as_sandbox_timedout(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(HANDLERS)
    runner = LambdaRunner("http://127.0.0.1:9", REGION, tmp_path / "logs")
    spec = FunctionSpec("slow", "arn:aws:lambda:us-east-1:1:function:slow", "app.lambda_handler", tmp_path, timeout_s=1)
    try:
        started = time.monotonic()
        result = runner.invoke(spec, json.dumps({"sleep": 30}))
        elapsed = time.monotonic() - started
        after = runner.invoke(spec, "{}")
    finally:
        runner.shutdown()
    assert result.function_error == "Unhandled"
    assert result.error_type == "Sandbox.Timedout"
    assert "Task timed out after 1.00 seconds" in json.loads(result.payload)["errorMessage"]
    assert elapsed < 10
    assert after.function_error is None, "the next invocation starts a fresh worker"


def test_patch_lambda_invoke_event_type_runs_in_background(function_arn: str, tmp_path: Path) -> None:
    response = _client("lambda").invoke(
        FunctionName=function_arn, InvocationType="Event", Payload=json.dumps({"record": True, "sleep": 0.5})
    )
    assert response["StatusCode"] == 202
    assert not _records(tmp_path / "events.jsonl"), "the call returned before the handler finished"
    _wait_for(lambda: _records(tmp_path / "events.jsonl"), what="the asynchronous invocation")


def test_patch_lambda_async_failure_goes_to_dead_letter_queue(
    runtime: patches.Runtime, function_arn: str, tmp_path: Path
) -> None:
    queue_url = _client("sqs").create_queue(QueueName="dlq")["QueueUrl"]
    fn = _lambda_model("probe")
    fn.dead_letter_config = {"TargetArn": f"arn:aws:sqs:{REGION}:{ACCOUNT}:dlq"}
    _client("lambda").invoke(FunctionName=function_arn, InvocationType="Event", Payload=b'{"fail": true}')
    assert runtime.wait_idle(20)
    messages = _client("sqs").receive_message(QueueUrl=queue_url, MessageAttributeNames=["All"])["Messages"]
    assert json.loads(messages[0]["Body"]) == {"fail": True}
    assert messages[0]["MessageAttributes"]["ErrorMessage"]["StringValue"] == "dataset: is required"


def _lambda_model(name: str) -> Any:
    from moto.awslambda.utils import get_backend

    return get_backend(ACCOUNT, REGION).get_function(name)


# ------------------------------------------------------------------------------------ (b) EventBridge


def _rule_with_target(target: dict[str, Any], pattern: dict[str, Any]) -> None:
    events = _client("events")
    events.put_rule(Name="r", EventPattern=json.dumps(pattern))
    events.put_targets(Rule="r", Targets=[{"Id": "t", **target}])


def test_moto_gap_rule_cannot_deliver_to_lambda_or_state_machine(aws: None) -> None:
    _rule_with_target({"Arn": f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:x"}, {"source": ["demo"]})
    from moto.events.models import events_backends

    rule = events_backends[ACCOUNT][REGION].event_buses["default"].rules["r"]
    event = {"source": "demo", "detail-type": "d", "detail": {}, "time": time.time(), "ingestion-time": time.time()}
    with pytest.raises(NotImplementedError):
        rule.send_to_targets(event, transform_input=False)  # as S3's notifications call it


def test_moto_gap_s3_eventbridge_event_spells_etag_differently(aws: None) -> None:
    s3 = _client("s3")
    s3.create_bucket(Bucket="bucket-b")
    s3.put_bucket_notification_configuration(
        Bucket="bucket-b", NotificationConfiguration={"EventBridgeConfiguration": {}}
    )
    queue_url = _client("sqs").create_queue(QueueName="q")["QueueUrl"]
    _rule_with_target({"Arn": f"arn:aws:sqs:{REGION}:{ACCOUNT}:q"}, {"source": ["aws.s3"]})
    s3.put_object(Bucket="bucket-b", Key="manifests/run.json", Body=b"{}")
    event = json.loads(_client("sqs").receive_message(QueueUrl=queue_url)["Messages"][0]["Body"])
    assert event["detail-type"] == "Object Created"
    assert "eTag" in event["detail"]["object"]
    assert "etag" not in event["detail"]["object"]


def test_patch_rule_delivers_s3_object_created_to_lambda_aws_shaped(function_arn: str, tmp_path: Path) -> None:
    s3 = _client("s3")
    s3.create_bucket(Bucket="bucket-b")
    s3.put_bucket_notification_configuration(
        Bucket="bucket-b", NotificationConfiguration={"EventBridgeConfiguration": {}}
    )
    pattern = {
        "source": ["aws.s3"],
        "detail-type": ["Object Created"],
        "detail": {"bucket": {"name": ["bucket-b"]}, "object": {"key": [{"wildcard": "manifests/*.json"}]}},
    }
    transformer = {
        "InputPathsMap": {"key": "$.detail.object.key", "etag": "$.detail.object.etag", "time": "$.time"},
        "InputTemplate": '{"record": true, "key": <key>, "etag": <etag>, "time": <time>}',
    }
    _rule_with_target({"Arn": function_arn, "InputTransformer": transformer}, pattern)
    s3.put_object(Bucket="bucket-b", Key="other/ignored.json", Body=b"{}")
    etag = s3.put_object(Bucket="bucket-b", Key="manifests/run.json", Body=b"{}")["ETag"].strip('"')
    [event] = _wait_for(lambda: _records(tmp_path / "events.jsonl"), what="the rule's Lambda delivery")
    assert event["key"] == "manifests/run.json"
    assert event["etag"] == etag
    assert event["time"].endswith("Z")


def test_patch_input_transformer_quotes_bare_strings_and_keeps_text_inside_strings() -> None:
    event = {"time": "2026-01-01T00:00:00Z", "detail": {"name": "job-1", "size": 3, "tags": ["a"]}}
    rendered = patches.apply_input_transformer(
        '{"name": <name>, "size": <size>, "tags": <tags>, "text": "job <name> has \\"<size>\\" items"}',
        {"name": "$.detail.name", "size": "$.detail.size", "tags": "$.detail.tags"},
        event,
    )
    assert rendered == {"name": "job-1", "size": 3, "tags": ["a"], "text": 'job job-1 has "3" items'}
    assert patches.apply_input_transformer("job <name> ended", {"name": "$.detail.name"}, event) == "job job-1 ended"


def test_patch_rule_starts_state_machine_with_constant_input(runtime: patches.Runtime) -> None:
    sfn = _client("stepfunctions")
    machine = sfn.create_state_machine(
        name="m", definition=json.dumps({"StartAt": "P", "States": {"P": {"Type": "Pass", "End": True}}}), roleArn=ROLE
    )["stateMachineArn"]
    _rule_with_target({"Arn": machine, "Input": '{"from": "rule"}'}, {"source": ["demo"], "detail": {"n": [1]}})
    _client("events").put_events(
        Entries=[
            {"Source": "demo", "DetailType": "d", "Detail": json.dumps({"n": 2})},
            {"Source": "demo", "DetailType": "d", "Detail": json.dumps({"n": 1})},
        ]
    )
    [execution] = sfn.list_executions(stateMachineArn=machine)["executions"]
    assert json.loads(sfn.describe_execution(executionArn=execution["executionArn"])["input"]) == {"from": "rule"}


# ------------------------------------------------------------------------------------ (c) CloudFormation


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


def test_moto_gap_cloudformation_state_machine_invisible_to_executing_backend(aws: None) -> None:
    _stack({"Machine": MACHINE})
    with pytest.raises(ClientError, match="StateMachineDoesNotExist"):
        _client("stepfunctions").describe_state_machine(stateMachineArn=MACHINE_ARN)


def test_patch_cloudformation_state_machine_executes_with_substitutions(runtime: patches.Runtime) -> None:
    _stack({"Machine": MACHINE})
    sfn = _client("stepfunctions")
    execution = sfn.start_execution(stateMachineArn=MACHINE_ARN, input="{}")["executionArn"]
    done = _wait_for(
        lambda: (d := sfn.describe_execution(executionArn=execution))["status"] != "RUNNING" and d,
        what="the execution",
    )
    assert done["status"] == "SUCCEEDED"
    assert json.loads(done["output"]) == {"greeting": "substituted"}


def test_patch_cloudformation_state_machine_reads_definition_s3_location(runtime: patches.Runtime) -> None:
    s3 = _client("s3")
    s3.create_bucket(Bucket="artifacts")
    definition = MACHINE["Properties"]["DefinitionString"]
    s3.put_object(Bucket="artifacts", Key="sm.json", Body=definition.encode())
    properties = {k: v for k, v in MACHINE["Properties"].items() if k != "DefinitionString"}
    machine = {
        **MACHINE,
        "Properties": {**properties, "DefinitionS3Location": {"Bucket": "artifacts", "Key": "sm.json"}},
    }
    _stack({"Machine": machine})
    described = _client("stepfunctions").describe_state_machine(stateMachineArn=MACHINE_ARN)
    assert "substituted" in described["definition"]


BUCKET = {
    "Type": "AWS::S3::Bucket",
    "Properties": {
        "BucketName": "data",
        "NotificationConfiguration": {"EventBridgeConfiguration": {"EventBridgeEnabled": True}},
        "VersioningConfiguration": {"Status": "Enabled"},
    },
}


def _upload_events_seen() -> list[dict[str, Any]]:
    """Upload to the CloudFormation bucket; the S3 events an SQS-targeted rule then receives."""
    queue_url = _client("sqs").create_queue(QueueName="s3-events")["QueueUrl"]
    _rule_with_target({"Arn": f"arn:aws:sqs:{REGION}:{ACCOUNT}:s3-events"}, {"source": ["aws.s3"]})
    _client("s3").put_object(Bucket="data", Key="manifests/run.json", Body=b"{}")
    return [json.loads(m["Body"]) for m in _client("sqs").receive_message(QueueUrl=queue_url).get("Messages", [])]


def test_moto_gap_cloudformation_bucket_drops_eventbridge_and_versioning(aws: None) -> None:
    _stack({"Bucket": BUCKET})
    assert "Status" not in _client("s3").get_bucket_versioning(Bucket="data")
    assert _upload_events_seen() == []


def test_patch_cloudformation_bucket_honours_eventbridge_and_versioning(runtime: patches.Runtime) -> None:
    _stack({"Bucket": BUCKET})
    assert _client("s3").get_bucket_versioning(Bucket="data")["Status"] == "Enabled"
    [event] = _upload_events_seen()
    assert event["detail"]["object"]["key"] == "manifests/run.json"
    assert event["detail"]["object"]["version-id"] not in (None, "null")


REPOSITORY = {"Type": "AWS::ECR::Repository", "Properties": {"ImageTagMutability": "IMMUTABLE"}}


def test_moto_gap_cloudformation_repository_generated_name_is_rejected(aws: None) -> None:
    with pytest.raises(ClientError, match="repositoryName"):
        _stack({"TrainingRepository": REPOSITORY})


def test_patch_cloudformation_repository_gets_lower_case_name(runtime: patches.Runtime) -> None:
    outputs = _stack(
        {"TrainingRepository": REPOSITORY}, {"Uri": {"Value": {"Fn::GetAtt": ["TrainingRepository", "RepositoryUri"]}}}
    )
    name = outputs["Uri"].split("/", 1)[1]
    assert name == name.lower()
    assert name.startswith("s-trainingrepository-")


def _function_stack_resources() -> dict[str, Any]:
    s3 = _client("s3")
    s3.create_bucket(Bucket="artifacts")
    s3.put_object(Bucket="artifacts", Key="fn.zip", Body=_zip({"app.py": HANDLERS}))
    s3.put_object(Bucket="artifacts", Key="layer.zip", Body=_zip({"python/common.py": "X = 1\n"}))
    return {
        "Layer": {
            "Type": "AWS::Lambda::LayerVersion",
            "Properties": {"LayerName": "common", "Content": {"S3Bucket": "artifacts", "S3Key": "layer.zip"}},
        },
        "Fn": {
            "Type": "AWS::Lambda::Function",
            "Properties": {
                "FunctionName": "fn",
                "Code": {"S3Bucket": "artifacts", "S3Key": "fn.zip"},
                "Handler": "app.lambda_handler",
                "Runtime": "python3.11",
                "Role": ROLE,
                "Layers": [{"Ref": "Layer"}],
                "DeadLetterConfig": {"TargetArn": f"arn:aws:sqs:{REGION}:{ACCOUNT}:dlq"},
                "Environment": {"Variables": {"GREETING": "from-template"}},
            },
        },
    }


def test_moto_gap_cloudformation_function_drops_layers(aws: None) -> None:
    _stack(_function_stack_resources())
    assert not _client("lambda").get_function_configuration(FunctionName="fn").get("Layers")


def test_patch_cloudformation_function_keeps_layers_and_runs_from_deployed_zip(runtime: patches.Runtime) -> None:
    _stack(_function_stack_resources())
    assert len(_client("lambda").get_function_configuration(FunctionName="fn")["Layers"]) == 1
    assert _lambda_model("fn").dead_letter_config == {"TargetArn": f"arn:aws:sqs:{REGION}:{ACCOUNT}:dlq"}
    spec = patches.function_spec(runtime, _lambda_model("fn"))
    assert (spec.layer_dirs[0] / "common.py").exists(), "the layer's python/ folder goes on sys.path"
    answer = json.loads(_client("lambda").invoke(FunctionName="fn", Payload=b"{}")["Payload"].read())
    assert answer["greeting"] == "from-template"


QUEUE_STATEMENT = {
    "Effect": "Allow",
    "Principal": {"Service": "events.amazonaws.com"},
    "Action": "sqs:SendMessage",
    "Resource": f"arn:aws:sqs:{REGION}:{ACCOUNT}:dlq",
}
EXTRA_RESOURCES = {
    "Queue": {"Type": "AWS::SQS::Queue", "Properties": {"QueueName": "dlq"}},
    "QueuePolicy": {
        "Type": "AWS::SQS::QueuePolicy",
        "Properties": {
            "Queues": [{"Ref": "Queue"}],
            "PolicyDocument": {"Version": "2012-10-17", "Statement": [QUEUE_STATEMENT]},
        },
    },
    "Schedule": {
        "Type": "AWS::Scheduler::Schedule",
        "Properties": {
            "Name": "every10",
            "ScheduleExpression": "rate(10 minutes)",
            "FlexibleTimeWindow": {"Mode": "OFF"},
            "Target": {"Arn": f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:x", "RoleArn": ROLE},
        },
    },
}


def test_moto_gap_cloudformation_lacks_queue_policy_schedule_and_bucket_policy_models() -> None:
    from moto.cloudformation.parsing import resource_class_from_type

    for resource_type in patches.EXTRA_CFN_MODELS:
        assert resource_class_from_type(resource_type) is None, resource_type


def test_patch_cloudformation_creates_queue_policy_and_schedule(runtime: patches.Runtime) -> None:
    _stack(EXTRA_RESOURCES)
    schedule = _client("scheduler").get_schedule(Name="every10")
    assert schedule["ScheduleExpression"] == "rate(10 minutes)"
    queue_url = _client("sqs").get_queue_url(QueueName="dlq")["QueueUrl"]
    policy = _client("sqs").get_queue_attributes(QueueUrl=queue_url, AttributeNames=["Policy"])["Attributes"]
    assert json.loads(policy["Policy"])["Statement"] == [QUEUE_STATEMENT]


# ------------------------------------------------------------------------------------ (d) Step Functions


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


def test_moto_gap_send_task_failure_drops_cause(aws: None) -> None:
    failed = _fail_waiting_task()
    assert failed["error"] == "DownloadJobFailed"
    assert "cause" not in failed


def test_patch_send_task_failure_keeps_cause(runtime: patches.Runtime) -> None:
    failed = _fail_waiting_task()
    assert failed["error"] == "DownloadJobFailed"
    assert failed["cause"] == "AlgorithmError: all URLs failed"


def _pass_machine() -> str:
    definition = json.dumps({"StartAt": "P", "States": {"P": {"Type": "Pass", "End": True}}})
    return str(
        _client("stepfunctions").create_state_machine(name="m", definition=definition, roleArn=ROLE)["stateMachineArn"]
    )


def test_moto_gap_start_execution_without_name_is_named_none(aws: None) -> None:
    arn = _client("stepfunctions").start_execution(stateMachineArn=_pass_machine())["executionArn"]
    assert arn.endswith(":None")


def test_patch_start_execution_without_name_gets_unique_name(runtime: patches.Runtime) -> None:
    sfn = _client("stepfunctions")
    machine = _pass_machine()
    first = sfn.start_execution(stateMachineArn=machine)["executionArn"]
    second = sfn.start_execution(stateMachineArn=machine)["executionArn"]
    assert first != second
    assert not first.endswith(":None")


class _RecordingExecution:
    """Stands in for moto's Execution and records the order its fields are set in."""

    def __init__(self, program_state: Any) -> None:
        env = type("Env", (), {"program_state": lambda _self: program_state, "states": None})()
        env.states = type("States", (), {"get_input": lambda _self: {"done": True}})()
        object.__setattr__(self, "order", [])
        object.__setattr__(self, "exec_worker", type("Worker", (), {"env": env})())

    def __setattr__(self, name: str, value: Any) -> None:
        self.order.append(name)
        object.__setattr__(self, name, value)


def _reflect_order(reflect: Callable[[Any], None]) -> list[str]:
    from moto.stepfunctions.parser.asl.eval.program_state import ProgramEnded

    execution = _RecordingExecution(ProgramEnded())
    reflect(type("Comm", (), {"execution": execution})())
    return list(execution.order)


def test_moto_gap_execution_status_set_before_output() -> None:
    from moto.stepfunctions.parser.backend.execution import BaseExecutionWorkerCommunication

    order = _reflect_order(BaseExecutionWorkerCommunication._reflect_execution_status)
    assert order.index("exec_status") < order.index("output")


def test_patch_execution_output_set_before_status() -> None:
    order = _reflect_order(patches.sfn_reflect_execution_status)
    assert order.index("output") < order.index("exec_status")


def test_moto_gap_interpreter_builds_a_new_client_per_task() -> None:
    import moto.stepfunctions.parser.asl.utils.boto_client as boto_client

    assert boto_client.boto_client_for(REGION, "lambda") is not boto_client.boto_client_for(REGION, "lambda")


def test_patch_interpreter_reuses_one_client_per_service(tmp_path: Path) -> None:
    import moto.stepfunctions.parser.asl.component.state.exec.state_task.lambda_eval_utils as lambda_eval_utils
    import moto.stepfunctions.parser.asl.utils.boto_client as boto_client

    with patches.patched(patches.Runtime(workdir=tmp_path)):
        assert boto_client.boto_client_for(REGION, "lambda") is boto_client.boto_client_for(REGION, "lambda")
        assert lambda_eval_utils.boto_client_for is patches.sfn_boto_client_for
    assert lambda_eval_utils.boto_client_for is not patches.sfn_boto_client_for, "uninstall restores moto"


# ------------------------------------------------------------------------------------ (e) SageMaker

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


def test_moto_gap_processing_job_completed_at_once(aws: None) -> None:
    _client("sagemaker").create_processing_job(**PROCESSING_REQUEST)
    described = _client("sagemaker").describe_processing_job(ProcessingJobName="sdf-dl-run-00000-a0")
    assert described["ProcessingJobStatus"] == "Completed"


def test_patch_processing_job_runs_locally_and_publishes_state_change(runtime: patches.Runtime) -> None:
    sagemaker = _client("sagemaker")
    queue_url = _events_queue("SageMaker Processing Job State Change")
    sagemaker.create_processing_job(**PROCESSING_REQUEST)
    assert sagemaker.describe_processing_job(ProcessingJobName="sdf-dl-run-00000-a0")["ProcessingJobStatus"] == (
        "InProgress"
    )
    assert runtime.sagemaker.calls == [("processing", PROCESSING_REQUEST)]  # type: ignore[union-attr]
    with pytest.raises(ClientError, match="ResourceInUse"):
        sagemaker.create_processing_job(**PROCESSING_REQUEST)

    patches.SageMakerStatusPublisher().job_status_changed(
        "processing", "sdf-dl-run-00000-a0", "Failed", {"FailureReason": "AlgorithmError: 3 of 3 URLs failed"}
    )
    described = sagemaker.describe_processing_job(ProcessingJobName="sdf-dl-run-00000-a0")
    assert described["ProcessingJobStatus"] == "Failed"
    assert described["FailureReason"] == "AlgorithmError: 3 of 3 URLs failed"
    [event] = _received(queue_url)
    assert event["source"] == "aws.sagemaker"
    assert event["detail"]["ProcessingJobStatus"] == "Failed"
    assert event["detail"]["FailureReason"] == "AlgorithmError: 3 of 3 URLs failed"
    assert isinstance(event["detail"]["CreationTime"], int), "event times are epoch milliseconds"


def test_patch_training_job_reports_artifacts_and_metrics(runtime: patches.Runtime) -> None:
    sagemaker = _client("sagemaker")
    queue_url = _events_queue("SageMaker Training Job State Change")
    sagemaker.create_training_job(**TRAINING_REQUEST)
    started = sagemaker.describe_training_job(TrainingJobName="sdf-tr-run-a0")
    assert (started["TrainingJobStatus"], "ModelArtifacts" in started) == ("InProgress", False)
    assert started["AlgorithmSpecification"]["MetricDefinitions"][0]["Name"] == "train:loss"
    artifacts = {"S3ModelArtifacts": "s3://data/runs/run/training/sdf-tr-run-a0/output/model.tar.gz"}
    now = datetime.now(UTC)
    metrics = [{"MetricName": "train:loss", "Value": 0.25, "Timestamp": now}]
    fields = {"ModelArtifacts": artifacts, "FinalMetricDataList": metrics, "TrainingEndTime": now}
    patches.SageMakerStatusPublisher().job_status_changed("training", "sdf-tr-run-a0", "Completed", fields)
    described = sagemaker.describe_training_job(TrainingJobName="sdf-tr-run-a0")
    assert described["TrainingJobStatus"] == "Completed"
    assert described["ModelArtifacts"] == artifacts
    assert described["FinalMetricDataList"][0]["Value"] == 0.25
    assert described["TrainingEndTime"].timestamp() == pytest.approx(now.timestamp(), abs=1)
    [event] = _received(queue_url)
    assert event["detail"]["ModelArtifacts"] == artifacts
    assert event["detail"]["FinalMetricDataList"][0]["Timestamp"] == int(now.timestamp() * 1000)


def test_moto_gap_no_stop_training_job(aws: None) -> None:
    _client("sagemaker").create_training_job(**TRAINING_REQUEST)
    with pytest.raises(Exception, match=r"stop_training_job|not.*implemented|NotImplemented"):
        _client("sagemaker").stop_training_job(TrainingJobName="sdf-tr-run-a0")


def test_patch_stop_training_job_stops_local_job(runtime: patches.Runtime) -> None:
    sagemaker = _client("sagemaker")
    sagemaker.create_training_job(**TRAINING_REQUEST)
    sagemaker.stop_training_job(TrainingJobName="sdf-tr-run-a0")
    assert sagemaker.describe_training_job(TrainingJobName="sdf-tr-run-a0")["TrainingJobStatus"] == "Stopping"
    assert ("stop", ("training", "sdf-tr-run-a0")) in runtime.sagemaker.calls  # type: ignore[union-attr]


def _model_and_config(sagemaker: Any, suffix: str) -> None:
    sagemaker.create_model(
        ModelName=f"m-{suffix}",
        ExecutionRoleArn=ROLE,
        PrimaryContainer={"Image": "image:tag", "ModelDataUrl": f"s3://data/{suffix}/model.tar.gz"},
    )
    sagemaker.create_endpoint_config(
        EndpointConfigName=f"c-{suffix}",
        ProductionVariants=[
            {
                "VariantName": "AllTraffic",
                "ModelName": f"m-{suffix}",
                "InitialInstanceCount": 1,
                "InstanceType": "ml.m5.xlarge",
            }
        ],
    )


def test_moto_gap_endpoint_in_service_at_once_and_no_update_endpoint(aws: None) -> None:
    sagemaker = _client("sagemaker")
    _model_and_config(sagemaker, "a")
    sagemaker.create_endpoint(EndpointName="e", EndpointConfigName="c-a")
    assert sagemaker.describe_endpoint(EndpointName="e")["EndpointStatus"] == "InService"
    _model_and_config(sagemaker, "b")
    with pytest.raises(Exception, match=r"update_endpoint|not.*implemented|NotImplemented"):
        sagemaker.update_endpoint(EndpointName="e", EndpointConfigName="c-b")
    answer = _client("sagemaker-runtime").invoke_endpoint(EndpointName="e", Body=b"prompt")
    assert answer["Body"].read() != b"PNG:prompt"


def test_patch_endpoint_create_update_and_invoke_go_to_local_sagemaker(runtime: patches.Runtime) -> None:
    sagemaker = _client("sagemaker")
    queue_url = _events_queue("SageMaker Endpoint State Change")
    publisher = patches.SageMakerStatusPublisher()
    _model_and_config(sagemaker, "a")
    sagemaker.create_endpoint(EndpointName="e", EndpointConfigName="c-a")
    assert sagemaker.describe_endpoint(EndpointName="e")["EndpointStatus"] == "Creating"
    name, config, model = runtime.sagemaker.calls[-1][1]  # type: ignore[union-attr]
    assert (name, config["EndpointConfigName"], model["PrimaryContainer"]["ModelDataUrl"]) == (
        "e",
        "c-a",
        "s3://data/a/model.tar.gz",
    )
    publisher.job_status_changed("endpoint", "e", "InService", {"EndpointConfigName": "c-a"})

    _model_and_config(sagemaker, "b")
    sagemaker.update_endpoint(EndpointName="e", EndpointConfigName="c-b")
    updating = sagemaker.describe_endpoint(EndpointName="e")
    assert (updating["EndpointStatus"], updating["EndpointConfigName"]) == ("Updating", "c-a")
    with pytest.raises(ClientError, match="in-progress"):
        sagemaker.update_endpoint(EndpointName="e", EndpointConfigName="c-b")
    publisher.job_status_changed("endpoint", "e", "InService", {"EndpointConfigName": "c-b"})
    assert sagemaker.describe_endpoint(EndpointName="e")["EndpointConfigName"] == "c-b"
    statuses = [event["detail"]["EndpointStatus"] for event in _received(queue_url)]
    assert statuses == ["IN_SERVICE", "IN_SERVICE"]

    answer = _client("sagemaker-runtime").invoke_endpoint(
        EndpointName="e", Body=b"a red square", ContentType="text/plain", Accept="image/png"
    )
    assert answer["Body"].read() == b"PNG:a red square"
    assert answer["ContentType"] == "image/png"


# ------------------------------------------------------------------------------------ (f) SNS


def test_moto_gap_sns_publish_keeps_nothing_readable(aws: None, tmp_path: Path) -> None:
    from moto.sns.models import Topic

    topic = _client("sns").create_topic(Name="t")["TopicArn"]
    _client("sns").publish(TopicArn=topic, Message="hello")
    assert "publish" in vars(Topic)
    assert not (tmp_path / "sns").exists()


def test_patch_sns_publish_appends_message_to_topic_file(runtime: patches.Runtime) -> None:
    sns = _client("sns")
    topic = sns.create_topic(Name="notifications")["TopicArn"]
    sns.publish(
        TopicArn=topic,
        Subject="[sdflow] Run rejected",
        Message="2 problems",
        MessageAttributes={"outcome": {"DataType": "String", "StringValue": "rejected"}},
    )
    sns.publish(TopicArn=topic, Message="second")
    messages = patches.read_sns_messages(runtime.workdir, "notifications")
    assert [m["message"] for m in messages] == ["2 problems", "second"]
    assert messages[0]["subject"] == "[sdflow] Run rejected"
    assert messages[0]["attributes"] == {"outcome": "rejected"}


# ------------------------------------------------------------------------------------ install


def test_uninstall_restores_every_patched_attribute(tmp_path: Path) -> None:
    from moto.awslambda_simple.models import LambdaSimpleBackend
    from moto.s3.models import FakeBucket
    from moto.sagemaker.responses import SageMakerResponse

    before = (LambdaSimpleBackend.invoke, FakeBucket.create_from_cloudformation_json.__func__)
    with patches.patched(patches.Runtime(workdir=tmp_path)):
        assert LambdaSimpleBackend.invoke is patches.lambda_invoke
        assert hasattr(SageMakerResponse, "update_endpoint")
    assert (LambdaSimpleBackend.invoke, FakeBucket.create_from_cloudformation_json.__func__) == before
    assert not hasattr(SageMakerResponse, "update_endpoint")
    assert not patches.installed()


def test_runner_serves_concurrent_invocations_with_bounded_pool(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(HANDLERS)
    runner = LambdaRunner("http://127.0.0.1:9", REGION, tmp_path / "logs", max_workers_per_function=2)
    spec = FunctionSpec("f", "arn:aws:lambda:us-east-1:1:function:f", "app.lambda_handler", tmp_path, timeout_s=10)
    results: list[dict[str, Any]] = []

    def call() -> None:
        results.append(json.loads(runner.invoke(spec, json.dumps({"sleep": 0.3})).payload))

    threads = [threading.Thread(target=call) for _ in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        runner.shutdown()
    assert len(results) == 4
    assert len({r["pid"] for r in results}) <= 2
