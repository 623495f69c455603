"""S3's EventBridge events: a fresh id per event, AWS's detail fields, keys encoded as S3 encodes them."""

from __future__ import annotations

import gc
import json
from typing import Any
from urllib.parse import unquote_plus

from sdflow.local import runtime as runtime_module
from sdflow.local.services import s3
from tests.constants import ACCOUNT, REGION
from tests.unit.local.helpers import client


def _object_events(bucket: str) -> str:
    client("s3").put_bucket_notification_configuration(
        Bucket=bucket, NotificationConfiguration={"EventBridgeConfiguration": {}}
    )
    queue_url = str(client("sqs").create_queue(QueueName="s3-events")["QueueUrl"])
    events = client("events")
    events.put_rule(Name="s3", EventPattern=json.dumps({"source": ["aws.s3"]}))
    events.put_targets(Rule="s3", Targets=[{"Id": "q", "Arn": f"arn:aws:sqs:{REGION}:{ACCOUNT}:s3-events"}])
    return queue_url


def _received(queue_url: str) -> list[dict[str, Any]]:
    messages = client("sqs").receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10).get("Messages", [])
    return [json.loads(m["Body"]) for m in messages]


def test_moto_gap_every_s3_event_has_the_same_id(aws: None) -> None:
    client("s3").create_bucket(Bucket="data")
    queue_url = _object_events("data")
    for _ in range(2):
        client("s3").put_object(Bucket="data", Key="a.json", Body=b"{}")
    ids = {event["id"] for event in _received(queue_url)}
    assert len(ids) == 1


def test_object_created_events_unique_ids_and_encoded_keys(runtime: runtime_module.Runtime) -> None:
    client("s3").create_bucket(Bucket="data")
    queue_url = _object_events("data")
    key = "manifests/my run é+1.json"
    for _ in range(2):
        client("s3").put_object(Bucket="data", Key=key, Body=b"{}")
    first, second = _received(queue_url)
    assert first["id"] != second["id"]
    assert (first["detail-type"], first["source"], first["resources"]) == (
        "Object Created",
        "aws.s3",
        ["arn:aws:s3:::data"],
    )
    detail = first["detail"]
    assert detail["object"]["key"] == "manifests/my+run+%C3%A9%2B1.json"
    assert unquote_plus(detail["object"]["key"]) == key
    assert detail["reason"] == "PutObject"
    assert detail["object"]["size"] == 2
    assert "etag" in detail["object"]
    assert "eTag" not in detail["object"]
    assert detail["object"]["sequencer"] < second["detail"]["object"]["sequencer"]
    assert detail["requester"] == ACCOUNT


def test_event_key_keeps_slashes_and_colons() -> None:
    assert s3.event_key("raw/2023-08-08T14:03:40.zip") == "raw/2023-08-08T14:03:40.zip"
    assert s3.event_key("a b/c=d") == "a+b/c%3Dd"


def _versions_listed(bucket: str, prefix: str) -> list[dict[str, Any]]:
    pages = (
        client("s3")
        .get_paginator("list_object_versions")
        .paginate(Bucket=bucket, Prefix=prefix, PaginationConfig={"PageSize": 3})
    )
    return [version for page in pages for version in page.get("Versions", [])]


def _tracked_keys() -> int:
    from moto.s3.models import FakeKey

    return len(FakeKey.instances_tracked)  # type: ignore[attr-defined]


def test_moto_gap_list_object_versions_keeps_a_copy_of_every_key_per_page(aws: None) -> None:
    client("s3").create_bucket(Bucket="data")
    for i in range(10):
        client("s3").put_object(Bucket="data", Key=f"parts/{i}.parquet", Body=b"x" * 1000)
    before = _tracked_keys()
    assert len(_versions_listed("data", "parts/")) == 10
    assert _tracked_keys() - before >= 10 * 4, "four pages, each a tracked copy of every key"


def test_list_object_versions_pages_leave_no_copies_and_answer_as_before(runtime: runtime_module.Runtime) -> None:
    s3_client = client("s3")
    s3_client.create_bucket(Bucket="data")
    s3_client.put_bucket_versioning(Bucket="data", VersioningConfiguration={"Status": "Enabled"})
    for i in range(10):
        s3_client.put_object(Bucket="data", Key=f"parts/{i}.parquet", Body=b"x" * 1000)
    s3_client.put_object(Bucket="data", Key="parts/3.parquet", Body=b"second version")
    s3_client.put_object(Bucket="data", Key="other/a", Body=b"a")
    before = _tracked_keys()

    listed = _versions_listed("data", "parts/")

    assert _tracked_keys() == before, "the listing's copies are views, freed with it"
    assert len(listed) == 11
    third = [v for v in listed if v["Key"] == "parts/3.parquet"]
    assert [v["IsLatest"] for v in third] == [True, False]
    assert third[0]["Size"] == len(b"second version")
    assert third[0]["ETag"] == s3_client.head_object(Bucket="data", Key="parts/3.parquet")["ETag"]
    gc.collect()  # the views are gone: the keys' bytes must still be there
    assert s3_client.get_object(Bucket="data", Key="parts/3.parquet")["Body"].read() == b"second version"
    assert s3_client.get_object(Bucket="data", Key="parts/7.parquet")["Body"].read() == b"x" * 1000
