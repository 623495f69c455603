"""start_pipeline: a manifest upload starts exactly one execution, or is rejected with a report."""

from __future__ import annotations

import copy
import json
import logging
import re
from typing import Any
from urllib.parse import quote_plus

import boto3
import pytest
from aws_lambda_powertools.utilities.parser.models import S3EventNotificationEventBridgeModel

from sdflow_common.start_pipeline import (
    EXECUTION_NAME_MAX,
    ManifestRef,
    execution_name,
    handle_manifest,
    rejected_key,
)
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
from tests.unit.parquet_files import parquet_bytes

NAME_RE = re.compile(r"^[0-9A-Za-z_-]{1,80}$")
PASS_DEFINITION = json.dumps({"StartAt": "Done", "States": {"Done": {"Type": "Pass", "End": True}}})


@pytest.fixture
def world(mocked_aws: AwsWorld) -> AwsWorld:
    mocked_aws.sfn.create_state_machine(
        name=STATE_MACHINE_NAME,
        definition=PASS_DEFINITION,
        roleArn=f"arn:aws:iam::{ACCOUNT}:role/sdflow-states-test",
    )
    put_inputs(mocked_aws)
    return mocked_aws


def put_inputs(world: AwsWorld) -> None:
    """The model and parquet file that events/run_document_minimal.json names."""
    world.put_json("models/stable-diffusion-v1-5/model_index.json", {"_class_name": "StableDiffusionPipeline"})
    world.s3.put_object(Bucket=DATA_BUCKET, Key="datasets/laion-mini/part-00000.parquet", Body=parquet_bytes())


@pytest.fixture
def app(world: AwsWorld) -> Any:
    return load_function_module("start_pipeline")


@pytest.fixture
def sns_inbox(world: AwsWorld) -> Any:
    """An SQS queue subscribed to the topic; returns a reader of the SNS envelopes it received."""
    sqs = boto3.client("sqs", region_name=REGION)
    url = sqs.create_queue(QueueName="sdflow-inbox")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    world.sns.subscribe(TopicArn=world.topic_arn, Protocol="sqs", Endpoint=arn)

    def read() -> list[dict[str, Any]]:
        messages = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10).get("Messages", [])
        return [json.loads(m["Body"]) for m in messages]

    return read


def manifest() -> dict[str, Any]:
    return load_event("run_document_minimal.json")


def s3_event(key: str, put: dict[str, Any]) -> dict[str, Any]:
    """The sample EventBridge event, pointing at the object `put` created."""
    event = copy.deepcopy(load_event("eventbridge_s3_manifest_created.json"))
    obj = event["detail"]["object"]
    obj["key"] = key
    obj["etag"] = put["ETag"].strip('"')
    if put.get("VersionId"):
        obj["version-id"] = put["VersionId"]
    else:
        obj.pop("version-id")
    return event


def upload(world: AwsWorld, key: str, body: Any) -> dict[str, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return world.s3.put_object(Bucket=DATA_BUCKET, Key=key, Body=data)


def executions(world: AwsWorld) -> list[dict[str, Any]]:
    return world.sfn.list_executions(stateMachineArn=STATE_MACHINE_ARN)["executions"]


def emitted_metrics(captured: str) -> dict[str, float]:
    """Metric name → value from the Embedded Metric Format lines Powertools printed."""
    values: dict[str, float] = {}
    for line in captured.splitlines():
        if line.startswith("{") and '"_aws"' in line:
            blob = json.loads(line)
            for directive in blob["_aws"]["CloudWatchMetrics"]:
                for metric in directive["Metrics"]:
                    value = blob[metric["Name"]]
                    values[metric["Name"]] = sum(value) if isinstance(value, list) else value
    return values


def test_sample_event_parses_as_real_s3_eventbridge_shape() -> None:

    event = S3EventNotificationEventBridgeModel.model_validate(load_event("eventbridge_s3_manifest_created.json"))
    assert event.detail_type == "Object Created"
    assert event.detail.bucket.name == DATA_BUCKET
    assert event.detail.object.key == "manifests/demo.json"
    assert event.detail.object.version_id
    assert event.detail.object.etag


def test_handler_valid_manifest_starts_one_execution_with_manifest_input(
    world: AwsWorld, app: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    put = upload(world, "manifests/demo.json", manifest())
    result = app.lambda_handler(s3_event("manifests/demo.json", put), FakeLambdaContext())

    assert result["status"] == "started"
    runs = executions(world)
    assert len(runs) == 1
    name = runs[0]["name"]
    assert name == result["execution_name"]
    assert NAME_RE.match(name)
    assert len(name) <= EXECUTION_NAME_MAX
    assert name.startswith("demo-")
    described = world.sfn.describe_execution(executionArn=runs[0]["executionArn"])
    assert json.loads(described["input"]) == manifest()
    assert emitted_metrics(capsys.readouterr().out).get("RunsStarted") == 1.0


def test_execution_name_is_deterministic_and_uses_run_name() -> None:
    ref = ManifestRef(DATA_BUCKET, "manifests/demo.json", "v1", "etag1")
    assert execution_name(ref) == execution_name(ManifestRef(DATA_BUCKET, "manifests/demo.json", "v1", "etag1"))
    assert execution_name(ref) != execution_name(ManifestRef(DATA_BUCKET, "manifests/demo.json", "v2", "etag1"))
    assert execution_name(ref) != execution_name(ManifestRef("other-bucket", "manifests/demo.json", "v1", "e"))
    assert execution_name(ref, "pokemon-v2").startswith("pokemon-v2-")
    # Unversioned buckets: the ETag tells two uploads of different content apart.
    unversioned = ManifestRef(DATA_BUCKET, "manifests/demo.json", None, "aaa")
    assert execution_name(unversioned) != execution_name(ManifestRef(DATA_BUCKET, "manifests/demo.json", None, "b"))


@pytest.mark.parametrize(
    "key",
    [
        "manifests/" + "very-long-run-name-" * 60 + ".json",
        "manifests/sub/dir/" + "ü" * 300 + ".json",
        "manifests/a b:c*d?e|f.json",
        "manifests/---.json",
    ],
)
def test_execution_name_of_any_key_is_valid_and_at_most_80_chars(key: str) -> None:
    name = execution_name(ManifestRef(DATA_BUCKET, key, "3HL4kqtJlcpXroDTDmJ.rmSpXd3dIbrHY", "0f34"))
    assert NAME_RE.match(name), name
    assert len(name) <= EXECUTION_NAME_MAX


def test_handler_very_long_key_starts_execution_with_valid_name(world: AwsWorld, app: Any) -> None:
    key = "manifests/" + "x" * 900 + ".json"
    put = upload(world, key, manifest())
    result = app.lambda_handler(s3_event(key, put), FakeLambdaContext())
    assert result["status"] == "started"
    (run,) = executions(world)
    assert len(run["name"]) <= EXECUTION_NAME_MAX
    assert NAME_RE.match(run["name"])


def test_handler_same_event_twice_starts_one_execution(
    world: AwsWorld, app: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    put = upload(world, "manifests/demo.json", manifest())
    event = s3_event("manifests/demo.json", put)
    first = app.lambda_handler(event, FakeLambdaContext())
    capsys.readouterr()
    second = app.lambda_handler(copy.deepcopy(event), FakeLambdaContext())

    assert first["status"] == "started"
    assert second["status"] == "duplicate"
    assert second["execution_name"] == first["execution_name"]
    assert len(executions(world)) == 1
    assert emitted_metrics(capsys.readouterr().out).get("DuplicateManifestEvents") == 1.0


def test_handle_manifest_racing_duplicate_is_not_an_error(world: AwsWorld, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two deliveries passing the existence check together: the second meets ExecutionAlreadyExists."""
    from sdflow_common import start_pipeline

    put = upload(world, "manifests/demo.json", manifest())
    ref = ManifestRef(DATA_BUCKET, "manifests/demo.json", None, put["ETag"].strip('"'))
    kwargs = {
        "state_machine_arn": STATE_MACHINE_ARN,
        "topic_arn": world.topic_arn,
        "max_shards": 50,
        "data_bucket": DATA_BUCKET,
    }
    first = handle_manifest(ref, **kwargs)
    # A closed execution makes StartExecution raise ExecutionAlreadyExists even for the same input.
    world.sfn.stop_execution(executionArn=first.execution_arn)
    monkeypatch.setattr(start_pipeline, "_already_started", lambda arn: False)

    second = handle_manifest(ref, **kwargs)
    assert second.status == "duplicate"
    assert len(executions(world)) == 1


def test_handler_reupload_to_versioned_bucket_starts_a_second_run(world: AwsWorld, app: Any) -> None:
    world.s3.put_bucket_versioning(Bucket=DATA_BUCKET, VersioningConfiguration={"Status": "Enabled"})
    first_put = upload(world, "manifests/demo.json", manifest())
    second_put = upload(world, "manifests/demo.json", manifest())
    assert first_put["VersionId"] != second_put["VersionId"]

    first = app.lambda_handler(s3_event("manifests/demo.json", first_put), FakeLambdaContext())
    second = app.lambda_handler(s3_event("manifests/demo.json", second_put), FakeLambdaContext())
    assert first["status"] == second["status"] == "started"
    assert first["execution_name"] != second["execution_name"]
    assert len(executions(world)) == 2


def _too_many_shards() -> dict[str, Any]:
    uris = [f"s3://{DATA_BUCKET}/datasets/part-{i:05d}.parquet" for i in range(51)]  # MAX_SHARDS is 50
    return {**manifest(), "dataset": {"parquet_uris": uris}}


INVALID_MANIFESTS = {
    "invalid-example": (lambda: load_event("run_document_invalid.json"), "training.epochs"),
    "unknown-field": (lambda: {**manifest(), "dataset_uri": "s3://x/y"}, "dataset_uri"),
    "nested-unknown": (lambda: {**manifest(), "training": {"epoch": 1}}, "training.epoch"),
    "wrong-scheme": (lambda: {**manifest(), "base_model_uri": "https://hf.co/sd"}, "base_model_uri"),
    "empty-list": (lambda: {**manifest(), "dataset": {"parquet_uris": []}}, "dataset.parquet_uris"),
    "too-many-shards": (_too_many_shards, "dataset.parquet_uris"),
    "out-of-range": (lambda: {**manifest(), "download": {"image_size": 8}}, "download.image_size"),
    "spot-without-wait": (lambda: {**manifest(), "training": {"use_spot": True}}, "training.max_wait_seconds"),
    "no-dataset-source": (lambda: {**manifest(), "dataset": {}}, "dataset"),
    "bad-json": (lambda: b'{"dataset": {"parquet_uris": ["s3://b/a.parquet"]},,}', "(document)"),
    "not-utf8": (lambda: b'{"run_name": "\xff\xfe"}', "(document)"),
    "empty-file": (lambda: b"  \n", "(document)"),
    "json-array": (lambda: [manifest()], "(document)"),
    "deeply-nested": (lambda: b"[" * 100_000 + b"]" * 100_000, "(document)"),
    "deeply-nested-field": (lambda: b'{"dataset": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001, "(document)"),
    "huge-integer": (lambda: b'{"download": {"image_size": ' + b"9" * 5000 + b"}}", "(document)"),
    "misspelt-field": (lambda: {**manifest(), "trainning": {}}, "trainning"),
    # A form the document takes that SageMaker hosts on no instance: refused at CreateEndpointConfig otherwise.
    "endpoint-type-not-hosted": (
        lambda: {**manifest(), "endpoint": {**manifest().get("endpoint", {}), "instance_type": "ml.c5.3xlarge"}},
        "endpoint.instance_type",
    ),
    "empty-prefix": (
        lambda: {**manifest(), "dataset": {"prefix": f"s3://{DATA_BUCKET}/datasets/none/"}},
        "dataset.prefix",
    ),
    "missing-parquet": (
        lambda: {**manifest(), "dataset": {"parquet_uris": [f"s3://{DATA_BUCKET}/datasets/gone.parquet"]}},
        "dataset.parquet_uris",
    ),
    "model-outside-bucket": (lambda: {**manifest(), "base_model_uri": "s3://elsewhere-models/sd/"}, "base_model_uri"),
    "model-missing": (lambda: {**manifest(), "base_model_uri": f"s3://{DATA_BUCKET}/models/none/"}, "base_model_uri"),
    "wrong-url-column": (
        lambda: {**manifest(), "dataset": {**manifest()["dataset"], "url_column": "link"}},
        "dataset.url_column",
    ),
    # The parquet has no punsafe column (tests/unit/parquet_files.py): its footer is read before any run starts.
    "filter-column-missing": (
        lambda: {**manifest(), "dataset": {**manifest()["dataset"], "filters": {"max_punsafe": 0.5}}},
        "dataset.filters.max_punsafe",
    ),
    "filter-bounds-crossed": (
        lambda: {
            **manifest(),
            "dataset": {**manifest()["dataset"], "filters": {"min_caption_length": 9, "max_caption_length": 3}},
        },
        "dataset.filters.min_caption_length",
    ),
}


@pytest.mark.parametrize("case", list(INVALID_MANIFESTS), ids=list(INVALID_MANIFESTS))
def test_handler_invalid_manifest_writes_report_notifies_and_starts_nothing(
    world: AwsWorld, app: Any, sns_inbox: Any, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    make, field = INVALID_MANIFESTS[case]
    key = f"manifests/{case}.json"
    put = upload(world, key, make())
    capsys.readouterr()

    result = app.lambda_handler(s3_event(key, put), FakeLambdaContext())

    assert result["status"] == "rejected"
    assert executions(world) == []
    report = world.get_json(rejected_key(key))
    assert report["manifest"] == f"s3://{DATA_BUCKET}/{key}"
    assert field in {error["field"] for error in report["errors"]}
    assert all(error["message"] for error in report["errors"])
    assert report["rejected_at"].endswith("+00:00")
    assert result["report_key"] == f"rejected/manifests/{case}.json.errors.json"

    (notification,) = sns_inbox()
    assert notification["MessageAttributes"]["outcome"]["Value"] == "rejected"
    assert f"{case}.json" in notification["Subject"]
    assert len(notification["Subject"]) <= 100
    assert f"s3://{DATA_BUCKET}/{key}" in notification["Message"]
    for error in report["errors"]:
        assert f"{error['field']}: {error['message']}" in notification["Message"]
    assert "How to fix" in notification["Message"]
    assert emitted_metrics(capsys.readouterr().out).get("ManifestsRejected") == 1.0


def test_handler_misspelt_field_and_bad_endpoint_name_get_plain_advice(world: AwsWorld, app: Any) -> None:
    document = {**manifest(), "trainning": {}, "endpoint": {"name": "my_endpoint!"}, "training": {"max_train_step": 5}}
    put = upload(world, "manifests/typos.json", document)

    result = app.lambda_handler(s3_event("manifests/typos.json", put), FakeLambdaContext())

    found = {error["field"]: error["message"] for error in result["errors"]}
    assert "did you mean `training`?" in found["trainning"]
    assert "did you mean `max_train_steps`?" in found["training.max_train_step"]
    assert "'my_endpoint!' is not allowed here; use letters, digits and hyphens" in found["endpoint.name"]
    assert "(-*" not in json.dumps(result["errors"]), "no raw regex in a message"


def test_handler_thousands_of_unknown_fields_report_a_bounded_list(world: AwsWorld, app: Any, sns_inbox: Any) -> None:
    document = {**manifest(), **{f"extra_{i}": i for i in range(5000)}}
    put = upload(world, "manifests/noisy.json", document)

    result = app.lambda_handler(s3_event("manifests/noisy.json", put), FakeLambdaContext())

    assert result["status"] == "rejected"
    assert len(result["errors"]) == 20
    assert result["errors"][-1]["message"].startswith("and 4981 more problems")
    (notification,) = sns_inbox()
    assert len(notification["Message"]) < 10_000


def test_handler_control_characters_and_lone_surrogates_are_escaped_in_the_report(
    world: AwsWorld, app: Any, sns_inbox: Any
) -> None:
    put = upload(world, "manifests/odd.json", b'{"a\\nb": 1, "x": "\\ud800"}')

    result = app.lambda_handler(s3_event("manifests/odd.json", put), FakeLambdaContext())

    found = {error["field"]: error["message"] for error in result["errors"]}
    assert found["a\\nb"].startswith("unknown field")
    (notification,) = sns_inbox()
    assert "  - a\\nb: unknown field" in notification["Message"]


def test_handler_lone_surrogate_in_a_name_is_named_as_not_unicode(world: AwsWorld, app: Any) -> None:
    put = upload(world, "manifests/surrogate.json", b'{"run_name\\ud800": "x"}')

    result = app.lambda_handler(s3_event("manifests/surrogate.json", put), FakeLambdaContext())

    [error] = result["errors"]
    assert (
        error["message"]
        == "'run_name\\ud800' is not valid Unicode text (it holds a lone surrogate); write it as plain UTF-8"
    )


def test_rejection_report_lands_outside_manifests_so_it_never_triggers_a_run() -> None:
    assert rejected_key("manifests/demo.json") == "rejected/manifests/demo.json.errors.json"
    assert not rejected_key("manifests/demo.json").startswith("manifests/")


def test_handler_key_outside_manifests_is_ignored(world: AwsWorld, app: Any) -> None:
    put = upload(world, "datasets/demo.json", manifest())
    assert app.lambda_handler(s3_event("datasets/demo.json", put), FakeLambdaContext())["status"] == "ignored"
    assert executions(world) == []


def test_handler_url_encoded_key_reads_the_real_object(world: AwsWorld, app: Any) -> None:
    put = upload(world, "manifests/my run.json", manifest())
    result = app.lambda_handler(s3_event("manifests/my+run.json", put), FakeLambdaContext())
    assert result["status"] == "started"
    assert result["execution_name"].startswith("my-run-")


@pytest.mark.parametrize("versioned", [True, False], ids=["versioned", "unversioned"])
@pytest.mark.parametrize("key", ["manifests/my run.json", "manifests/caf\u00e9 \u732b.json", "manifests/c++ (1).json"])
def test_handler_key_encoded_as_s3_events_encode_it_starts_the_run(
    world: AwsWorld, app: Any, key: str, versioned: bool
) -> None:
    """S3 events carry the key URL-encoded, spaces as '+' (what Powertools' S3EventBridgeNotificationObject
    decodes with unquote_plus); a versioned bucket's event also names the version."""
    if versioned:
        world.s3.put_bucket_versioning(Bucket=DATA_BUCKET, VersioningConfiguration={"Status": "Enabled"})
    put = upload(world, key, manifest())

    result = app.lambda_handler(s3_event(quote_plus(key, safe="/"), put), FakeLambdaContext())

    assert result["status"] == "started", result
    (run,) = executions(world)
    described = world.sfn.describe_execution(executionArn=run["executionArn"])
    assert json.loads(described["input"]) == manifest()


def test_handler_deleted_manifest_is_logged_as_a_warning_naming_the_key(
    world: AwsWorld, app: Any, caplog: pytest.LogCaptureFixture
) -> None:
    world.s3.put_bucket_versioning(Bucket=DATA_BUCKET, VersioningConfiguration={"Status": "Enabled"})
    put = upload(world, "manifests/gone run.json", manifest())
    world.s3.delete_object(Bucket=DATA_BUCKET, Key="manifests/gone run.json", VersionId=put["VersionId"])

    with caplog.at_level(logging.WARNING):
        result = app.lambda_handler(s3_event("manifests/gone+run.json", put), FakeLambdaContext())

    assert result["status"] == "gone"
    assert executions(world) == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("manifests/gone run.json" in text for text in warnings), warnings


def test_handler_object_overwritten_before_read_starts_nothing(world: AwsWorld, app: Any) -> None:
    old = upload(world, "manifests/demo.json", manifest())
    upload(world, "manifests/demo.json", {**manifest(), "run_name": "newer"})
    result = app.lambda_handler(s3_event("manifests/demo.json", old), FakeLambdaContext())
    assert result["status"] == "superseded"
    assert executions(world) == []


def test_handler_object_deleted_before_read_starts_nothing(world: AwsWorld, app: Any) -> None:
    put = upload(world, "manifests/demo.json", manifest())
    world.s3.delete_object(Bucket=DATA_BUCKET, Key="manifests/demo.json")
    result = app.lambda_handler(s3_event("manifests/demo.json", put), FakeLambdaContext())
    assert result["status"] == "gone"
    assert executions(world) == []


def test_handler_event_emitted_by_moto_s3_starts_a_run(world: AwsWorld, app: Any) -> None:
    """The event S3 itself sends through EventBridge (moto's shape, as the local runtime delivers it)."""
    sqs = boto3.client("sqs", region_name=REGION)
    events = boto3.client("events", region_name=REGION)
    queue_url = sqs.create_queue(QueueName="s3-events")["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    pattern = {
        "source": ["aws.s3"],
        "detail-type": ["Object Created"],
        "detail": {"bucket": {"name": [DATA_BUCKET]}},
    }
    events.put_rule(Name="manifests", EventPattern=json.dumps(pattern))
    events.put_targets(Rule="manifests", Targets=[{"Id": "q", "Arn": queue_arn}])
    world.s3.put_bucket_notification_configuration(
        Bucket=DATA_BUCKET, NotificationConfiguration={"EventBridgeConfiguration": {}}
    )
    upload(world, "manifests/demo.json", manifest())
    (message,) = sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10)["Messages"]

    result = app.lambda_handler(json.loads(message["Body"]), FakeLambdaContext())
    assert result["status"] == "started"
    assert len(executions(world)) == 1


@pytest.mark.parametrize(
    ("training", "download", "field"),
    [
        ({"method": "lora", "plugin": "gemini"}, {}, "training.plugin"),
        ({"resolution": 512}, {"image_size": 256}, "training.resolution"),
    ],
)
def test_handler_training_rule_across_fields_names_the_field_to_change(
    world: AwsWorld, app: Any, training: dict[str, Any], download: dict[str, Any], field: str
) -> None:
    document = {**manifest(), "training": training, "download": download}
    put = upload(world, "manifests/rule.json", document)

    result = app.lambda_handler(s3_event("manifests/rule.json", put), FakeLambdaContext())

    assert [error["field"] for error in result["errors"]] == [field]
    assert executions(world) == []
