"""Notify success / Notify failure: the message a person reads, published once."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from sdflow_common import notify
from tests.conftest import load_function_module
from tests.unit.conftest import ACCOUNT, REGION, AwsWorld, FakeLambdaContext, load_event

EXECUTION_ARN = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:sdflow-pipeline-test:cats-v1-abc"
STARTED = "2026-11-22T10:00:00.000Z"
NOW = datetime(2026, 11, 22, 12, 14, 5, tzinfo=UTC)

SUCCESS_STATE = {
    "config": {"run_id": "cats-v1-abc", "run": {"run_name": "cats-v1"}},
    "dataset": {
        "index_uri": "s3://b/runs/cats-v1-abc/dataset/index.json",
        "total_samples": 94812,
        "shards_ok": 99,
        "shards_failed": 1,
        "failed_shards": [{"shard_id": "00042", "parquet_uri": "s3://b/datasets/part-00042.parquet"}],
    },
    "training": {
        "job_name": "sdf-tr-cats-v1-0123456789-a0",
        "model_data_url": "s3://b/runs/cats-v1-abc/training/job/output/model.tar.gz",
        "final_metrics": {"train:loss": 0.09123},
    },
    "endpoint": {
        "endpoint_name": "cats",
        "endpoint_config_name": "cats-0123456789-a0",
        "model_name": "cats-0123456789-a0",
        "action": "update",
    },
}


def _request(outcome: str, state: dict[str, Any]) -> notify.NotifyRequest:
    return notify.NotifyRequest(
        outcome=outcome, execution_arn=EXECUTION_ARN, execution_name="cats-v1-abc", start_time=STARTED, state=state
    )


def test_notify_success_message_names_duration_shards_loss_and_endpoint() -> None:
    message = notify.compose(_request("succeeded", SUCCESS_STATE), now=NOW)

    assert message.subject == "[sdflow] Run cats-v1 (cats-v1-abc) succeeded"
    text = message.message
    assert "SUCCEEDED in 2 h 14 min" in text
    assert "99 of 100 shards downloaded, 94,812 samples" in text
    assert "failed shard 00042: s3://b/datasets/part-00042.parquet" in text
    assert "final loss 0.0912" in text
    assert "Endpoint:  cats (updated blue/green" in text
    assert "invoke-endpoint --endpoint-name cats" in text
    assert f"#/v2/executions/details/{EXECUTION_ARN}" in text
    assert message.attributes == {"outcome": "succeeded", "run_id": "cats-v1-abc", "endpoint": "cats"}


def test_notify_failure_of_validation_lists_each_field_error() -> None:
    cause = json.dumps(
        {
            "errorType": "InvalidRunDocument",
            "errorMessage": json.dumps(
                [
                    {"field": "training.instance_count", "message": "Input should be greater than or equal to 1"},
                    {"field": "dataset.parquet_uris", "message": "is empty"},
                ]
            ),
        }
    )
    # The state of a run that failed in Validate run: the Catch's error, nothing else.
    state = {"error": {"Error": "InvalidRunDocument", "Cause": cause}}

    message = notify.compose(_request("failed", state), now=NOW)

    assert message.subject == "[sdflow] Run cats-v1-abc FAILED"
    assert "during: Validate run" in message.message
    assert "Nothing was started" in message.message
    assert "Error:     InvalidRunDocument" in message.message
    assert "  - training.instance_count: Input should be greater than or equal to 1" in message.message
    assert "  - dataset.parquet_uris: is empty" in message.message
    assert message.attributes["error"] == "InvalidRunDocument"
    assert "endpoint" not in message.attributes


def test_notify_failure_during_training_names_the_step_and_keeps_dataset_summary() -> None:
    state = {
        "config": SUCCESS_STATE["config"],
        "dataset": SUCCESS_STATE["dataset"],
        "error": {"Error": "TrainingJobFailed", "Cause": "AlgorithmError: CUDA out of memory"},
    }

    message = notify.compose(_request("failed", state), now=NOW)

    assert "during: Train model" in message.message
    assert "AlgorithmError: CUDA out of memory" in message.message
    assert "99 of 100 shards downloaded" in message.message
    assert "Nothing was deployed" in message.message


def test_notify_very_long_cause_is_truncated_and_subject_fits_sns_limit() -> None:
    state = {
        "config": {"run": {"run_name": "x" * 40}},
        "error": {"Error": "States.Timeout", "Cause": "y" * 10_000},
    }
    request = notify.NotifyRequest(
        outcome="failed", execution_arn=EXECUTION_ARN, execution_name="z" * 80, start_time=STARTED, state=state
    )

    message = notify.compose(request, now=NOW)

    assert len(message.subject) <= notify.SUBJECT_LIMIT
    assert len(message.message) < notify.CAUSE_LIMIT + 1500


def _subscribe_queue(world: AwsWorld) -> tuple[Any, str]:
    import boto3

    sqs = boto3.client("sqs", region_name=REGION)
    queue_url = sqs.create_queue(QueueName="notifications")["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    world.sns.subscribe(TopicArn=world.topic_arn, Protocol="sqs", Endpoint=queue_arn)
    return sqs, queue_url


def _received(sqs: Any, queue_url: str) -> list[dict[str, Any]]:
    messages = sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10).get("Messages", [])
    return [json.loads(m["Body"]) for m in messages]


@pytest.fixture
def lambda_context() -> FakeLambdaContext:
    return FakeLambdaContext(function_name="notify")


def test_notify_handler_publishes_once_even_when_the_state_retries(
    mocked_aws: AwsWorld, lambda_context: FakeLambdaContext
) -> None:
    sqs, queue_url = _subscribe_queue(mocked_aws)
    handler = load_function_module("notify").lambda_handler
    event = load_event("notify_success.json")

    first = handler(event, lambda_context)
    second = handler(event, lambda_context)

    assert first == second, "the retry must return the first result"
    [published] = _received(sqs, queue_url)
    assert published["Subject"].endswith("succeeded")
    assert published["MessageAttributes"]["outcome"]["Value"] == "succeeded"
    assert "Endpoint:" in published["Message"]


def test_notify_handler_failure_event_publishes_failure(
    mocked_aws: AwsWorld, lambda_context: FakeLambdaContext
) -> None:
    sqs, queue_url = _subscribe_queue(mocked_aws)
    handler = load_function_module("notify").lambda_handler

    handler(load_event("notify_failure.json"), lambda_context)

    [published] = _received(sqs, queue_url)
    assert published["MessageAttributes"]["outcome"]["Value"] == "failed"
    assert published["MessageAttributes"]["error"]["Value"] == "TrainingJobFailed"


@pytest.mark.parametrize(
    "document_keys",
    [
        {"training": {"instance_count": 0}, "dataset": {"prefix": "s3://b/x/"}},
        {"dataset": {"parquet_uris": []}},
        {"config": {"run": {"run_name": "x\ny"}}, "endpoint": {"name": "e"}},
    ],
)
def test_notify_validation_failure_with_document_keys_in_state_names_validate_run_and_no_progress(
    document_keys: dict[str, Any],
) -> None:
    """Keys a run document shares with the pipeline's results (training, dataset, config, endpoint) are
    not progress: only what the steps wrote counts, and lines without data are left out."""
    state = {**document_keys, "error": {"Error": "InvalidRunDocument", "Cause": "[]"}}

    message = notify.compose(_request("failed", state), now=NOW)

    assert "during: Validate run" in message.message
    for placeholder in ("0 of 0 shards", "job ?", "Dataset:", "Training:", "Endpoint:", "config ?"):
        assert placeholder not in message.message
    assert "endpoint" not in message.attributes
    assert message.subject == "[sdflow] Run cats-v1-abc FAILED"


def test_notify_failure_during_downloads_names_the_step_without_dataset_lines() -> None:
    state = {"config": SUCCESS_STATE["config"], "error": {"Error": "States.DataLimitExceeded", "Cause": "x"}}

    message = notify.compose(_request("failed", state), now=NOW)

    assert "during: Download shards / Build dataset index" in message.message
    assert "Dataset:" not in message.message
    assert "Nothing was deployed" in message.message


def test_notify_subject_of_any_execution_name_is_a_valid_sns_subject() -> None:
    request = notify.NotifyRequest(
        outcome="failed",
        execution_arn=EXECUTION_ARN,
        execution_name="caf\u00e9-\u2028-" + "\u00fc" * 90,
        state={"error": {"Error": "InvalidRunDocument", "Cause": "[]"}},
    )

    subject = notify.compose(request, now=NOW).subject

    assert len(subject) < 100
    assert subject.isascii()
    assert subject.isprintable()


def test_notify_tolerated_intake_warnings_are_listed() -> None:
    warning = {"field": "dataset.url_column", "message": "column 'URL' is not in 1 of 3 objects (s3://b/p2.parquet)"}
    state = {**SUCCESS_STATE, "config": {**SUCCESS_STATE["config"], "warnings": [warning]}}

    message = notify.compose(_request("succeeded", state), now=NOW)

    assert "dataset.url_column: column 'URL' is not in 1 of 3 objects (s3://b/p2.parquet)" in message.message
