"""SageMaker's server-side request limits, enforced by the local cloud at each Create call.

The walker itself is the layer's (sdflow_common.request_limits: Validate run checks every request a run
will make with it before anything starts); here it answers as AWS does, with a ValidationException,
reading the service model through the local cloud's shared loader (sdflow.local.sessions)."""

from __future__ import annotations

import functools
from typing import Any

from moto.core.exceptions import JsonRESTError

from sdflow_common import request_limits


class SageMakerValidationError(JsonRESTError):
    """SageMaker's ValidationException (HTTP 400)."""

    def __init__(self, problems: list[str]) -> None:
        count = len(problems)
        super().__init__(
            "ValidationException",
            f"{count} validation error{'s' if count > 1 else ''} detected: " + "; ".join(problems),
        )


@functools.cache
def _model() -> Any:
    from sdflow.local import sessions

    return sessions.botocore_session().get_service_model("sagemaker")


def check(operation: str, request: dict[str, Any]) -> None:
    """Raise SageMaker's ValidationException when `request` breaks a maximum or a pattern of
    `operation`'s input shape."""
    found = request_limits.problems(_model().operation_model(operation).input_shape, request)
    if found:
        raise SageMakerValidationError(found)
