"""SageMaker Runtime: InvokeEndpoint answered by the endpoint's local serving process, errors with AWS's status codes.

The earlier patch returned (400, headers, body) tuples, but moto's BaseResponse.call_action
(_transform_response) takes the status from headers["status"] and ignores the tuple's first
element, so every error went out as HTTP 200 with the error as the body: `aws
sagemaker-runtime invoke-endpoint` exited 0 and boto3 returned the error JSON as the image.
Errors are now raised as moto JSON errors (HTTPException), which call_action sends with their
status. The codes and members are those of botocore's sagemaker-runtime model for InvokeEndpoint:
- ValidationError 400: no such endpoint ("Endpoint <name> of account <account> not found."), or
  an endpoint that is not InService / Updating;
- ModelError 424: the container answered 4xx/5xx; OriginalStatusCode, OriginalMessage (its
  body) and LogStreamArn (its CloudWatch log group), message "Received client|server error
  (<code>) from primary with message "<body>". See <console URL> in account <account> for more
  information.";
- ServiceUnavailable 503: the serving process did not answer (died, hung, or is gone);
- ModelNotReadyException 429 is for serverless and multi-model endpoints, which the local
  SageMaker does not run, so it is never answered."""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote

from moto.core.exceptions import JsonRESTError

from sdflow.local.patching import Patch, wrap
from sdflow.local.runtime import current_runtime


class InvokeEndpointError(JsonRESTError):
    """A SageMaker Runtime error with extra members in its JSON body."""

    def __init__(self, code: str, status: int, message: str, **members: Any) -> None:
        super().__init__(code, message)
        self.code = status
        self.description = json.dumps({"__type": code, "message": message, **members})


def _log_group(region: str, account: str, endpoint: str) -> tuple[str, str]:
    group = f"/aws/sagemaker/Endpoints/{endpoint}"
    console = f"https://{region}.console.aws.amazon.com/cloudwatch/home?region={region}#logEventViewer:group={group}"
    return f"arn:aws:logs:{region}:{account}:log-group:{group}", console


def model_error(region: str, account: str, endpoint: str, status: int, body: bytes) -> InvokeEndpointError:
    original_message = body.decode("utf-8", errors="replace")
    log_stream_arn, console = _log_group(region, account, endpoint)
    side = "client" if status < 500 else "server"
    return InvokeEndpointError(
        "ModelError",
        424,
        f'Received {side} error ({status}) from primary with message "{original_message}". See {console} '
        f"in account {account} for more information.",
        OriginalStatusCode=status,
        OriginalMessage=original_message,
        LogStreamArn=log_stream_arn,
    )


def sagemaker_runtime_invoke_endpoint(inner: Any, self: Any) -> Any:
    """Wraps moto/sagemakerruntime/responses.py SageMakerRuntimeResponse.invoke_endpoint.

    moto answers placeholders; here the request goes to the endpoint's local serving process
    (LocalSageMaker.invoke_endpoint), and errors carry AWS's codes (module docstring)."""
    sagemaker = current_runtime().sagemaker
    if sagemaker is None:
        return inner(self)
    from moto.sagemaker.models import sagemaker_backends

    match = re.search(r"/endpoints/([^/]+)/invocations", self.path)
    name = unquote(match.group(1)) if match else ""
    account, region = self.current_account, self.region
    endpoint = sagemaker_backends[account][region].endpoints.get(name)
    if endpoint is None:
        raise InvokeEndpointError("ValidationError", 400, f"Endpoint {name} of account {account} not found.")
    if endpoint.endpoint_status not in ("InService", "Updating"):
        raise InvokeEndpointError(
            "ValidationError",
            400,
            f"Endpoint {name} of account {account} is not in service (status {endpoint.endpoint_status}).",
        )
    content_type = self.headers.get("Content-Type") or "application/json"
    accept = self.headers.get("Accept") or "*/*"
    body = self.body if isinstance(self.body, bytes) else (self.body or "").encode()
    try:
        answer, answer_type = sagemaker.invoke_endpoint(name, body, content_type, accept)
    except Exception as exc:
        status = getattr(exc, "status", None)  # sdflow.local.sagemaker.engine.ContainerError
        if isinstance(status, int):
            raise model_error(region, account, name, status, getattr(exc, "body", b"")) from None
        raise InvokeEndpointError(
            "ServiceUnavailable", 503, f"Endpoint {name}: the model container did not answer ({exc})."
        ) from None
    return 200, {"Content-Type": answer_type, "x-Amzn-Invoked-Production-Variant": "AllTraffic"}, answer


def patches() -> list[Patch]:
    from moto.sagemakerruntime.responses import SageMakerRuntimeResponse

    return [wrap(SageMakerRuntimeResponse, "invoke_endpoint", sagemaker_runtime_invoke_endpoint)]
