"""The serve job on CPU with the tiny model: readiness, images, validation, queueing, SIGTERM."""

from __future__ import annotations

import base64
import io
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from sdflow_image.builders.tiny_model import build_tiny_pipeline
from sdflow_image.serving import serve
from sdflow_image.serving.serve_model import StepTiming
from tests.helpers import free_port

pytestmark = [pytest.mark.image, pytest.mark.slow]

FAST = {"num_inference_steps": 2, "width": 64, "height": 64}
READY_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def opt_ml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An $SDFLOW_OPT_ML folder whose model/ holds the tiny pipeline."""
    root = tmp_path_factory.mktemp("opt_ml")
    build_tiny_pipeline(root / "model")
    return root


class CountingPipeline:
    """Wraps the real pipeline to see how many calls overlap and how many happen."""

    def __init__(self, pipe: Any):
        self._pipe = pipe
        self._lock = threading.Lock()
        self.active = 0
        self.max_active = 0
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def __call__(self, **kwargs: Any) -> Any:
        with self._lock:
            self.active += 1
            self.calls += 1
            self.max_active = max(self.max_active, self.active)
        try:
            time.sleep(0.05)  # widen the window an unserialized server would overlap in
            return self._pipe(**kwargs)
        finally:
            with self._lock:
                self.active -= 1


class FakePipeline:
    """Blocks until released, so a test controls what is in flight; no torch work."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, *, prompt: str, width: int, height: int, num_images_per_prompt: int, **_: Any) -> Any:
        self.entered.set()
        assert self.release.wait(30), "test never released the fake pipeline"
        if prompt == "explode":
            raise RuntimeError("the fake model exploded")
        images = [Image.new("RGB", (width, height), (200, 10, 10)) for _ in range(num_images_per_prompt)]
        return type("Output", (), {"images": images})()


def _wait_for_ping(client: TestClient, status: int) -> dict[str, Any]:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        response = client.get("/ping")
        if response.status_code == status or time.monotonic() > deadline:
            assert response.status_code == status, response.text
            return response.json()
        time.sleep(0.05)


@pytest.fixture(scope="module")
def served(opt_ml: Path) -> Iterator[tuple[TestClient, CountingPipeline]]:
    """The app with the tiny model loaded the production way, from $SDFLOW_OPT_ML/model."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SDFLOW_OPT_ML", str(opt_ml))
        settings = serve.settings_from_args(serve.parse_args([]))
    holder: dict[str, CountingPipeline] = {}

    def loader(s: serve.ServeSettings) -> CountingPipeline:
        holder["pipe"] = CountingPipeline(serve.load_pipeline(s))
        return holder["pipe"]

    with TestClient(serve.create_app(settings, loader=loader)) as client:
        _wait_for_ping(client, 200)
        yield client, holder["pipe"]


def _decode_png(data: bytes) -> Image.Image:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def test_parse_args_environment_sets_model_dir_port_and_host(opt_ml: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SDFLOW_OPT_ML", str(opt_ml))
    monkeypatch.setenv("SAGEMAKER_BIND_TO_PORT", "9123")
    monkeypatch.setenv("SDFLOW_SERVE_HOST", "127.0.0.1")
    settings = serve.settings_from_args(serve.parse_args([]))
    assert settings.model_dir == opt_ml / "model"
    assert (settings.port, settings.host) == (9123, "127.0.0.1")
    monkeypatch.delenv("SAGEMAKER_BIND_TO_PORT")
    monkeypatch.delenv("SDFLOW_SERVE_HOST")
    defaults = serve.settings_from_args(serve.parse_args(["--max_queue", "2"]))
    assert (defaults.port, defaults.host, defaults.max_queue) == (8080, "0.0.0.0", 2)


def test_ping_while_loading_returns_503_then_200_once_loaded(opt_ml: Path) -> None:
    gate = threading.Event()

    def slow_loader(s: serve.ServeSettings) -> Any:
        assert gate.wait(30)
        return serve.load_pipeline(s)

    settings = serve.ServeSettings(model_dir=opt_ml / "model")
    with TestClient(serve.create_app(settings, loader=slow_loader)) as client:
        loading = client.get("/ping")
        assert loading.status_code == 503
        assert loading.json()["status"] == "loading"
        early = client.post("/invocations", json={"prompt": "a red square", **FAST})
        assert early.status_code == 503
        gate.set()
        assert _wait_for_ping(client, 200) == {"status": "ready"}
        assert client.post("/invocations", json={"prompt": "a red square", **FAST}).status_code == 200


def test_ping_model_missing_returns_500_naming_the_problem(tmp_path: Path) -> None:
    settings = serve.ServeSettings(model_dir=tmp_path / "model")
    with TestClient(serve.create_app(settings)) as client:
        body = _wait_for_ping_status(client, "failed")
        assert client.get("/ping").status_code == 500
        assert "model_index.json" in body["error"]
        assert str(tmp_path / "model") in body["error"]
        invoked = client.post("/invocations", json={"prompt": "a cat", **FAST})
        assert invoked.status_code == 500
        assert "model_index.json" in invoked.json()["error"]


def _wait_for_ping_status(client: TestClient, status: str) -> dict[str, Any]:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while (body := client.get("/ping").json()).get("status") != status:
        assert time.monotonic() < deadline, body
        time.sleep(0.05)
    return body


def test_invocations_json_returns_base64_pngs_of_requested_size(served: tuple[TestClient, Any]) -> None:
    client, _ = served
    request = {"prompt": "a red square", "num_inference_steps": 2, "width": 64, "height": 72, "num_images": 2}
    response = client.post("/invocations", json=request)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert (body["width"], body["height"], body["num_images"]) == (64, 72, 2)
    assert isinstance(body["seed"], int)
    assert len(body["images"]) == 2
    for encoded in body["images"]:
        image = _decode_png(base64.b64decode(encoded, validate=True))
        assert image.size == (64, 72)  # PIL: (width, height)
        assert image.mode == "RGB"


def test_invocations_accept_png_returns_first_image_as_png(served: tuple[TestClient, Any]) -> None:
    client, _ = served
    response = client.post(
        "/invocations",
        json={"prompt": "a blue square", **FAST, "width": 80},
        headers={"Accept": "image/png"},
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "image/png"
    assert _decode_png(response.content).size == (80, 64)
    assert int(response.headers["x-sdflow-seed"]) >= 0


def test_invocations_default_size_is_the_models_native_size(served: tuple[TestClient, Any]) -> None:
    client, _ = served
    response = client.post("/invocations", json={"prompt": "a green circle", "num_inference_steps": 2})
    assert response.status_code == 200, response.text
    body = response.json()
    native = served[1].unet.config.sample_size * served[1].vae_scale_factor
    assert (body["width"], body["height"]) == (native, native)
    assert _decode_png(base64.b64decode(body["images"][0])).size == (native, native)


def test_invocations_same_seed_returns_same_image(served: tuple[TestClient, Any]) -> None:
    client, _ = served
    unseeded = client.post("/invocations", json={"prompt": "a red circle", **FAST}).json()
    # The seed the server chose is reported, so the image can be reproduced.
    again = client.post("/invocations", json={"prompt": "a red circle", **FAST, "seed": unseeded["seed"]}).json()
    assert again["images"] == unseeded["images"]
    other_seed = client.post(
        "/invocations", json={"prompt": "a red circle", **FAST, "seed": unseeded["seed"] + 1}
    ).json()
    assert other_seed["images"] != unseeded["images"]


BAD_REQUESTS = [
    pytest.param({"prompt": "a cat", "style": "oil"}, "style", id="unknown-field"),
    pytest.param({"prompt": ""}, "prompt", id="empty-prompt"),
    pytest.param({"prompt": "   "}, "prompt", id="blank-prompt"),
    pytest.param({"prompt": "a" * 1001}, "prompt", id="over-long-prompt"),
    pytest.param({"negative_prompt": "blurry"}, "prompt", id="missing-prompt"),
    pytest.param({"prompt": "a cat", "width": 65}, "width", id="width-65"),
    pytest.param({"prompt": "a cat", "height": 4096}, "height", id="height-4096"),
    pytest.param({"prompt": "a cat", "num_inference_steps": 0}, "num_inference_steps", id="steps-0"),
    pytest.param({"prompt": "a cat", "num_inference_steps": 500}, "num_inference_steps", id="steps-500"),
    pytest.param({"prompt": "a cat", "num_inference_steps": "2"}, "num_inference_steps", id="steps-string"),
    pytest.param({"prompt": "a cat", "guidance_scale": 31}, "guidance_scale", id="guidance-31"),
    pytest.param({"prompt": "a cat", "num_images": 10}, "num_images", id="num-images-10"),
    pytest.param({"prompt": "a cat", "seed": -1}, "seed", id="seed-negative"),
    pytest.param({"prompt": "a cat", "seed": 1.5}, "seed", id="seed-float"),
    pytest.param(b'{"prompt": "a cat",', "body", id="malformed-json"),
    pytest.param(b'{"prompt": "a cat", "guidance_scale": NaN}', "body", id="nan-literal"),
    pytest.param(b'["a cat"]', "body", id="non-object-json"),
    pytest.param(b"\xff\xfe", "body", id="not-utf8"),
]


@pytest.mark.parametrize(("payload", "field"), BAD_REQUESTS)
def test_invocations_bad_request_returns_400_naming_the_field(
    served: tuple[TestClient, CountingPipeline], payload: dict[str, Any] | bytes, field: str
) -> None:
    client, pipe = served
    calls_before = pipe.calls
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    response = client.post("/invocations", content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["field"] == field
    assert field in body["error"]
    assert pipe.calls == calls_before, "a rejected request must not run the model"


def test_invocations_wrong_content_type_returns_400(served: tuple[TestClient, Any]) -> None:
    client, _ = served
    response = client.post(
        "/invocations", content=b"prompt=a+cat", headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert response.status_code == 400
    assert response.json()["field"] == "Content-Type"
    assert "application/json" in response.json()["error"]


def test_invocations_unsatisfiable_accept_returns_406(served: tuple[TestClient, Any]) -> None:
    client, _ = served
    response = client.post("/invocations", json={"prompt": "a cat", **FAST}, headers={"Accept": "image/jpeg"})
    assert response.status_code == 406
    assert "image/png" in response.json()["error"]


def test_invocations_concurrent_requests_all_succeed_one_at_a_time(
    served: tuple[TestClient, CountingPipeline],
) -> None:
    client, pipe = served
    results: list[tuple[int, int]] = []

    def invoke(seed: int) -> None:
        response = client.post("/invocations", json={"prompt": "a white square", **FAST, "seed": seed})
        results.append((response.status_code, response.json().get("seed", -1)))

    threads = [threading.Thread(target=invoke, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(results) == [(200, seed) for seed in range(4)]
    assert pipe.max_active == 1


@pytest.fixture
def fake_served() -> Iterator[tuple[TestClient, FakePipeline]]:
    fake = FakePipeline()
    settings = serve.ServeSettings(model_dir=Path("/nonexistent"), max_queue=0)
    timing = StepTiming(size=64, step_s=0.001, overhead_s=0.001)
    with TestClient(serve.create_app(settings, loader=lambda s: fake, calibrator=lambda p, size: timing)) as client:
        _wait_for_ping(client, 200)
        yield client, fake
        fake.release.set()


def test_invocations_queue_full_returns_429_busy_with_retry_after(
    fake_served: tuple[TestClient, FakePipeline],
) -> None:
    client, fake = fake_served
    first: list[int] = []
    runner = threading.Thread(
        target=lambda: first.append(client.post("/invocations", json={"prompt": "a", **FAST}).status_code)
    )
    runner.start()
    assert fake.entered.wait(30)
    busy = client.post("/invocations", json={"prompt": "b", **FAST})
    assert busy.status_code == 429
    assert busy.json()["status"] == "busy"
    assert busy.headers["retry-after"] == "1"
    assert busy.json()["retry_after_s"] == 1, "the body carries it too: SageMaker passes bodies, not headers"
    assert client.get("/ping").status_code == 200, "/ping must answer while a generation runs"
    fake.release.set()
    runner.join(30)
    assert first == [200]


def test_invocations_model_error_returns_500_json(fake_served: tuple[TestClient, FakePipeline]) -> None:
    client, fake = fake_served
    fake.release.set()
    response = client.post("/invocations", json={"prompt": "explode", **FAST})
    assert response.status_code == 500
    assert "the fake model exploded" in response.json()["error"]


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 60) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _drain(lines: queue.Queue[str], log: list[str]) -> None:
    while True:
        try:
            log.append(lines.get_nowait())
        except queue.Empty:
            return


def test_serve_process_sigterm_finishes_in_flight_request_and_exits_0(opt_ml: Path, repo_root: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "SDFLOW_OPT_ML": str(opt_ml),
        "SAGEMAKER_BIND_TO_PORT": str(port),
        "SDFLOW_SERVE_HOST": "127.0.0.1",
        # The script's `#!/usr/bin/env python3` must find this interpreter, as it does in the image.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
    }
    proc = subprocess.Popen(
        [str(repo_root / "training_image" / "bin" / "serve")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    log: list[str] = []

    def read_log() -> None:
        for line in proc.stderr or []:
            lines.put(line)

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            _drain(lines, log)
            assert proc.poll() is None, f"serve exited early: {''.join(log)}"
            assert time.monotonic() < deadline, f"never ready: {''.join(log)}"
            try:
                if _http(f"{base}/ping", timeout=2)[0] == 200:
                    break
            except OSError:
                pass  # not listening yet
            time.sleep(0.2)

        in_flight: list[tuple[int, bytes]] = []
        request = {
            "prompt": "a yellow circle",
            "num_inference_steps": 6,
            "width": 64,
            "height": 64,
            "seed": 3,
        }
        client = threading.Thread(target=lambda: in_flight.append(_http(f"{base}/invocations", request)))
        client.start()
        # SIGTERM only once the server logs that the generation has started.
        while not any("generating" in line for line in log):
            log.append(lines.get(timeout=READY_TIMEOUT_S))
        proc.send_signal(signal.SIGTERM)  # as SageMaker and the local runtime stop a container
        client.join(READY_TIMEOUT_S)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    status, body = in_flight[0]
    assert status == 200, body[:500]
    image = _decode_png(base64.b64decode(json.loads(body)["images"][0]))
    assert image.size == (64, 64)
