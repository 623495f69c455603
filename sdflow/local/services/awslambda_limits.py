"""Lambda's invocation limits at the Invoke API: payload sizes and reserved concurrency.

As AWS documents them (Lambda API reference, Invoke; Lambda quotas):
- A synchronous (RequestResponse) request body over 6 MB (6,291,456 bytes) and an asynchronous
  (Event) one over 1 MB (1,048,576 bytes; it was 256 KB until 2025) are refused with
  RequestEntityTooLargeException, HTTP 413, "<n> byte payload is too large for the <type>
  invocation type (limit <limit> bytes)".
- A synchronous response over 6,291,556 bytes (the figure Lambda's own message quotes) is a
  function error: HTTP 200, X-Amz-Function-Error Unhandled, body {"errorMessage": "Response
  payload size exceeded maximum allowed payload size (6291556 bytes).", "errorType":
  "Function.ResponseSizeTooLarge"}. moto checks sys.getsizeof(payload) > 6,000,000 instead,
  which fails responses AWS accepts, so LambdaResponse.invoke is replaced here.
- Reserved concurrency (sdflow/local/lambda_concurrency.py): a synchronous invocation past it gets
  TooManyRequestsException, HTTP 429, {"Reason": "ReservedFunctionConcurrentInvocationLimitExceeded",
  "Type": "User", "message": "Rate Exceeded."}; asynchronous events wait (awslambda.py).
Memory is not enforced: MemorySize reaches the handler (context.memory_limit_in_mb,
AWS_LAMBDA_FUNCTION_MEMORY_SIZE) but the worker process may use more; CPU share is not scaled."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

from moto.core.exceptions import JsonRESTError

from sdflow.local.lambda_concurrency import ConcurrencyLimitExceeded, reserved_concurrency
from sdflow.local.patching import Patch, replace
from sdflow.local.runtime import runtime_or_none

SYNC_REQUEST_LIMIT = 6_291_456
ASYNC_REQUEST_LIMIT = 1_048_576
RESPONSE_LIMIT = 6_291_556
RESPONSE_TOO_LARGE = {
    "errorMessage": f"Response payload size exceeded maximum allowed payload size ({RESPONSE_LIMIT} bytes).",
    "errorType": "Function.ResponseSizeTooLarge",
}


class RequestEntityTooLargeException(JsonRESTError):
    code = 413

    def __init__(self, size: int, invocation_type: str, limit: int) -> None:
        super().__init__(
            "RequestEntityTooLargeException",
            f"{size} byte payload is too large for the {invocation_type} invocation type (limit {limit} bytes)",
        )


class TooManyRequestsException(JsonRESTError):
    code = 429

    def __init__(self) -> None:
        super().__init__("TooManyRequestsException", "Rate Exceeded.")
        self.description = json.dumps(
            {
                "__type": "TooManyRequestsException",
                "Reason": "ReservedFunctionConcurrentInvocationLimitExceeded",
                "Type": "User",
                "message": "Rate Exceeded.",
            }
        )

    def get_headers(self, *args: Any, **kwargs: Any) -> list[tuple[str, str]]:
        return [*super().get_headers(*args, **kwargs), ("Retry-After", "1")]


def check_request_size(payload: bytes, invocation_type: str) -> None:
    limit = ASYNC_REQUEST_LIMIT if invocation_type == "Event" else SYNC_REQUEST_LIMIT
    if len(payload) > limit:
        raise RequestEntityTooLargeException(len(payload), invocation_type, limit)


def concurrency_key(fn: Any) -> str:
    return f"{fn.account_id}:{fn.region}:{fn.function_name}"


def lambda_response_invoke(self: Any) -> tuple[int, dict[str, str], str | bytes]:
    """Replaces moto/awslambda/responses.py LambdaResponse.invoke (see the module docstring)."""
    response_headers: dict[str, str] = {}
    function_name = unquote(self.path.rsplit("/", 2)[-2])
    qualifier = self._get_param("qualifier")
    invocation_type = self.headers.get("X-Amz-Invocation-Type") or "RequestResponse"
    body = self.body if isinstance(self.body, bytes) else (self.body or "").encode()
    check_request_size(body, invocation_type)
    runtime = runtime_or_none()
    if invocation_type == "RequestResponse" and runtime is not None:
        fn = self.backend.get_function(function_name, qualifier)
        try:
            with runtime.lambda_concurrency.slot(concurrency_key(fn), reserved_concurrency(fn), wait=False):
                payload = self.backend.invoke(function_name, qualifier, self.body, self.headers, response_headers)
        except ConcurrencyLimitExceeded:
            raise TooManyRequestsException() from None
    else:
        payload = self.backend.invoke(function_name, qualifier, self.body, self.headers, response_headers)
    if payload is None:
        return 404, response_headers, "{}"
    if invocation_type == "RequestResponse" and len(payload) > RESPONSE_LIMIT:
        payload = json.dumps(RESPONSE_TOO_LARGE).encode()
        response_headers["x-amz-function-error"] = "Unhandled"
        response_headers["Content-Length"] = str(len(payload))
    response_headers["content-type"] = "application/json"
    status = {"Event": 202, "DryRun": 204}.get(invocation_type, 200)
    if status != 200:
        response_headers["status"] = str(status)
    elif self.headers.get("X-Amz-Log-Type") != "Tail":
        response_headers.pop("x-amz-log-result", None)
    return status, response_headers, payload


def patches() -> list[Patch]:
    from moto.awslambda.responses import LambdaResponse

    return [replace(LambdaResponse, "invoke", lambda_response_invoke)]
