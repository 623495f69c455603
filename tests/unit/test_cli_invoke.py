"""`sdflow invoke`: an endpoint's refusal becomes one clear CLI error, not a KeyError."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdflow.cli import invoke
from sdflow.session import CliError


class _Runtime:
    def __init__(self, answer: Any = None, error: dict[str, Any] | None = None) -> None:
        self.answer, self.error = answer, error

    def invoke_endpoint(self, **_: Any) -> dict[str, Any]:
        if self.error is not None:
            raise ClientError(self.error, "InvokeEndpoint")
        return {"Body": io.BytesIO(json.dumps(self.answer).encode())}


class _Session:
    def __init__(self, runtime: _Runtime) -> None:
        self.runtime = runtime

    def client(self, service: str) -> _Runtime:
        assert service == "sagemaker-runtime"
        return self.runtime


def test_invoke_model_error_becomes_cli_error_with_models_message(tmp_path: Path) -> None:
    error = {
        "Error": {"Code": "ModelError", "Message": "Received client error (400) from primary"},
        "OriginalStatusCode": 400,
        "OriginalMessage": '{"detail": "width: must be a multiple of 8"}',
    }
    with pytest.raises(CliError, match=r"ModelError.*width: must be a multiple of 8"):
        invoke(_Session(_Runtime(error=error)), "sdflow-demo", "a red circle", tmp_path / "out.png")  # type: ignore[arg-type]
    assert not (tmp_path / "out.png").exists()


def test_invoke_unknown_endpoint_names_the_endpoint(tmp_path: Path) -> None:
    error = {"Error": {"Code": "ValidationError", "Message": "Endpoint nope of account 123456789012 not found."}}
    with pytest.raises(CliError, match=r"endpoint nope refused the request \(ValidationError\): Endpoint nope"):
        invoke(_Session(_Runtime(error=error)), "nope", "x", tmp_path / "out.png")  # type: ignore[arg-type]


def test_invoke_answer_without_images_is_cli_error(tmp_path: Path) -> None:
    with pytest.raises(CliError, match="without an image"):
        invoke(_Session(_Runtime(answer={"error": "busy"})), "e", "x", tmp_path / "out.png")  # type: ignore[arg-type]


def test_invoke_writes_first_image(tmp_path: Path) -> None:
    answer = {"images": [base64.b64encode(b"\x89PNG-bytes").decode()]}
    path = invoke(_Session(_Runtime(answer=answer)), "e", "x", tmp_path / "out.png")  # type: ignore[arg-type]
    assert path.read_bytes() == b"\x89PNG-bytes"
