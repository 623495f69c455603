"""The serve job within SageMaker's limits: inputs that once got a 500, the 60 s invocation limit,
the trained size and dtype, a failed load, and work whose client has gone."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from sdflow_image import flags
from sdflow_image.builders.tiny_model import IMAGE_SIZE, build_tiny_pipeline
from sdflow_image.serving import serve, serve_worker
from sdflow_image.serving.serve_model import (
    ModelInfo,
    ServeSettings,
    StepTiming,
    load_pipeline,
    serving_devices,
    torch_placement,
)
from tests.image.serve_fixtures import (
    QUICK_TIMING,
    InstantPipeline,
    SteppingPipeline,
    fixed_timing,
    open_invocation,
    read_status,
    served_on_port,
    wait_until,
)

pytestmark = [pytest.mark.image, pytest.mark.slow]

FAST = {"num_inference_steps": 2, "width": 64, "height": 64}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_pipeline(tmp_path_factory.mktemp("serve_limits") / "model")


def _ready(client: TestClient) -> dict[str, Any]:
    wait_until(lambda: client.get("/ping").status_code != 503, "the model to load")
    response = client.get("/ping")
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def real(model_dir: Path) -> Iterator[tuple[TestClient, serve.ModelServer]]:
    """The tiny model loaded and timed the production way (the real calibration)."""
    with TestClient(serve.create_app(ServeSettings(model_dir=model_dir))) as client:
        _ready(client)
        yield client, client.app.state.server  # type: ignore[attr-defined]


# --- inputs that once got a 500 -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        pytest.param(b'{"prompt": "a cat \\ud800"}', "prompt", id="prompt"),
        pytest.param(b'{"prompt": "a cat", "negative_prompt": "\\udfff blurry"}', "negative_prompt", id="negative"),
    ],
)
def test_invocations_lone_surrogate_in_prompt_returns_400_naming_the_field(
    real: tuple[TestClient, Any], body: bytes, field: str
) -> None:
    client, _ = real
    response = client.post("/invocations", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["field"] == field
    assert "surrogate" in response.json()["error"]


def test_invocations_lone_surrogate_in_field_name_returns_400_in_ascii_json(real: tuple[TestClient, Any]) -> None:
    client, _ = real
    body = b'{"prompt": "a cat", "\\ud83d": 1}'
    response = client.post("/invocations", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    response.content.decode("ascii")  # the surrogate is escaped, so the answer is valid JSON
    assert "\\ud83d" in response.json()["error"], "the error shows the offending text, escaped"


def test_invocations_surrogate_pair_in_prompt_is_text_and_runs(real: tuple[TestClient, Any]) -> None:
    client, _ = real
    body = json.dumps({"prompt": "a cat \U0001f431", **FAST}).encode()  # ensure_ascii: "\ud83d\udc31"
    assert b"\\ud83d\\udc31" in body
    response = client.post("/invocations", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"[" * 60_000, id="array-60k-deep"),
        pytest.param(b'{"prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", id="prompt-30k-deep"),
        pytest.param(b'{"prompt": "a", "seed": ' + b'{"a": ' * 900 + b"1" + b"}" * 900 + b"}", id="seed-900-deep"),
    ],
)
def test_invocations_deeply_nested_json_returns_400(real: tuple[TestClient, Any], body: bytes) -> None:
    client, _ = real
    assert len(body) < ServeSettings().max_body_bytes
    response = client.post("/invocations", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["field"] in ("body", "seed")


# --- SageMaker's 60 s invocation limit ------------------------------------------------------------


def test_invocations_request_past_60s_limit_returns_400_naming_the_limit(real: tuple[TestClient, Any]) -> None:
    client, server = real
    timing = server.timing
    assert timing is not None
    assert timing.step_s > 0
    assert timing.size == IMAGE_SIZE  # the size the model says it was trained at
    request = {"prompt": "a cat", "num_images": 4, "num_inference_steps": 150, "width": 1024, "height": 1024}
    response = client.post("/invocations", json=request)
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["field"] == "num_inference_steps"
    assert body["limit_s"] == 60
    assert "60 s" in body["error"]
    assert "SageMaker" in body["error"]
    shape = {"images": 4, "width": 1024, "height": 1024}
    assert body["estimated_s"] == pytest.approx(timing.estimate_s(steps=150, **shape), rel=0.01)
    fits = body["max_num_inference_steps"]
    if fits:
        assert timing.estimate_s(steps=fits, **shape) <= 60 < timing.estimate_s(steps=fits + 1, **shape)
        assert f"at most {fits} num_inference_steps" in body["error"]


def test_step_timing_estimate_scales_with_steps_images_and_pixels() -> None:
    timing = StepTiming(size=512, step_s=0.5, overhead_s=1.0)
    assert timing.estimate_s(steps=30, images=1, width=512, height=512) == pytest.approx(16.0)
    assert timing.estimate_s(steps=30, images=2, width=1024, height=512) == pytest.approx(64.0)
    assert timing.max_steps(images=1, width=512, height=512, limit_s=60) == 118
    assert timing.max_steps(images=4, width=1024, height=1024, limit_s=60) == 5  # 16 x (1 + 5 x 0.5) = 56
    assert timing.max_steps(images=4, width=1024, height=1024, limit_s=10) == 0  # the overheads alone: 16 s


def test_invocations_work_ahead_past_limit_returns_429_busy() -> None:
    blocker = SteppingPipeline(InstantPipeline(), step_delay_s=0.05)
    settings = ServeSettings(model_dir=Path("/nonexistent"))
    # 0.6 s per step at 64²: 30 steps are ~18 s, three of them 54 s (the 60 s limit less its 10%
    # margin), a fourth would end past it.
    app = serve.create_app(settings, loader=lambda s: blocker, calibrator=fixed_timing(StepTiming(64, 0.6, 0.0)))
    with served_on_port(app) as port:
        socks = [open_invocation(port, {"prompt": f"p{i}", **FAST, "num_inference_steps": 30}) for i in range(3)]
        wait_until(lambda: app.state.server.admitted == 3, "three requests to be admitted")
        late = open_invocation(port, {"prompt": "late", **FAST, "num_inference_steps": 30})
        status, body = read_status(late)
        assert status == 429
        assert "60 s limit" in json.loads(body)["error"]
        assert [read_status(sock)[0] for sock in socks] == [200, 200, 200]
        for sock in (*socks, late):
            sock.close()


# --- the trained size and dtype; a model that cannot load -----------------------------------------


def test_invocations_default_size_is_sdflow_model_json_resolution(model_dir: Path, tmp_path: Path) -> None:
    trained = shutil.copytree(model_dir, tmp_path / "model")
    (trained / "sdflow_model.json").write_text(json.dumps({"resolution": 96, "dtype": "float16", "steps": 3}))
    app = serve.create_app(ServeSettings(model_dir=trained), calibrator=fixed_timing(QUICK_TIMING))
    with TestClient(app) as client:
        _ready(client)
        response = client.post("/invocations", json={"prompt": "a red square", "num_inference_steps": 2})
        assert response.status_code == 200, response.text
        assert (response.json()["width"], response.json()["height"]) == (96, 96)


@pytest.mark.parametrize(
    ("saved", "capability", "served"),
    [
        pytest.param("bfloat16", (9, 0), torch.bfloat16, id="bf16-on-h100"),
        pytest.param("bfloat16", (8, 6), torch.bfloat16, id="bf16-on-a10g"),
        pytest.param("bfloat16", (7, 5), torch.float16, id="bf16-on-t4-has-no-bf16-cores"),
        pytest.param("bfloat16", (7, 0), torch.float16, id="bf16-on-v100"),
        pytest.param("float32", (9, 0), torch.float16, id="fp32-trained-serves-half"),
        pytest.param("float16", (7, 5), torch.float16, id="fp16"),
        pytest.param(None, (8, 0), torch.float16, id="no-sdflow-model-json"),
    ],
)
def test_torch_placement_gpu_serves_half_precision_its_compute_capability_runs(
    saved: str | None, capability: tuple[int, int], served: torch.dtype
) -> None:
    info = ModelInfo(resolution=256, dtype=saved) if saved else None
    assert torch_placement(ServeSettings(device="cuda"), info, capability) == ("cuda", served)


def test_torch_placement_cpu_uses_float32_and_an_explicit_dtype_wins() -> None:
    info = ModelInfo(resolution=256, dtype="bfloat16")
    assert torch_placement(ServeSettings(device="cpu"), info) == ("cpu", torch.float32)
    assert torch_placement(ServeSettings(device="cuda", dtype="float32"), info, (7, 5)) == ("cuda", torch.float32)


def test_load_pipeline_decodes_a_requests_images_one_at_a_time(model_dir: Path) -> None:
    pipe = load_pipeline(ServeSettings(model_dir=model_dir, device="cpu"))
    assert pipe.vae.use_slicing is True


class OutOfMemoryPipeline(InstantPipeline):
    """Runs out of GPU memory for more than one image, as four 1024² images did on an A10G."""

    def __call__(self, **kwargs: Any) -> Any:
        if kwargs["num_images_per_prompt"] > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return super().__call__(**kwargs)


def test_invocations_cuda_out_of_memory_returns_400_naming_num_images_and_server_stays_up() -> None:
    settings = ServeSettings(model_dir=Path("/nonexistent"))
    app = serve.create_app(settings, loader=lambda s: OutOfMemoryPipeline(), calibrator=fixed_timing(QUICK_TIMING))
    with TestClient(app) as client:
        _ready(client)
        response = client.post("/invocations", json={"prompt": "a red square", **FAST, "num_images": 4})
        assert response.status_code == 400, response.text
        body = response.json()
        assert body["field"] == "num_images"
        assert "do not fit in this GPU's memory" in body["error"]
        assert client.post("/invocations", json={"prompt": "a red square", **FAST}).status_code == 200


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        pytest.param('{"resolution": 250}', "resolution must be a positive multiple of 8", id="resolution-250"),
        pytest.param('{"resolution": "256"}', "resolution must be", id="resolution-string"),
        pytest.param('{"resolution": 256, "dtype": "fp8"}', "dtype must be one of", id="dtype-fp8"),
        pytest.param("{not json", "not readable JSON", id="not-json"),
    ],
)
def test_ping_bad_sdflow_model_json_returns_500_at_once_naming_it(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str, expected: str
) -> None:
    (tmp_path / "sdflow_model.json").write_text(content)
    loads: list[int] = []

    def loader(s: ServeSettings) -> Any:
        loads.append(1)
        return load_pipeline(s)

    with (
        caplog.at_level(logging.ERROR, logger="sdflow.serve"),
        TestClient(serve.create_app(ServeSettings(model_dir=tmp_path), loader=loader)) as client,
    ):
        wait_until(lambda: client.get("/ping").status_code != 503, "the load to end")
        response = client.get("/ping")
        assert response.status_code == 500
        assert expected in response.json()["error"]
        assert "sdflow_model.json" in response.json()["error"]
    assert loads == [], "the pipeline is not loaded when its description is unusable"
    assert any("model failed to load" in record.getMessage() for record in caplog.records)


def test_ping_loader_failure_returns_500_within_a_second(caplog: pytest.LogCaptureFixture) -> None:
    def broken(s: ServeSettings) -> Any:
        raise OSError("disk on fire")

    started = time.monotonic()
    with (
        caplog.at_level(logging.ERROR, logger="sdflow.serve"),
        TestClient(serve.create_app(ServeSettings(model_dir=Path("/nonexistent")), loader=broken)) as client,
    ):
        wait_until(lambda: client.get("/ping").status_code != 503, "the load to fail", timeout_s=1)
        assert client.get("/ping").status_code == 500
        assert "OSError: disk on fire" in client.get("/ping").json()["error"]
    assert time.monotonic() - started < 5
    assert any(record.exc_info and "disk on fire" in str(record.exc_info[1]) for record in caplog.records)


# --- work whose client has gone -------------------------------------------------------------------


def test_invocations_client_gone_mid_generation_stops_between_steps(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    holder: dict[str, SteppingPipeline] = {}

    def loader(s: ServeSettings) -> SteppingPipeline:
        holder["pipe"] = SteppingPipeline(load_pipeline(s), step_delay_s=0.05)
        return holder["pipe"]

    app = serve.create_app(ServeSettings(model_dir=model_dir), loader=loader, calibrator=fixed_timing(QUICK_TIMING))
    with caplog.at_level(logging.INFO, logger="sdflow.serve"), served_on_port(app) as port:
        wait_until(lambda: "pipe" in holder and app.state.server.status == "ready", "the model to load")
        pipe = holder["pipe"]
        sock = open_invocation(port, {"prompt": "a red square", **FAST, "num_inference_steps": 100})
        assert pipe.stepping.wait(30)
        sock.close()
        wait_until(lambda: any("request dropped" in r.getMessage() for r in caplog.records), "the drop")
        assert pipe.steps < 100, "the real diffusers loop must stop at the step callback"
        steps_at_drop = pipe.steps
        time.sleep(0.3)
        assert pipe.steps == steps_at_drop
        # The worker is free again: the next request runs.
        follow = open_invocation(port, {"prompt": "a blue square", **FAST})
        assert read_status(follow)[0] == 200
        follow.close()


@pytest.mark.parametrize(
    ("device", "gpus", "devices"),
    [
        ("auto", 4, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
        ("cuda", 2, ["cuda:0", "cuda:1"]),
        ("auto", 0, ["cpu"]),
        ("cuda:1", 4, ["cuda:1"]),
        ("cpu", 4, ["cpu"]),
    ],
)
def test_serving_devices_every_gpu_unless_one_is_named(device: str, gpus: int, devices: list[str]) -> None:
    assert serving_devices(ServeSettings(device=device), gpus) == devices


def test_invocations_two_gpus_run_two_requests_at_once_each_on_its_own_pipeline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model copy per GPU: two requests generate side by side, a third waits for a free one."""
    gate, running, lock = threading.Event(), [], threading.Lock()

    def loader(settings: ServeSettings) -> Any:
        pipe = InstantPipeline()

        def held(**kwargs: Any) -> Any:
            with lock:
                running.append(settings.device)
            assert gate.wait(30)
            return pipe(**kwargs)

        return held

    monkeypatch.setattr(serve_worker, "serving_devices", lambda settings: ["cuda:0", "cuda:1"])
    app = serve.create_app(ServeSettings(model_dir=Path("/nonexistent")), loader=loader,
                           calibrator=fixed_timing(QUICK_TIMING))  # fmt: skip
    with served_on_port(app) as port:
        socks = [open_invocation(port, {"prompt": f"p{i}", **FAST}) for i in range(3)]
        wait_until(lambda: app.state.server.admitted == 3, "three requests to be admitted")
        wait_until(lambda: len(running) == 2, "two generations to run at once")
        time.sleep(0.3)
        assert sorted(running) == ["cuda:0", "cuda:1"], "the third waits for a free pipeline"
        gate.set()
        assert [read_status(sock)[0] for sock in socks] == [200, 200, 200]
        assert len(running) == 3
        for sock in socks:
            sock.close()


def test_invocations_client_gone_while_queued_never_runs() -> None:
    gate = threading.Event()
    pipe = InstantPipeline()

    def held(**kwargs: Any) -> Any:
        assert gate.wait(30)
        return pipe(**kwargs)

    settings = ServeSettings(model_dir=Path("/nonexistent"))
    app = serve.create_app(settings, loader=lambda s: held, calibrator=fixed_timing(QUICK_TIMING))
    with served_on_port(app) as port:
        first = open_invocation(port, {"prompt": "first", **FAST})
        wait_until(lambda: app.state.server.admitted == 1, "the first request to be admitted")
        queued = open_invocation(port, {"prompt": "queued", **FAST})
        wait_until(lambda: app.state.server.admitted == 2, "the second request to queue")
        queued.close()
        time.sleep(0.5)  # more than the disconnect poll interval
        gate.set()
        assert read_status(first)[0] == 200
        wait_until(lambda: app.state.server.admitted == 0, "the queue to drain")
        assert pipe.calls == 1, "the abandoned request must not run"
        first.close()


def test_invocations_past_limit_mid_generation_returns_503_and_stops(model_dir: Path) -> None:
    pipe = SteppingPipeline(InstantPipeline(), step_delay_s=0.1)
    settings = ServeSettings(model_dir=Path("/nonexistent"), invocation_limit_s=1.0)
    # The estimate is (wrongly) tiny, so the request is admitted and stopped by the deadline.
    with TestClient(serve.create_app(settings, loader=lambda s: pipe, calibrator=fixed_timing(QUICK_TIMING))) as c:
        _ready(c)
        response = c.post("/invocations", json={"prompt": "slow", **FAST, "num_inference_steps": 50})
    assert response.status_code == 503
    assert response.json()["status"] == "timed_out"
    assert "1 s limit" in response.json()["error"]
    assert pipe.steps < 50


# --- flags ----------------------------------------------------------------------------------------


def test_parse_args_underscore_flags_and_env_defaults() -> None:
    args = serve.parse_args(
        ["--max_queue", "3", "--invocation_limit_s", "30", "--model_dir", "/m"],
        environ={"SAGEMAKER_BIND_TO_PORT": "9000"},
    )
    settings = serve.settings_from_args(args)
    assert (settings.port, settings.max_queue, settings.invocation_limit_s) == (9000, 3, 30.0)
    assert settings.model_dir == Path("/m")


@pytest.mark.parametrize(
    ("argv", "environ", "named"),
    [
        pytest.param([], {"SAGEMAKER_BIND_TO_PORT": "http"}, "SAGEMAKER_BIND_TO_PORT", id="env-port"),
        pytest.param(["--min_size", "512", "--max_size", "256"], {}, "--min_size", id="min-over-max"),
        pytest.param(["--max-queue", "2"], {}, "--max-queue", id="dashed-flag"),
        pytest.param(["--invocation_limit_s", "0"], {}, "invocation_limit_s", id="limit-0"),
    ],
)
def test_parse_args_bad_value_raises_flag_error_naming_it(argv: list[str], environ: dict[str, str], named: str) -> None:
    with pytest.raises(flags.FlagError, match=named):
        serve.parse_args(argv, environ=environ)
