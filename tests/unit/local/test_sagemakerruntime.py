"""SageMaker Runtime InvokeEndpoint: answers from the local serving process, errors with AWS's status codes."""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from sdflow.local import runtime as runtime_module
from sdflow.local.sagemaker import endpoints as sagemaker_endpoints
from sdflow.local.sagemaker.container_http import ContainerAnswer
from sdflow.local.sagemaker.endpoints import (
    INVOCATION_TIMED_OUT,
    INVOKE_TIMEOUT_S,
    Deployment,
    EndpointHosting,
    EndpointState,
)
from sdflow.local.sagemaker.engine import ContainerError, EndpointUnreachable
from sdflow.local.sagemaker.invoke import BODY_LIMIT_BYTES
from sdflow.local.sagemaker.service import SageMakerStatusPublisher
from tests.constants import ACCOUNT, REGION
from tests.unit.local.helpers import ROLE, client


def _endpoint(name: str = "e") -> None:
    sagemaker = client("sagemaker")
    sagemaker.create_model(ModelName="m", ExecutionRoleArn=ROLE, PrimaryContainer={"Image": "image:tag"})
    variant = {"VariantName": "AllTraffic", "ModelName": "m", "InitialInstanceCount": 1, "InstanceType": "ml.m5.xlarge"}
    sagemaker.create_endpoint_config(EndpointConfigName="c", ProductionVariants=[variant])
    sagemaker.create_endpoint(EndpointName=name, EndpointConfigName="c")


def _invoke(name: str = "e") -> Any:
    return client("sagemaker-runtime").invoke_endpoint(EndpointName=name, Body=b'{"prompt": "x"}')


def _invoke_body(body: bytes) -> Any:
    return client("sagemaker-runtime").invoke_endpoint(EndpointName="e", Body=body)


def _error(exc: pytest.ExceptionInfo[ClientError]) -> tuple[str, int]:
    response: Any = exc.value.response
    return response["Error"]["Code"], response["ResponseMetadata"]["HTTPStatusCode"]


def test_moto_gap_tuple_status_ignored_by_call_action() -> None:
    """Why the old patch answered 200: moto takes the status from headers["status"] only."""
    from moto.core.responses import BaseResponse

    status, _headers, _body = BaseResponse._transform_response({}, (400, {}, "{}"))
    assert status == 200


def test_unknown_endpoint_validation_error_400(runtime: runtime_module.Runtime) -> None:
    with pytest.raises(ClientError) as missing:
        _invoke("nope")
    assert _error(missing) == ("ValidationError", 400)
    assert missing.value.response["Error"]["Message"] == f"Endpoint nope of account {ACCOUNT} not found."


def test_endpoint_not_in_service_validation_error_400(runtime: runtime_module.Runtime) -> None:
    _endpoint()
    with pytest.raises(ClientError) as creating:
        _invoke()
    assert _error(creating) == ("ValidationError", 400)
    assert "Creating" in creating.value.response["Error"]["Message"]


def test_model_4xx_is_model_error_424_with_original_status(
    runtime: runtime_module.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    _endpoint()
    SageMakerStatusPublisher().job_status_changed("endpoint", "e", "InService", {"EndpointConfigName": "c"})

    def refuse(*_args: Any) -> Any:
        raise ContainerError("e", 400, b'{"error": "prompt: is required"}', "application/json")

    monkeypatch.setattr(runtime.sagemaker, "invoke_endpoint", refuse)
    with pytest.raises(ClientError) as refused:
        _invoke()
    response: Any = refused.value.response
    assert _error(refused) == ("ModelError", 424)
    assert response["OriginalStatusCode"] == 400
    assert response["OriginalMessage"] == '{"error": "prompt: is required"}'
    assert response["LogStreamArn"] == f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:/aws/sagemaker/Endpoints/e"
    assert response["Error"]["Message"].startswith(
        'Received client error (400) from primary with message "{"error": "prompt: is required"}". See https://'
    )


def test_model_5xx_server_error_and_dead_container_service_unavailable(
    runtime: runtime_module.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    _endpoint()
    SageMakerStatusPublisher().job_status_changed("endpoint", "e", "InService", {"EndpointConfigName": "c"})

    def crash(*_args: Any) -> Any:
        raise ContainerError("e", 500, b"CUDA out of memory", "text/plain")

    monkeypatch.setattr(runtime.sagemaker, "invoke_endpoint", crash)
    with pytest.raises(ClientError) as failed:
        _invoke()
    assert _error(failed) == ("ModelError", 424)
    assert failed.value.response["Error"]["Message"].startswith("Received server error (500) from primary")

    def gone(*_args: Any) -> Any:
        raise EndpointUnreachable("endpoint e did not answer: connection refused")

    monkeypatch.setattr(runtime.sagemaker, "invoke_endpoint", gone)
    runtime_client = boto3.client(
        "sagemaker-runtime", region_name=REGION, config=Config(retries={"total_max_attempts": 1})
    )
    with pytest.raises(ClientError) as unavailable:
        runtime_client.invoke_endpoint(EndpointName="e", Body=b"{}")
    assert _error(unavailable) == ("ServiceUnavailable", 503)


def test_success_answers_200_with_model_body(runtime: runtime_module.Runtime) -> None:
    _endpoint()
    SageMakerStatusPublisher().job_status_changed("endpoint", "e", "InService", {"EndpointConfigName": "c"})
    answer = _invoke()
    assert answer["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert answer["Body"].read() == b'PNG:{"prompt": "x"}'


def _in_service(monkeypatch: pytest.MonkeyPatch, runtime: runtime_module.Runtime, answer: Any) -> list[bytes]:
    """Endpoint "e" InService, its container answering with `answer(body)`; returns the bodies it got."""
    _endpoint()
    SageMakerStatusPublisher().job_status_changed("endpoint", "e", "InService", {"EndpointConfigName": "c"})
    received: list[bytes] = []

    def container(name: str, body: bytes, content_type: str, accept: str) -> Any:
        received.append(body)
        return answer(body)

    monkeypatch.setattr(runtime.sagemaker, "invoke_endpoint", container)
    return received


def test_body_over_6_mb_refused_413_before_the_container(
    runtime: runtime_module.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    received = _in_service(monkeypatch, runtime, lambda body: (b"PNG", "image/png"))
    with pytest.raises(ClientError) as refused:
        _invoke_body(b"x" * (BODY_LIMIT_BYTES + 1))
    # AWS's front end answers plain text without an error code; botocore then names the error by its status.
    assert _error(refused) == ("413", 413)
    assert refused.value.response["Error"]["Message"] == "HTTP content length exceeded 6291456 bytes."
    assert received == [], "the container never sees a body over the limit"
    assert _invoke_body(b"x" * BODY_LIMIT_BYTES)["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert len(received[0]) == BODY_LIMIT_BYTES


def test_container_429_is_model_error_424_with_retry_after_in_original_message_not_retried(
    runtime: runtime_module.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    busy = b'{"error":"server busy","status":"busy","retry_after_s":7}'

    def refuse(body: bytes) -> Any:
        raise ContainerError("e", 429, busy, "application/json")

    received = _in_service(monkeypatch, runtime, refuse)
    standard = boto3.client("sagemaker-runtime", region_name=REGION, config=Config(retries={"mode": "standard"}))
    with pytest.raises(ClientError) as refused:
        standard.invoke_endpoint(EndpointName="e", Body=b'{"prompt": "x"}')
    response: Any = refused.value.response
    # As on AWS: every container 4xx/5xx is ModelError 424, which no SDK retries; the container's
    # Retry-After reaches the caller only inside its body, as OriginalMessage.
    assert _error(refused) == ("ModelError", 424)
    assert response["OriginalStatusCode"] == 429
    assert json.loads(response["OriginalMessage"])["retry_after_s"] == 7
    assert response["Error"]["Message"].startswith("Received client error (429) from primary")
    assert "retry-after" not in response["ResponseMetadata"]["HTTPHeaders"]
    assert response["ResponseMetadata"]["RetryAttempts"] == 0
    assert len(received) == 1


def test_container_silent_past_60_s_is_model_error_server_error_0(
    runtime: runtime_module.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    def silent(body: bytes) -> Any:
        raise ContainerError("e", 0, INVOCATION_TIMED_OUT, "text/plain")

    _in_service(monkeypatch, runtime, silent)
    with pytest.raises(ClientError) as timed_out:
        _invoke()
    response: Any = timed_out.value.response
    assert _error(timed_out) == ("ModelError", 424)
    assert response["OriginalStatusCode"] == 0
    assert response["Error"]["Message"].startswith(
        'Received server error (0) from primary with message "Your invocation timed out while waiting for a '
        "response from container primary."
    )


def _hosting(monkeypatch: pytest.MonkeyPatch, post: Any) -> EndpointHosting:
    """An EndpointHosting serving endpoint "e" on port 9, its container answering through `post`."""
    hosting: Any = EndpointHosting.__new__(EndpointHosting)  # only the state invoke_endpoint reads
    alive = type("Alive", (), {"alive": lambda self: True})()
    hosting._lock = threading.RLock()
    hosting._endpoints = {"e": EndpointState("e", current=Deployment("c", Path("."), 9, alive))}
    hosting.invoke_timeout_s = INVOKE_TIMEOUT_S
    monkeypatch.setattr(sagemaker_endpoints, "post_invocation", post)
    return hosting


def test_local_sagemaker_invoke_past_timeout_raises_container_error_0(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[float] = []

    def silent(port: int, body: bytes, headers: dict[str, str], timeout_s: float) -> Any:
        opened.append(timeout_s)
        raise TimeoutError("timed out")  # what http.client raises past the socket timeout, connect or read

    hosting = _hosting(monkeypatch, silent)
    with pytest.raises(ContainerError) as timed_out:
        hosting.invoke_endpoint("e", b"{}", "application/json", "*/*")
    assert (timed_out.value.status, timed_out.value.body) == (0, INVOCATION_TIMED_OUT)
    assert opened == [60.0], "SageMaker's limit"


def test_local_sagemaker_invoke_container_refusal_raises_container_error_with_its_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(port: int, body: bytes, headers: dict[str, str], timeout_s: float) -> Any:
        return ContainerAnswer(413, "application/json", b'{"error":"body is 6291456 bytes"}')

    hosting = _hosting(monkeypatch, refuse)
    with pytest.raises(ContainerError) as refused:
        hosting.invoke_endpoint("e", b"x" * BODY_LIMIT_BYTES, "application/json", "*/*")
    assert (refused.value.status, refused.value.body) == (413, b'{"error":"body is 6291456 bytes"}')


def test_local_sagemaker_invoke_connection_closed_without_answer_raises_unreachable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def gone(port: int, body: bytes, headers: dict[str, str], timeout_s: float) -> Any:
        raise http.client.RemoteDisconnected("Remote end closed connection without response")

    with pytest.raises(EndpointUnreachable, match="closed connection without response"):
        _hosting(monkeypatch, gone).invoke_endpoint("e", b"{}", "application/json", "*/*")


def test_moto_gap_setup_class_reads_body_as_api_parameters() -> None:
    """Why the front end takes the body itself: moto decodes it as UTF-8 (a PNG fails, an HTML 500
    on the server) and parses a form content type into parameters (the body is lost)."""
    from moto.core.request import Request
    from moto.sagemakerruntime.responses import SageMakerRuntimeResponse

    url = f"https://runtime.sagemaker.{REGION}.amazonaws.com/endpoints/e/invocations"
    with pytest.raises(UnicodeDecodeError):
        SageMakerRuntimeResponse().setup_class(Request.from_primitives("POST", url, {}, b"\x89PNG\xff"))
    form = Request.from_primitives("POST", url, {"Content-Type": "multipart/form-data; boundary=x"}, b"--x\r\n")
    response = SageMakerRuntimeResponse()
    response.setup_class(form)
    assert response.raw_body == b""
    # The operation is chosen by the body's content type: a form body is read as the query protocol.
    amz_json = Request.from_primitives("POST", url, {"Content-Type": "application/x-amz-json-1.1"}, b"{}")
    response = SageMakerRuntimeResponse()
    response.setup_class(amz_json)
    assert response._get_action() is None


MULTIPART = b"--x\r\nContent-Disposition: form-data; name=a\r\n\r\n1\r\n--x--\r\n"


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        pytest.param(b"\x89PNG\r\n\x1a\n\xff\xfe\x00", "image/png", id="not-utf8"),
        pytest.param(b"\xff\xfe\x00binary", "application/octet-stream", id="octet-stream"),
        pytest.param(b"prompt=a+cat&Action=DeleteEndpoint", "application/x-www-form-urlencoded", id="form"),
        pytest.param(MULTIPART, "multipart/form-data; boundary=x", id="multipart"),
        pytest.param(b"a cat", "text/plain", id="text"),
        pytest.param(b'{"prompt": "a cat"}', "application/x-amz-json-1.1", id="amz-json"),
    ],
)  # fmt: skip
def test_body_of_any_bytes_and_content_type_reaches_container_unchanged(
    runtime: runtime_module.Runtime, monkeypatch: pytest.MonkeyPatch, body: bytes, content_type: str
) -> None:
    received: list[tuple[bytes, str]] = []

    def container(name: str, got: bytes, got_type: str, accept: str) -> Any:
        received.append((got, got_type))
        return b"\x89PNG-answer", "image/png"

    _endpoint()
    SageMakerStatusPublisher().job_status_changed("endpoint", "e", "InService", {"EndpointConfigName": "c"})
    monkeypatch.setattr(runtime.sagemaker, "invoke_endpoint", container)
    answer = client("sagemaker-runtime").invoke_endpoint(EndpointName="e", Body=body, ContentType=content_type)
    assert answer["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert answer["Body"].read() == b"\x89PNG-answer"
    assert answer["ContentType"] == "image/png"
    assert received == [(body, content_type)]


def test_container_refusing_a_content_type_is_model_error_424_with_its_status(
    runtime: runtime_module.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(body: bytes) -> Any:
        raise ContainerError("e", 415, b'{"error":"Content-Type image/png: send application/json"}', "application/json")

    received = _in_service(monkeypatch, runtime, refuse)
    with pytest.raises(ClientError) as refused:
        client("sagemaker-runtime").invoke_endpoint(EndpointName="e", Body=b"\x89PNG\xff", ContentType="image/png")
    response: Any = refused.value.response
    assert _error(refused) == ("ModelError", 424)
    assert response["OriginalStatusCode"] == 415
    assert "send application/json" in response["OriginalMessage"]
    assert received == [b"\x89PNG\xff"]


def test_body_of_6_mb_the_container_refuses_is_model_error_424_with_original_413(
    runtime: runtime_module.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusal = b'{"error":"body is 6291456 bytes; the limit is 65536","field":"body"}'

    def refuse(body: bytes) -> Any:
        raise ContainerError("e", 413, refusal, "application/json")

    received = _in_service(monkeypatch, runtime, refuse)
    with pytest.raises(ClientError) as refused:
        _invoke_body(b"x" * BODY_LIMIT_BYTES)
    response: Any = refused.value.response
    assert _error(refused) == ("ModelError", 424)
    assert (response["OriginalStatusCode"], response["OriginalMessage"]) == (413, refusal.decode())
    assert response["Error"]["Message"].startswith("Received client error (413) from primary")
    assert [len(body) for body in received] == [BODY_LIMIT_BYTES], "within the limit: the container decides"
