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
- Reserved concurrency is refused when it would leave the account's unreserved concurrency
  under its minimum: "You can reserve up to the Unreserved account concurrency value minus 100"
  (Lambda developer guide, "Configuring reserved concurrency"). Below a quota of 100 (a new
  account's can be 10 or 50) the minimum AWS quotes is the quota itself, so no reservation at all
  fits: InvalidParameterValueException, HTTP 400, "Specified ReservedConcurrentExecutions for
  function decreases account's UnreservedConcurrentExecution below its minimum value of [10]."
  (the figure as AWS answers it in such accounts; the guide documents only the 100). Checked at
  CreateFunction (CloudFormation's path too) and PutFunctionConcurrency against the runtime's
  `lambda_account_concurrency` (AWS's default quota, 1,000, unless a test sets another); moto
  checks only PutFunctionConcurrency, only with MOTO_LAMBDA_CONCURRENCY_QUOTA, always against 100.
Memory is not enforced: MemorySize reaches the handler (context.memory_limit_in_mb,
AWS_LAMBDA_FUNCTION_MEMORY_SIZE) but the worker process may use more; CPU share is not scaled."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

from moto.core.exceptions import JsonRESTError

from sdflow.local.lambda_concurrency import ConcurrencyLimitExceeded, reserved_concurrency
from sdflow.local.patching import Patch, replace, wrap
from sdflow.local.runtime import runtime_or_none

# Lambda's default "Concurrent executions" quota, and the unreserved concurrency a reservation must leave.
DEFAULT_ACCOUNT_CONCURRENCY = 1_000
UNRESERVED_MINIMUM = 100
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


class ReservationTooLarge(JsonRESTError):
    code = 400

    def __init__(self, minimum: int) -> None:
        super().__init__(
            "InvalidParameterValueException",
            "Specified ReservedConcurrentExecutions for function decreases account's UnreservedConcurrentExecution "
            f"below its minimum value of [{minimum}].",
        )


def unreserved_minimum(account_concurrency: int) -> int:
    return min(UNRESERVED_MINIMUM, account_concurrency)


def check_reservation(backend: Any, function_name: str, reserved: Any) -> None:
    """Refuse `reserved` for `function_name` when the account's other reservations and it leave
    less unreserved concurrency than the minimum (module docstring)."""
    if reserved is None:
        return
    runtime = runtime_or_none()
    account = runtime.lambda_account_concurrency if runtime is not None else DEFAULT_ACCOUNT_CONCURRENCY
    others = sum(
        int(fn.reserved_concurrency)
        for fn in backend.list_functions()
        if fn.reserved_concurrency is not None and fn.function_name != function_name
    )
    minimum = unreserved_minimum(account)
    if account - others - int(reserved) < minimum:
        raise ReservationTooLarge(minimum)


def create_function_checked(inner: Any, self: Any, spec: dict[str, Any]) -> Any:
    """Wraps moto/awslambda/models.py LambdaBackend.create_function: the account's reservation rule."""
    check_reservation(self, str(spec.get("FunctionName", "")), spec.get("ReservedConcurrentExecutions"))
    return inner(self, spec)


def put_function_concurrency_checked(inner: Any, self: Any, function_name: str, reserved_concurrency: Any) -> Any:
    """Wraps moto/awslambda/models.py LambdaBackend.put_function_concurrency: the same rule, whatever
    MOTO_LAMBDA_CONCURRENCY_QUOTA says."""
    check_reservation(self, self.get_function(function_name).function_name, reserved_concurrency)
    return inner(self, function_name, reserved_concurrency)


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
    from moto.awslambda.models import LambdaBackend
    from moto.awslambda.responses import LambdaResponse

    return [
        replace(LambdaResponse, "invoke", lambda_response_invoke),
        wrap(LambdaBackend, "create_function", create_function_checked),
        wrap(LambdaBackend, "put_function_concurrency", put_function_concurrency_checked),
    ]
