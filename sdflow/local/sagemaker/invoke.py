"""SageMaker Runtime: InvokeEndpoint answered by the endpoint's local serving process, errors with AWS's status codes.

The earlier patch returned (400, headers, body) tuples, but moto's BaseResponse.call_action
(_transform_response) takes the status from headers["status"] and ignores the tuple's first
element, so every error went out as HTTP 200 with the error as the body: `aws
sagemaker-runtime invoke-endpoint` exited 0 and boto3 returned the error JSON as the image.
Errors are now raised as moto JSON errors (HTTPException), which call_action sends with their
status.

What AWS documents, and where it was looked up:
- The errors of InvokeEndpoint (SageMaker API reference, "InvokeEndpoint" > Errors; botocore's
  sagemaker-runtime service model, the same list): ValidationError 400, ModelError 424 ("Model
  (owned by the customer in the container) returned 4xx or 5xx error code."), ModelNotReadyException
  429 (serverless endpoints still provisioning, multi-model endpoints still loading the model),
  ServiceUnavailable 503, InternalFailure 500, InternalDependencyException 530.
- So every 4xx/5xx of the container, its 429 and 503 included, is ModelError 424 with
  OriginalStatusCode (its status), OriginalMessage (its body) and LogStreamArn (its log group),
  message "Received client|server error (<code>) from primary with message "<body>". See <console
  URL> in account <account> for more information." No header of the container's answer is kept:
  a container's Retry-After reaches the caller only inside OriginalMessage, if the container put
  it in its body (so the serve container does: `retry_after_s`). This matches what vendors
  running on SageMaker document (e.g. Sarvam's "Error handling on SageMaker": "any error the
  container returns is collapsed ... into a ModelError (HTTP 424) ... its Retry-After header is
  dropped"), and the ModelError threads of aws/amazon-sagemaker-examples and
  aws/sagemaker-python-sdk ("Received server error (500) from primary ...").
- SageMaker's own throttling (its concurrency limit per endpoint, before the container) is
  ThrottlingException, HTTP 400 (SageMaker API reference, "Common Errors"; seen as "Status Code:
  400; Error Code: ThrottlingException" in aws/amazon-kinesis-video-streams-parser-library#187
  and opensearch-project/ml-commons#2429). The container has no way to ask for it.
- Which of these the SDKs retry (the AWS SDKs and Tools reference guide, "Retry behavior"; the
  AWS SDK for Python guide, "Retries": socket failures, HTTP 500, 502, 503 and 504, and the error
  codes it knows as transient or throttling; botocore 1.44's retries/standard.py and
  data/_retry.json, read here): ServiceUnavailable (503), ThrottlingException, and a 429 that is
  not a modeled error. ModelError (424) is never retried, nor is
  ModelNotReadyException in standard mode (modeled, not marked retryable). A container that
  refuses work therefore makes the caller see a ModelError with OriginalStatusCode 429 that it
  must retry itself, after OriginalMessage's retry_after_s; ServiceUnavailable 503 is answered
  here only when the serving process is gone (died, or refuses connections).
- A container that does not answer within 60 s ("A customer's model containers must respond to
  requests within 60 seconds.", InvokeEndpoint API reference) is ModelError 424 too, with
  OriginalStatusCode 0: 'Received server error (0) from primary with message "Your invocation
  timed out while waiting for a response from container primary. Review the latency metrics for
  each container in Amazon CloudWatch, resolve the issue, and try again."' (as quoted in
  aws/amazon-sagemaker-examples#799 and aws-samples/host-yolov8-on-sagemaker-endpoint#21).
- The request body: at most 6 MB, Body "Maximum length of 6291456" (InvokeEndpoint API reference;
  BodyBlob max 6291456 in botocore's model, which botocore does not enforce; AWS re:Post's answer
  on "Received client error (413) from primary": "the payload size for the endpoint invocation
  exceeds the limit of 6 MB"). SageMaker's front end refuses a longer body before any
  endpoint lookup with HTTP 413, no error code and the plain-text message "HTTP content length
  exceeded <n> bytes." (aws/sagemaker-python-sdk#171, at the old 5 MB limit:
  "An error occurred (413) when calling the InvokeEndpoint operation: HTTP content length exceeded
  5246976 bytes."; botocore names the error by its status when the body has none). The <n> here
  is the documented 6291456; the front end's exact figure today is not documented. A body within
  the limit goes to the container whole; one the container refuses by its length before reading it
  is the container's answer, ModelError 424 with OriginalStatusCode 413 (container_http.py).
- The body is "Provides input data, in the format specified in the ContentType request header.
  Amazon SageMaker passes all of the data in the body to the model" (InvokeEndpoint API reference,
  Body): any bytes, any content type, reach the container unread; what the container refuses is
  its answer, as ModelError. moto's front end decoded every body as UTF-8 (a PNG body was an HTML
  500 from the server), parsed a form content type into parameters (the body lost), and chose the
  operation by the body's content type (a form or application/x-amz-json-1.1 body matched no
  operation: an empty 404): `sagemaker_runtime_setup_class` keeps the bytes as they came and
  `sagemaker_runtime_get_action` routes by method and path alone, in the service's own protocol.
The local SageMaker runs neither serverless nor multi-model endpoints, so ModelNotReadyException
is never answered."""

from __future__ import annotations

import functools
import json
import re
from typing import Any
from urllib.parse import unquote

from moto.core.exceptions import JsonRESTError
from werkzeug.datastructures import ImmutableMultiDict

from sdflow.local.patching import Patch, wrap
from sdflow.local.runtime import PatchError, current_runtime

BODY_LIMIT_BYTES = 6_291_456  # InvokeEndpoint's Body: "Maximum length of 6291456"


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
    side = "client" if 400 <= status < 500 else "server"  # a timeout is "server error (0)"
    return InvokeEndpointError(
        "ModelError",
        424,
        f'Received {side} error ({status}) from primary with message "{original_message}". See {console} '
        f"in account {account} for more information.",
        OriginalStatusCode=status,
        OriginalMessage=original_message,
        LogStreamArn=log_stream_arn,
    )


def body_too_large(size: int) -> tuple[int, dict[str, Any], str]:
    """The front end's answer to a body over the limit: 413, plain text, no error code."""
    message = f"HTTP content length exceeded {BODY_LIMIT_BYTES} bytes."
    return 413, {"status": 413, "Content-Type": "text/plain", "Content-Length": str(len(message))}, message


def sagemaker_runtime_setup_class(inner: Any, self: Any, request: Any, *args: Any, **kwargs: Any) -> None:
    """Wraps moto/core/responses.py BaseResponse.setup_class for SageMakerRuntimeResponse.

    The body is the model's input, not the API's parameters (module docstring): read before moto
    looks at it, kept as bytes, never decoded nor parsed as a form (InvokeEndpoint's members are in
    its path and headers)."""
    body = request.get_data(cache=True)  # the form parser, if anything asks, reads this cache
    vars(request)["form"] = ImmutableMultiDict()  # werkzeug's cached properties: no form, no files
    vars(request)["files"] = ImmutableMultiDict()
    kwargs["use_raw_body"] = True
    inner(self, request, *args, **kwargs)
    self.body = self.raw_body = body


@functools.cache
def _runtime_router() -> Any:
    from moto.core.routing import get_router_class
    from moto.core.utils import get_service_model

    model = get_service_model("sagemaker-runtime")
    router_class = get_router_class(model.service_name, model.protocol)
    if router_class is None:
        raise PatchError(f"moto has no router for sagemaker-runtime's protocol {model.protocol}")
    return router_class(model)


def sagemaker_runtime_get_action(inner: Any, self: Any) -> Any:
    """Wraps moto/core/responses.py BaseResponse._get_action for SageMakerRuntimeResponse: the
    operation by method and path in rest-json, the protocol SageMaker Runtime speaks; moto picks
    the protocol from the Content-Type header, which here is the model's input's (module docstring)."""
    from moto.core.routing import NotFound

    try:
        operation, self.uri_match = _runtime_router().match(self.normalized_request)
    except NotFound:
        return inner(self)
    return operation.name


def sagemaker_runtime_invoke_endpoint(inner: Any, self: Any) -> Any:
    """Wraps moto/sagemakerruntime/responses.py SageMakerRuntimeResponse.invoke_endpoint.

    moto answers placeholders; here the request goes to the endpoint's local serving process
    (LocalSageMaker.invoke_endpoint), and errors carry AWS's codes (module docstring)."""
    sagemaker = current_runtime().sagemaker
    body: bytes = self.raw_body  # sagemaker_runtime_setup_class: the bytes as sent
    if sagemaker is None:
        self.body = body.decode("utf-8", errors="replace")  # moto's placeholder answer puts it in JSON
        return inner(self)
    if len(body) > BODY_LIMIT_BYTES:
        return body_too_large(len(body))
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

    return [
        wrap(SageMakerRuntimeResponse, "setup_class", sagemaker_runtime_setup_class),
        wrap(SageMakerRuntimeResponse, "_get_action", sagemaker_runtime_get_action),
        wrap(SageMakerRuntimeResponse, "invoke_endpoint", sagemaker_runtime_invoke_endpoint),
    ]
