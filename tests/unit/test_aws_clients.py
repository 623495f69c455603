"""sdflow_common.aws: the functions' boto3 clients, cached per process."""

from __future__ import annotations

from typing import Any

import boto3
import pytest

from sdflow_common import aws


def test_clients_of_several_services_come_from_one_session_until_reset(
    aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    sessions: list[boto3.session.Session] = []
    real_session = boto3.session.Session

    def counted(*args: Any, **kwargs: Any) -> boto3.session.Session:
        sessions.append(real_session(*args, **kwargs))
        return sessions[-1]

    monkeypatch.setattr(boto3.session, "Session", counted)
    aws.reset_clients()
    try:
        s3 = aws.client("s3")
        aws.client("dynamodb")
        aws.client("stepfunctions")
        assert aws.client("s3") is s3
        assert len(sessions) == 1, "a session per client reads the endpoint rules again for each"

        aws.reset_clients()
        assert aws.client("s3") is not s3
        assert len(sessions) == 2
    finally:
        aws.reset_clients()
