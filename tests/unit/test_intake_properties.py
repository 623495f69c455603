"""Property-based tests of intake: whatever arrives through either door, the user gets one clear
error naming a field, a notification naming the problem, and no job; never an unhandled exception.

- The S3 door: arbitrary bytes and arbitrary JSON uploaded as a manifest, through the real
  start_pipeline handler (moto S3, SNS, Step Functions).
- The StartExecution door: arbitrary JSON as the execution input, through Validate run's logic and
  the notification the notify function composes from the failed execution; and a few examples
  through the real state machine and the real notify handler (tests/unit/intake_harness.py).

The stack's bucket holds no model and no parquet file here, so even a document that the model
accepts is refused (DatasetNotFound, naming the field) and nothing can start.

Profiles: "ci" (the default) is deterministic (derandomize) and keeps no example database;
HYPOTHESIS_PROFILE=dev explores new examples on every run."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdflow_common import notify
from sdflow_common.errors import DatasetNotFound, InvalidRunDocument
from sdflow_common.parquet_schema import NotParquet, parse_file_metadata
from sdflow_common.run_document import RunDocument, problems_of
from sdflow_common.validate_run import ValidateRunRequest, validate_run
from tests.constants import ACCOUNT, REGION
from tests.helpers import load_function_module
from tests.unit.helpers import (
    DATA_BUCKET,
    STATE_MACHINE_ARN,
    STATE_MACHINE_NAME,
    AwsWorld,
    FakeLambdaContext,
    load_event,
)
from tests.unit.intake_harness import Intake, intake_cloud

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.register_profile(
    "dev", deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

pytestmark = pytest.mark.slow

EXECUTION = "prop-0123456789abcdef"
EXECUTION_ARN = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:{STATE_MACHINE_NAME}:{EXECUTION}"
PASS_DEFINITION = json.dumps({"StartAt": "Done", "States": {"Done": {"Type": "Pass", "End": True}}})

# Any text JSON can carry, lone surrogates included (json.dumps escapes them as \ud800).
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | any_text
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(any_text, children, max_size=4),
    max_leaves=16,
)


def _field_names(model: type[Any]) -> list[str]:
    return list(model.model_fields)


@st.composite
def near_documents(draw: st.DrawFn) -> dict[str, Any]:
    """A valid manifest with a few mutations: a field set to any JSON, a field dropped, a near-miss name."""
    document: dict[str, Any] = json.loads(json.dumps(load_event("run_document_full.json")))
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        section = draw(st.sampled_from([None, "dataset", "download", "training", "endpoint", "evaluation", "approval"]))
        target = document if section is None else document.setdefault(section, {})
        if not isinstance(target, dict):
            continue
        names = _field_names(RunDocument) if section is None else list(target) or ["x"]
        name = draw(st.sampled_from(names))
        action = draw(st.sampled_from(["set", "drop", "misspell"]))
        if action == "set":
            target[name] = draw(json_values)
        elif action == "drop":
            target.pop(name, None)
        else:
            target[name[:-1] or "x"] = target.pop(name, draw(json_values))
    return document


any_json = json_values | near_documents()
any_bytes = st.binary(max_size=300) | any_json.map(lambda value: json.dumps(value).encode())


def assert_clear_problems(problems: list[dict[str, str]]) -> None:
    assert problems, "at least one problem"
    for problem in problems:
        assert problem["field"].strip(), problem
        assert problem["message"].strip(), problem
        assert problem["message"] != "None", problem


# ------------------------------------------------------------------ the S3 door


@pytest.fixture
def s3_door(mocked_aws: AwsWorld) -> tuple[AwsWorld, Any, Any]:
    import boto3

    mocked_aws.sfn.create_state_machine(
        name=STATE_MACHINE_NAME, definition=PASS_DEFINITION, roleArn=f"arn:aws:iam::{ACCOUNT}:role/sfn"
    )
    sqs = boto3.client("sqs", region_name=REGION)
    url = sqs.create_queue(QueueName="inbox")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    mocked_aws.sns.subscribe(TopicArn=mocked_aws.topic_arn, Protocol="sqs", Endpoint=arn)

    def inbox() -> list[dict[str, Any]]:
        messages = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10).get("Messages", [])
        for message in messages:
            sqs.delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])
        return [json.loads(message["Body"]) for message in messages]

    return mocked_aws, load_function_module("start_pipeline"), inbox


_keys = itertools.count()


def _upload_and_handle(world: AwsWorld, app: Any, body: bytes) -> tuple[str, dict[str, Any]]:
    key = f"manifests/example-{next(_keys)}.json"
    put = world.s3.put_object(Bucket=DATA_BUCKET, Key=key, Body=body)
    event = load_event("eventbridge_s3_manifest_created.json")
    event["detail"]["object"].update(key=key, etag=put["ETag"].strip('"'))
    event["detail"]["object"].pop("version-id", None)
    return key, app.lambda_handler(event, FakeLambdaContext(function_name="start_pipeline"))


def _check_rejected(world: AwsWorld, inbox: Any, key: str, result: dict[str, Any]) -> None:
    assert result["status"] == "rejected", result
    report = world.get_json(f"rejected/{key}.errors.json")
    assert report["errors"] == result["errors"]
    assert_clear_problems(report["errors"])
    [notification] = inbox()
    assert notification["MessageAttributes"]["outcome"]["Value"] == "rejected"
    for problem in report["errors"]:
        assert f"  - {problem['field']}: {problem['message']}"[:200] in notification["Message"]
    assert world.sfn.list_executions(stateMachineArn=STATE_MACHINE_ARN)["executions"] == []


@settings(max_examples=150)
@given(body=any_bytes)
def test_intake_s3_door_any_bytes_are_rejected_with_a_report_and_one_notification(
    s3_door: tuple[AwsWorld, Any, Any], body: bytes
) -> None:
    world, app, inbox = s3_door
    key, result = _upload_and_handle(world, app, body)
    _check_rejected(world, inbox, key, result)


@settings(max_examples=150)
@given(document=any_json)
def test_intake_s3_door_any_json_is_rejected_with_a_report_and_one_notification(
    s3_door: tuple[AwsWorld, Any, Any], document: Any
) -> None:
    world, app, inbox = s3_door
    key, result = _upload_and_handle(world, app, json.dumps(document).encode())
    _check_rejected(world, inbox, key, result)


# ------------------------------------------------------------------ the StartExecution door


def _failure_cause(error: Exception) -> str:
    """The execution's cause when Validate run's function raised `error` (Lambda's error payload)."""
    return json.dumps({"errorMessage": str(error), "errorType": type(error).__name__})


@settings(max_examples=1500)
@given(raw=any_json)
def test_intake_start_execution_door_any_json_fails_validation_with_a_named_field(
    mocked_aws: AwsWorld, raw: Any
) -> None:
    request = ValidateRunRequest(
        run=raw, execution_name=EXECUTION, execution_arn=EXECUTION_ARN, start_time="2026-01-01T00:00:00Z"
    )
    with pytest.raises((InvalidRunDocument, DatasetNotFound)) as caught:
        validate_run(request, data_bucket=DATA_BUCKET, max_shards=50)
    problems = problems_of(caught.value)
    assert_clear_problems(problems)
    assert json.loads(str(caught.value)) == problems, "the error's message is the JSON list itself"

    message = notify.compose(
        notify.NotifyRequest(
            outcome="failed",
            execution_arn=EXECUTION_ARN,
            execution_name=EXECUTION,
            running_state="Validate run",
            error=type(caught.value).__name__,
            cause=_failure_cause(caught.value),
        )
    )
    assert "in state: Validate run" in message.message
    for problem in problems:
        assert f"  - {problem['field']}: {problem['message']}" in message.message
    assert message.subject.isascii()
    assert len(message.subject) < 100


@pytest.fixture
def intake(aws_env: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[Intake]:
    with intake_cloud(monkeypatch) as cloud:
        yield cloud


@settings(max_examples=10)
@given(raw=any_json)
def test_intake_real_state_machine_any_json_input_ends_in_one_failure_notification(intake: Intake, raw: Any) -> None:
    execution_arn = intake.start(json.dumps(raw))
    result = intake.wait(execution_arn)

    assert result["status"] == "FAILED"
    error = result.get("error")
    assert error in ("InvalidRunDocument", "DatasetNotFound"), result.get("cause")
    [notification] = intake.notifications()
    assert notification["MessageAttributes"]["error"]["Value"] == error
    assert "in state: Validate run" in notification["Message"]
    assert "  - " in notification["Message"], "the problems are listed"
    assert intake.other_calls() == {}
    assert intake.jobs() == []
    assert intake.s3.list_objects_v2(Bucket=DATA_BUCKET).get("KeyCount", 0) == 0, "Validate run wrote nothing"


# ------------------------------------------------------------------ the parquet footer reader


@settings(max_examples=1000)
@given(data=st.binary(max_size=400))
def test_parquet_footer_of_any_bytes_is_a_schema_or_not_parquet(data: bytes) -> None:
    try:
        schema = parse_file_metadata(data)
    except (NotParquet, EOFError):
        return
    assert all(isinstance(name, str) for name in schema.columns)
