"""`sdflow invoke`: an endpoint's refusal becomes one clear CLI error, not a KeyError."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdflow import endpoints
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


def _busy(retry_after_s: float) -> dict[str, Any]:
    """What SageMaker hands on of the container's 429 busy refusal (ModelError keeps status and body)."""
    return {
        "Error": {"Code": "ModelError", "Message": "Received client error (429) from primary"},
        "OriginalStatusCode": 429,
        "OriginalMessage": json.dumps({"status": "busy", "retry_after_s": retry_after_s}),
    }


class _BusyThen(_Runtime):
    """Busy `times` times, then the answer."""

    def __init__(self, times: int, answer: Any, retry_after_s: float = 2.0) -> None:
        super().__init__(answer=answer)
        self.times, self.retry_after_s, self.calls = times, retry_after_s, 0

    def invoke_endpoint(self, **kwargs: Any) -> dict[str, Any]:
        self.calls += 1
        if self.calls <= self.times:
            raise ClientError(_busy(self.retry_after_s), "InvokeEndpoint")  # type: ignore[arg-type]
        return super().invoke_endpoint(**kwargs)


class _FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_invoke_json_busy_refusal_retried_after_the_wait_it_names() -> None:
    runtime, fake = _BusyThen(2, {"images": ["aGk="]}, retry_after_s=3.5), _FakeTime()
    answer = endpoints.invoke_json(runtime, "e", {"prompt": "x"}, sleep=fake.sleep, clock=lambda: fake.now)
    assert answer == {"images": ["aGk="]}
    assert runtime.calls == 3
    assert fake.slept == [3.5, 3.5]


def test_invoke_json_busy_past_the_budget_raises_the_refusal() -> None:
    runtime, fake = _BusyThen(100, {"images": ["aGk="]}, retry_after_s=20.0), _FakeTime()
    with pytest.raises(ClientError) as raised:
        endpoints.invoke_json(runtime, "e", {"prompt": "x"}, budget_s=50.0, sleep=fake.sleep, clock=lambda: fake.now)
    assert raised.value.response["OriginalStatusCode"] == 429  # type: ignore[typeddict-item]
    assert fake.slept == [20.0, 20.0], "no wait that would end past the budget"


def test_invoke_json_other_model_error_not_retried() -> None:
    error = {"Error": {"Code": "ModelError", "Message": "x"}, "OriginalStatusCode": 400, "OriginalMessage": "{}"}
    runtime, fake = _Runtime(error=error), _FakeTime()
    with pytest.raises(ClientError):
        endpoints.invoke_json(runtime, "e", {"prompt": "x"}, sleep=fake.sleep, clock=lambda: fake.now)
    assert fake.slept == []


def test_invoke_busy_through_the_budget_says_it_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeTime()
    monkeypatch.setattr(endpoints, "time", SimpleNamespace(sleep=fake.sleep, monotonic=lambda: fake.now))
    runtime = _BusyThen(1000, {"images": ["aGk="]}, retry_after_s=30.0)
    with pytest.raises(CliError, match=r"ModelError\) \(still busy after retrying for 180 s\).*retry_after_s"):
        invoke(_Session(runtime), "e", "x", tmp_path / "out.png")  # type: ignore[arg-type]
