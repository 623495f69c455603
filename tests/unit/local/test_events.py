"""EventBridge: rule delivery to Lambda and Step Functions targets, AWS-shaped events."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from sdflow.local import runtime as runtime_module
from sdflow.local.services import events
from tests.constants import ACCOUNT, REGION
from tests.unit.local.helpers import ROLE, client, records, rule_with_target, wait_for


def test_moto_gap_rule_cannot_deliver_to_lambda_or_state_machine(aws: None) -> None:
    rule_with_target({"Arn": f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:x"}, {"source": ["demo"]})
    from moto.events.models import events_backends

    rule = events_backends[ACCOUNT][REGION].event_buses["default"].rules["r"]
    event = {"source": "demo", "detail-type": "d", "detail": {}, "time": time.time(), "ingestion-time": time.time()}
    with pytest.raises(NotImplementedError):
        rule.send_to_targets(event, transform_input=False)  # as S3's notifications call it


def test_moto_gap_s3_eventbridge_event_spells_etag_differently(aws: None) -> None:
    s3 = client("s3")
    s3.create_bucket(Bucket="bucket-b")
    s3.put_bucket_notification_configuration(
        Bucket="bucket-b", NotificationConfiguration={"EventBridgeConfiguration": {}}
    )
    queue_url = client("sqs").create_queue(QueueName="q")["QueueUrl"]
    rule_with_target({"Arn": f"arn:aws:sqs:{REGION}:{ACCOUNT}:q"}, {"source": ["aws.s3"]})
    s3.put_object(Bucket="bucket-b", Key="manifests/run.json", Body=b"{}")
    event = json.loads(client("sqs").receive_message(QueueUrl=queue_url)["Messages"][0]["Body"])
    assert event["detail-type"] == "Object Created"
    assert "eTag" in event["detail"]["object"]
    assert "etag" not in event["detail"]["object"]


def test_patch_rule_delivers_s3_object_created_to_lambda_aws_shaped(function_arn: str, tmp_path: Path) -> None:
    s3 = client("s3")
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
    rule_with_target({"Arn": function_arn, "InputTransformer": transformer}, pattern)
    s3.put_object(Bucket="bucket-b", Key="other/ignored.json", Body=b"{}")
    etag = s3.put_object(Bucket="bucket-b", Key="manifests/run.json", Body=b"{}")["ETag"].strip('"')
    [event] = wait_for(lambda: records(tmp_path / "events.jsonl"), what="the rule's Lambda delivery")
    assert event["key"] == "manifests/run.json"
    assert event["etag"] == etag
    assert event["time"].endswith("Z")


def test_patch_input_transformer_quotes_bare_strings_and_keeps_text_inside_strings() -> None:
    event = {"time": "2026-01-01T00:00:00Z", "detail": {"name": "job-1", "size": 3, "tags": ["a"]}}
    rendered = events.apply_input_transformer(
        '{"name": <name>, "size": <size>, "tags": <tags>, "text": "job <name> has \\"<size>\\" items"}',
        {"name": "$.detail.name", "size": "$.detail.size", "tags": "$.detail.tags"},
        event,
    )
    assert rendered == {"name": "job-1", "size": 3, "tags": ["a"], "text": 'job job-1 has "3" items'}
    assert events.apply_input_transformer("job <name> ended", {"name": "$.detail.name"}, event) == "job job-1 ended"


def test_patch_rule_starts_state_machine_with_constant_input(runtime: runtime_module.Runtime) -> None:
    sfn = client("stepfunctions")
    machine = sfn.create_state_machine(
        name="m", definition=json.dumps({"StartAt": "P", "States": {"P": {"Type": "Pass", "End": True}}}), roleArn=ROLE
    )["stateMachineArn"]
    rule_with_target({"Arn": machine, "Input": '{"from": "rule"}'}, {"source": ["demo"], "detail": {"n": [1]}})
    client("events").put_events(
        Entries=[
            {"Source": "demo", "DetailType": "d", "Detail": json.dumps({"n": 2})},
            {"Source": "demo", "DetailType": "d", "Detail": json.dumps({"n": 1})},
        ]
    )
    [execution] = sfn.list_executions(stateMachineArn=machine)["executions"]
    assert json.loads(sfn.describe_execution(executionArn=execution["executionArn"])["input"]) == {"from": "rule"}


# ------------------------------------------------------------------------------------ (c) CloudFormation


# ------------------------------------------------------------------------------------ PutEvents and aws.* sources


def _queue_for(pattern: dict[str, object], name: str = "seen") -> str:
    queue_url = str(client("sqs").create_queue(QueueName=name)["QueueUrl"])
    client("events").put_rule(Name=name, EventPattern=json.dumps(pattern))
    client("events").put_targets(Rule=name, Targets=[{"Id": "q", "Arn": f"arn:aws:sqs:{REGION}:{ACCOUNT}:{name}"}])
    return queue_url


def _bodies(queue_url: str) -> list[dict[str, object]]:
    messages = client("sqs").receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10).get("Messages", [])
    return [json.loads(m["Body"]) for m in messages]


def test_put_events_aws_source_entry_refused_others_published(runtime: runtime_module.Runtime) -> None:
    queue_url = _queue_for({"source": ["aws.sagemaker", "demo"]})
    spoofed = {"Source": "aws.sagemaker", "DetailType": "SageMaker Training Job State Change", "Detail": "{}"}
    answer = client("events").put_events(Entries=[spoofed, {"Source": "demo", "DetailType": "d", "Detail": "{}"}])
    assert answer["FailedEntryCount"] == 1
    assert answer["Entries"][0] == {
        "ErrorCode": "NotAuthorizedForSourceException",
        "ErrorMessage": "Not authorized for the source.",
    }
    assert "EventId" in answer["Entries"][1]
    assert [body["source"] for body in _bodies(queue_url)] == ["demo"]


def test_local_publishers_still_publish_aws_sources(runtime: runtime_module.Runtime) -> None:
    from moto.events.models import events_backends

    queue_url = _queue_for({"source": ["aws.states"]})
    entry = {"Source": "aws.states", "DetailType": "Step Functions Execution Status Change", "Detail": "{}"}
    [result] = events_backends[ACCOUNT][REGION].put_events([entry])
    assert "EventId" in result
    assert [body["source"] for body in _bodies(queue_url)] == ["aws.states"]
