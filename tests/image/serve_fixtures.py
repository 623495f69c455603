"""Helpers for the serve tests: stand-in pipelines, a served app on a real port, raw HTTP clients."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI
from PIL import Image

from sdflow_image.serving.serve_model import StepTiming
from tests.helpers import free_port

# Fast enough that no stand-in request comes near SageMaker's 60 s.
QUICK_TIMING = StepTiming(size=64, step_s=0.001, overhead_s=0.001)


def fixed_timing(timing: StepTiming) -> Callable[[Any, int], StepTiming]:
    """A calibrator that reports `timing` without running anything."""
    return lambda pipe, size: timing


class InstantPipeline:
    """Answers at once with solid images, calling the step callback as diffusers does."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(
        self,
        *,
        width: int,
        height: int,
        num_images_per_prompt: int,
        num_inference_steps: int,
        callback_on_step_end: Callable[..., Any] | None = None,
        **_: Any,
    ) -> Any:
        self.calls += 1
        for step in range(num_inference_steps):
            if callback_on_step_end is not None:
                callback_on_step_end(self, step, 1000 - step, {})
        images = [Image.new("RGB", (width, height), (10, 200, 10)) for _ in range(num_images_per_prompt)]
        return type("Output", (), {"images": images})()


class SteppingPipeline:
    """Wraps a pipeline (real or stand-in) to count its denoising steps and slow each one down."""

    def __init__(self, pipe: Any, step_delay_s: float):
        self._pipe = pipe
        self._delay = step_delay_s
        self.calls = 0
        self.steps = 0
        self.stepping = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def __call__(self, **kwargs: Any) -> Any:
        self.calls += 1
        inner = kwargs.get("callback_on_step_end")

        def on_step_end(pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            self.steps += 1
            self.stepping.set()
            time.sleep(self._delay)
            return inner(pipe, step, timestep, tensors) if inner else {}

        kwargs["callback_on_step_end"] = on_step_end
        return self._pipe(**kwargs)


@contextmanager
def served_on_port(app: FastAPI) -> Iterator[int]:
    """Run `app` under uvicorn on 127.0.0.1 (a real socket, so clients can really go away)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive(), "uvicorn stopped before it started serving"
        assert time.monotonic() < deadline, "uvicorn did not start within 30 s"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(30)


def open_invocation(port: int, request: dict[str, Any]) -> socket.socket:
    """Send POST /invocations on a raw socket and return it unread: closing it abandons the request."""
    body = json.dumps(request).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(
        b"POST /invocations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def read_status(sock: socket.socket) -> tuple[int, bytes]:
    """The status and body of the one response on `sock` (the server closes or sends it whole)."""
    status, _headers, body = read_response(sock)
    return status, body


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The status, headers (lower-case names) and body of the one response on `sock`."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    length = int(headers["content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        rest += chunk
    return int(status_line.split(" ", 2)[1]), headers, rest


def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
