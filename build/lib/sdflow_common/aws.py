"""boto3 clients created lazily and cached per process.

Lazily, so that tests can import a handler before moto's mock starts; cached, because a warm
Lambda should reuse its connections. boto3 honours AWS_ENDPOINT_URL itself, which is how the
local runtime points every function at the local cloud."""

from __future__ import annotations

import functools
from typing import Any

import boto3


@functools.cache
def client(service_name: str) -> Any:
    return boto3.session.Session().client(service_name)  # type: ignore[call-overload]


def reset_clients() -> None:
    """Forget cached clients (tests call this between moto mocks)."""
    client.cache_clear()
