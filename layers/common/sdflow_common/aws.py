"""boto3 clients created lazily and cached per process.

Lazily, so that tests can import a handler before moto's mock starts; cached, because a warm
Lambda should reuse its connections. All from one session, which reads the endpoint rules and
each service's model once: a session per client read them again for every client, ~0.4 s more
CPU in a cold start making four. boto3 honours AWS_ENDPOINT_URL itself, which is how the local
runtime points every function at the local cloud."""

from __future__ import annotations

import functools
import threading
from typing import Any

import boto3

_session_lock = threading.Lock()


@functools.cache
def _session() -> boto3.session.Session:
    return boto3.session.Session()


@functools.cache
def client(service_name: str) -> Any:
    with _session_lock:  # a session is not safe to share between threads; the clients it makes are
        return _session().client(service_name)  # type: ignore[call-overload]


def reset_clients() -> None:
    """Forget cached clients and their session (tests call this between moto mocks)."""
    client.cache_clear()
    _session.cache_clear()


def read_range(bucket: str, key: str, first: int, last: int) -> bytes:
    """Bytes `first`..`last` (inclusive, HTTP Range) of an S3 object: what intake reads of a model's
    config files and weight headers, without fetching the weights."""
    body = client("s3").get_object(Bucket=bucket, Key=key, Range=f"bytes={first}-{last}")
    return bytes(body["Body"].read())
