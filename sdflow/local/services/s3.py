"""S3: "Object Created" / "Object Deleted" events on EventBridge, shaped as S3 sends them.

moto/s3/notifications.py _send_event_bridge_message copies one template event, so every event
carries the same `id` (AWS: "id - A UUID generated for every event", S3 user guide, EventBridge
event message structure); it puts the key in unencoded, spells `eTag`, gives `reason` as
"ObjectCreated" (AWS: "PutObject", "CopyObject", "CompleteMultipartUpload", "PostObject"),
delivers to the rules of every bus (S3 sends to the account's default bus only) and swallows
every error with a bare `except`. Here the event goes through the events backend's PutEvents
path (a fresh id per event, the default bus, the local rule delivery) with AWS's detail fields.

The object key is URL-encoded as S3 encodes keys in its event notifications ("red flower.jpg"
becomes "red+flower.jpg"; UTF-8 bytes as %XX), which is also what consumers of the EventBridge
form decode: Powertools' S3EventBridgeNotificationObject.key applies unquote_plus. '/' stays as
is; ':' too, as in S3 EventBridge events seen in the wild ("raw/…/2023-08-08T14:03:40.zip").

ListObjectVersions: moto's S3Backend.list_object_versions deep-copies every version of every key
in the bucket on each call (to set `is_latest` on the copies), whatever the prefix and the page.
A deep copy of a FakeKey copies the object's bytes into a new buffer, and moto's BaseModel
records every instance it creates in `FakeKey.instances_tracked` for its reset: the copies are
never freed. Listing 10,000 parquet files in pages of 1,000 (sdflow_common.resume) kept ten copies
of every file: +580 MB in the local cloud at a 10,000-shard run's Map start (a tracemalloc/gc
census, bench/bench_local_runtime.py). Here a deep copy of a key is a listing view instead: the
key's attributes without its bytes, not tracked, so it is freed with the listing."""

from __future__ import annotations

import json
import logging
import secrets
import string
import time
from typing import Any
from urllib.parse import quote_plus

from sdflow.local.patching import Patch, add, replace

log = logging.getLogger(__name__)

KEY_SAFE = "/:"
CREATED_REASONS = {
    "Put": "PutObject",
    "Post": "PostObject",
    "Copy": "CopyObject",
    "CompleteMultipartUpload": "CompleteMultipartUpload",
}


def event_key(key: str) -> str:
    """The object key as it appears in an S3 event."""
    return quote_plus(key, safe=KEY_SAFE)


def _sequencer() -> str:
    # S3's sequencer: a hex string that grows with each event of a key; time does that locally.
    return f"{time.time_ns():018X}"


def _request_id() -> str:
    return "".join(secrets.choice(string.ascii_uppercase + string.digits) for _ in range(16))


def _detail(account_id: str, bucket: Any, event_name: Any, key: Any) -> tuple[str, dict[str, Any]] | None:
    """(detail-type, detail) for an object event, or None for kinds not emulated."""
    # S3NotificationEvent is a str Enum: str() of it is its member name, .value "s3:ObjectCreated:Put".
    event_name = str(getattr(event_name, "value", event_name))
    action = event_name.split(":")[-1]
    obj: dict[str, Any] = {"key": event_key(key.name)}
    detail: dict[str, Any] = {"version": "0", "bucket": {"name": bucket.name}, "object": obj}
    if ":ObjectCreated:" in event_name:
        detail_type = "Object Created"
        obj["size"] = key.size
        obj["etag"] = key.etag.replace('"', "")
        if getattr(bucket, "is_versioned", False) and key.version_id:
            obj["version-id"] = key.version_id
        reason = CREATED_REASONS.get(action, f"{action}Object")
    elif ":ObjectRemoved:" in event_name:
        detail_type = "Object Deleted"
        marker = action == "DeleteMarkerCreated"
        detail["deletion-type"] = "Delete Marker Created" if marker else "Permanently Deleted"
        reason = "DeleteObject"
    else:
        return None
    obj["sequencer"] = _sequencer()
    detail.update(
        {
            "request-id": _request_id(),
            "requester": account_id,
            "source-ip-address": "127.0.0.1",
            "reason": reason,
        }
    )
    return detail_type, detail


def send_event_bridge_message(account_id: str, bucket: Any, event_name: Any, key: Any) -> None:
    """Replaces moto/s3/notifications.py _send_event_bridge_message (see the module docstring)."""
    from moto.events.models import events_backends

    try:
        shaped = _detail(account_id, bucket, event_name, key)
        if shaped is None:
            return
        detail_type, detail = shaped
        entry = {
            "Source": "aws.s3",
            "DetailType": detail_type,
            "Detail": json.dumps(detail),
            "Resources": [f"arn:aws:s3:::{bucket.name}"],
        }
        [result] = events_backends[account_id][bucket.region_name].put_events([entry])
        if "ErrorCode" in result:
            log.error("S3 event for s3://%s/%s not published: %s", bucket.name, key.name, result)
    except Exception:
        # Delivery is asynchronous on AWS: the upload succeeds whatever happens to its event.
        log.exception("S3 event for s3://%s/%s not published", bucket.name, getattr(key, "name", "?"))


def listing_view(key: Any, memo: dict[int, Any]) -> Any:
    """FakeKey.__deepcopy__ (moto has none; see the module docstring): the key's attributes, for
    list_object_versions to mark `is_latest` on and render, without its bytes or its lock."""
    _ = key.etag  # computed from the bytes once and kept on the key: the view has no bytes
    view = object.__new__(type(key))  # not BaseModel.__new__: a view is not tracked for reset
    view.__dict__.update(key.__dict__)
    # The buffer stays the key's: a view's dispose (FakeKey.__del__) must find nothing to close.
    view.__dict__.update(_value_buffer=None, multipart=None, disposed=True)
    memo[id(key)] = view
    return view


def patches() -> list[Patch]:
    from moto.s3 import notifications
    from moto.s3.models import FakeKey

    return [
        replace(notifications, "_send_event_bridge_message", send_event_bridge_message),
        add(FakeKey, "__deepcopy__", listing_view),
    ]
