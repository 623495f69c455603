"""The serve job: a Stable Diffusion pipeline behind SageMaker's inference contract.

`docker run IMAGE serve` → GET /ping and POST /invocations on port
`$SAGEMAKER_BIND_TO_PORT` (default 8080). The pipeline is loaded from
`$SDFLOW_OPT_ML/model` in a background thread at startup so that the server answers
/ping at once (503 until the model is ready, with the reason when loading failed).

Inference is serialized: one pipeline call at a time (a GPU holds one model copy and
concurrent calls would only thrash it), run in a worker thread so /ping stays responsive,
with a bounded number of requests allowed to wait; beyond that the server answers 503
"busy" so the caller can retry instead of piling up. Every malformed request is a 400
naming the field at fault, never a 422 or a 500. uvicorn handles SIGTERM: it stops
accepting, lets in-flight requests finish (up to --graceful-timeout) and the process
exits 0.

CLI: `serve [--host H] [--port P] [--model-dir DIR] [--max-queue N] ...`
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from sdflow_image import contract

LOG = logging.getLogger("sdflow.serve")

JSON_TYPE = "application/json"
PNG_TYPE = "image/png"
SIZE_MULTIPLE = 8  # the VAE of every Stable Diffusion model downsamples by a power of two ≤ 8
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a 64-bit value
FALLBACK_IMAGE_SIZE = 512  # when the pipeline does not say what it was trained at


class ServeError(Exception):
    """Base class of the serve job's own errors."""


class ModelNotFoundError(ServeError):
    """The model folder holds no diffusers pipeline."""


class BusyError(ServeError):
    """Too many requests are already waiting for the pipeline."""


class BadRequestError(ServeError):
    """A request the server will not run; carries the field at fault for the 400 body."""

    def __init__(self, message: str, field: str | None = None, errors: list[dict[str, str]] | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.errors = errors or [{"field": field or "body", "message": message}]


# ---------------------------------------------------------------------------------------
# Settings and the request schema
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SizeLimits:
    min_size: int = 64
    max_size: int = 1024
    max_prompt_chars: int = 1000


@dataclass(frozen=True)
class ServeSettings:
    model_dir: Path = field(default_factory=contract.model_dir)
    host: str = "0.0.0.0"
    port: int = 8080
    max_queue: int = 8
    limits: SizeLimits = field(default_factory=SizeLimits)
    max_body_bytes: int = 64 * 1024
    device: str = "auto"
    dtype: str = "auto"
    graceful_timeout: int = 60
    log_level: str = "info"


class InvocationRequest(BaseModel):
    """The body of POST /invocations. Strict: no coercion ("7" is not 7), no unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str
    negative_prompt: str | None = None
    num_inference_steps: int = Field(default=30, ge=1, le=150)
    guidance_scale: float = Field(default=7.5, ge=0.0, le=30.0, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    # None: the size the model was trained at (known once it is loaded).
    width: int | None = None
    height: int | None = None
    num_images: int = Field(default=1, ge=1, le=4)

    @field_validator("prompt", "negative_prompt")
    @classmethod
    def _prompt_length(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return value
        limits = _limits_from(info)
        if info.field_name == "prompt" and not value.strip():
            raise PydanticCustomError("prompt_empty", "must be a non-empty string")
        if len(value) > limits.max_prompt_chars:
            raise PydanticCustomError(
                "prompt_too_long",
                "is {length} characters long; the limit is {limit}",
                {"length": len(value), "limit": limits.max_prompt_chars},
            )
        return value

    @field_validator("width", "height")
    @classmethod
    def _image_size(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None:
            return value
        limits = _limits_from(info)
        if not limits.min_size <= value <= limits.max_size or value % SIZE_MULTIPLE:
            raise PydanticCustomError(
                "image_size",
                "must be a multiple of {multiple} between {low} and {high}",
                {"multiple": SIZE_MULTIPLE, "low": limits.min_size, "high": limits.max_size},
            )
        return value


REQUEST_FIELDS = tuple(InvocationRequest.model_fields)


def _limits_from(info: ValidationInfo) -> SizeLimits:
    context = info.context or {}
    limits = context.get("limits")
    return limits if isinstance(limits, SizeLimits) else SizeLimits()


_JSON_TYPE_NAMES = {
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_request(body: bytes, content_type: str | None, limits: SizeLimits) -> InvocationRequest:
    """Bytes and Content-Type of a POST /invocations → a validated request, or BadRequestError."""
    if content_type is not None:
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type != JSON_TYPE:
            raise BadRequestError(
                f"Content-Type must be {JSON_TYPE}, got {content_type!r}; send the request as JSON",
                field="Content-Type",
            )
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequestError(f"body is not valid JSON: {exc}", field="body") from exc
    if not isinstance(data, dict):
        raise BadRequestError(
            f"body must be a JSON object with the fields {', '.join(REQUEST_FIELDS)}; "
            f"got a JSON {_JSON_TYPE_NAMES.get(type(data), type(data).__name__)}",
            field="body",
        )
    try:
        return InvocationRequest.model_validate(data, context={"limits": limits})
    except ValidationError as exc:
        errors = [_describe_error(err) for err in exc.errors(include_url=False)]
        first = errors[0]
        raise BadRequestError("; ".join(e["message"] for e in errors), field=first["field"], errors=errors) from exc


def _describe_error(err: Any) -> dict[str, str]:
    """One pydantic error → {"field", "message"}, worded for someone writing the request."""
    name = ".".join(str(part) for part in err["loc"]) or "body"
    kind = err["type"]
    if kind == "extra_forbidden":
        message = f"unknown field '{name}'; the allowed fields are {', '.join(REQUEST_FIELDS)}"
    elif kind == "missing":
        message = f"{name} is required"
    else:
        shown = repr(err.get("input"))
        if len(shown) > 60:
            shown = shown[:57] + "..."
        message = f"{name}: {_lower_first(err['msg'])} (got {shown})"
    return {"field": name, "message": message}


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def choose_media_type(accept: str | None) -> str | None:
    """The response type for an Accept header: JSON unless PNG is preferred; None → 406."""
    if accept is None or not accept.strip():
        return JSON_TYPE
    # (quality, -position) so that, at equal quality, the first listed type wins.
    best: tuple[float, int, str] | None = None
    for position, item in enumerate(accept.split(",")):
        parts = [p.strip() for p in item.split(";")]
        media_range = parts[0].lower()
        quality = 1.0
        for param in parts[1:]:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        if quality <= 0:
            continue
        if media_range in ("*/*", "application/*", JSON_TYPE):
            candidate = JSON_TYPE
        elif media_range in ("image/*", PNG_TYPE):
            candidate = PNG_TYPE
        else:
            continue
        key_tuple = (quality, -position, candidate)
        if best is None or key_tuple[:2] > best[:2]:
            best = key_tuple
    return best[2] if best else None


# ---------------------------------------------------------------------------------------
# The model and the inference worker
# ---------------------------------------------------------------------------------------

PipelineLoader = Callable[[ServeSettings], Any]


def _torch_placement(settings: ServeSettings) -> tuple[str, Any]:
    import torch

    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype_name = settings.dtype
    if dtype_name == "auto":
        # Half precision halves memory and doubles speed on a GPU; CPUs lack fast fp16 kernels.
        dtype_name = "float16" if device.startswith("cuda") else "float32"
    return device, getattr(torch, dtype_name)


def load_pipeline(settings: ServeSettings) -> Any:
    """Load the diffusers pipeline from the model folder; nothing is fetched from a hub."""
    model_dir = settings.model_dir
    if not (model_dir / "model_index.json").is_file():
        raise ModelNotFoundError(
            f"no diffusers pipeline in {model_dir} (model_index.json missing); "
            "the training job writes one to $SDFLOW_OPT_ML/model"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import logging as diffusers_logging

    # Progress bars are noise in a server's log (CloudWatch keeps every redraw).
    diffusers_logging.disable_progress_bar()
    device, dtype = _torch_placement(settings)
    pipe = StableDiffusionPipeline.from_pretrained(
        str(model_dir),
        local_files_only=True,
        safety_checker=None,
        requires_safety_checker=False,
        dtype=dtype,
    )
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _native_size(pipe: Any) -> int:
    try:
        return int(pipe.unet.config.sample_size) * int(pipe.vae_scale_factor)
    except (AttributeError, TypeError, ValueError):
        return FALLBACK_IMAGE_SIZE


@dataclass
class Generation:
    images: list[bytes]  # PNG files
    seed: int
    width: int
    height: int
    elapsed_s: float


class ModelServer:
    """Holds the pipeline's load state and runs generations one at a time."""

    def __init__(self, settings: ServeSettings, loader: PipelineLoader = load_pipeline):
        self.settings = settings
        self._loader = loader
        self.status: Literal["loading", "ready", "failed"] = "loading"
        self.error: str | None = None
        self._pipe: Any = None
        self._default_size = FALLBACK_IMAGE_SIZE
        self._pipe_lock = threading.Lock()
        self._queue_lock = asyncio.Lock()
        self._admitted = 0  # running + waiting; touched only on the event loop thread

    def start_loading(self) -> threading.Thread:
        # A daemon thread: a SIGTERM during a long load must not wait for the load to end.
        thread = threading.Thread(target=self._load, name="sdflow-model-loader", daemon=True)
        thread.start()
        return thread

    def _load(self) -> None:
        started = time.monotonic()
        LOG.info("loading model from %s", self.settings.model_dir)
        try:
            pipe = self._loader(self.settings)
        except Exception as exc:  # any failure is reported by /ping, not raised into nowhere
            self.error = f"{type(exc).__name__}: {exc}"
            self.status = "failed"
            LOG.exception("model failed to load from %s", self.settings.model_dir)
            return
        self._pipe = pipe
        self._default_size = _native_size(pipe)
        self.status = "ready"
        LOG.info("model ready in %.1f s", time.monotonic() - started)

    async def generate(self, request: InvocationRequest) -> Generation:
        """Admit, queue and run one request; raises BusyError when the queue is full."""
        if self._admitted > self.settings.max_queue:  # one running + max_queue waiting
            raise BusyError(
                f"server busy: {self._admitted} requests in progress or waiting "
                f"(limit {self.settings.max_queue + 1}); retry later"
            )
        self._admitted += 1
        try:
            async with self._queue_lock:
                return await asyncio.to_thread(self._generate_blocking, request)
        finally:
            self._admitted -= 1

    def _generate_blocking(self, request: InvocationRequest) -> Generation:
        import torch

        seed = request.seed if request.seed is not None else secrets.randbelow(2**31)
        width = request.width or self._default_size
        height = request.height or self._default_size
        LOG.info(
            "generating %d image(s) %dx%d steps=%d guidance=%.2f seed=%d",
            request.num_images,
            width,
            height,
            request.num_inference_steps,
            request.guidance_scale,
            seed,
        )
        started = time.monotonic()
        # A CPU generator gives the same images for the same seed on any device.
        generator = torch.Generator("cpu").manual_seed(seed)
        # The asyncio lock orders requests; this one guards the pipeline itself should a
        # cancelled request's thread still be running when the next one starts.
        with self._pipe_lock:
            result = self._pipe(
                prompt=request.prompt,
                negative_prompt=request.negative_prompt,
                num_inference_steps=request.num_inference_steps,
                guidance_scale=request.guidance_scale,
                width=width,
                height=height,
                num_images_per_prompt=request.num_images,
                generator=generator,
                output_type="pil",
            )
        pngs = [_to_png(image) for image in result.images]
        elapsed = time.monotonic() - started
        LOG.info("generated %d image(s) in %.2f s", len(pngs), elapsed)
        return Generation(images=pngs, seed=seed, width=width, height=height, elapsed_s=elapsed)


def _to_png(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------
# The HTTP app
# ---------------------------------------------------------------------------------------


def _error(http_status: int, message: str, headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=http_status, headers=headers)


def _bad_request(exc: BadRequestError) -> JSONResponse:
    return _error(400, exc.message, field=exc.field, errors=exc.errors)


def create_app(settings: ServeSettings | None = None, loader: PipelineLoader = load_pipeline) -> FastAPI:
    """The ASGI app; `loader` is the seam tests use to control when and what loads."""
    settings = settings or ServeSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server = ModelServer(settings, loader)
        app.state.server = server
        server.start_loading()
        yield
        LOG.info("shutting down")

    app = FastAPI(title="sdflow serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Routes parse their own bodies; this only keeps FastAPI from ever answering 422.
        return _error(400, f"invalid request: {exc.errors()}", field="body")

    @app.get("/ping")
    async def ping(request: Request) -> JSONResponse:
        server: ModelServer = request.app.state.server
        if server.status == "ready":
            return JSONResponse({"status": "ready"})
        if server.status == "failed":
            return _error(503, f"model failed to load: {server.error}", status="failed")
        return _error(503, "model is loading", status="loading")

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        server: ModelServer = request.app.state.server
        media_type = choose_media_type(request.headers.get("accept"))
        if media_type is None:
            return _error(
                406,
                f"cannot answer with Accept: {request.headers.get('accept')!r}; ask for {JSON_TYPE} or {PNG_TYPE}",
                field="Accept",
            )
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > settings.max_body_bytes:
            return _bad_request(_too_large(int(declared), settings))
        body = await request.body()
        if len(body) > settings.max_body_bytes:
            return _bad_request(_too_large(len(body), settings))
        try:
            parsed = parse_request(body, request.headers.get("content-type"), settings.limits)
        except BadRequestError as exc:
            return _bad_request(exc)
        if server.status != "ready":
            detail = f"model failed to load: {server.error}" if server.status == "failed" else "model is loading"
            return _error(503, detail, status=server.status)
        try:
            generation = await server.generate(parsed)
        except BusyError as exc:
            return _error(503, str(exc), headers={"Retry-After": "1"}, status="busy")
        except Exception as exc:  # the model failing on valid input is the server's fault
            LOG.exception("generation failed")
            return _error(500, f"generation failed: {type(exc).__name__}: {exc}")
        headers = {"X-Sdflow-Seed": str(generation.seed)}
        if media_type == PNG_TYPE:
            return Response(content=generation.images[0], media_type=PNG_TYPE, headers=headers)
        return JSONResponse(
            {
                "images": [base64.b64encode(png).decode("ascii") for png in generation.images],
                "content_type": PNG_TYPE,
                "seed": generation.seed,
                "width": generation.width,
                "height": generation.height,
                "num_inference_steps": parsed.num_inference_steps,
                "guidance_scale": parsed.guidance_scale,
                "num_images": len(generation.images),
                "elapsed_s": round(generation.elapsed_s, 3),
            },
            headers=headers,
        )

    return app


def _too_large(size: int, settings: ServeSettings) -> BadRequestError:
    return BadRequestError(f"body is {size} bytes; the limit is {settings.max_body_bytes}", field="body")


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise SystemExit(f"{name} must be an integer, got {raw!r}") from exc


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be ≥ 0, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="serve",
        description="Serve the Stable Diffusion pipeline in $SDFLOW_OPT_ML/model "
        "(the SageMaker inference contract: GET /ping, POST /invocations).",
    )
    parser.add_argument(
        "--host",
        default=os.environ.get("SDFLOW_SERVE_HOST", "0.0.0.0"),
        help="address to bind (default $SDFLOW_SERVE_HOST or 0.0.0.0)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=_env_int("SAGEMAKER_BIND_TO_PORT", 8080),
        help="port to bind (default $SAGEMAKER_BIND_TO_PORT or 8080)",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="diffusers pipeline folder (default $SDFLOW_OPT_ML/model)",
    )
    parser.add_argument(
        "--max-queue",
        type=_non_negative_int,
        default=_env_int("SDFLOW_SERVE_MAX_QUEUE", 8),
        help="requests allowed to wait while one runs; more get 503 busy (default 8)",
    )
    parser.add_argument("--min-size", type=int, default=64, help="smallest width/height accepted (default 64)")
    parser.add_argument("--max-size", type=int, default=1024, help="largest width/height accepted (default 1024)")
    parser.add_argument("--max-prompt-chars", type=int, default=1000, help="longest prompt accepted (default 1000)")
    parser.add_argument("--device", default="auto", help="torch device: auto, cpu, cuda, cuda:N (default auto)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="weights dtype (default: float16 on GPU, float32 on CPU)",
    )
    parser.add_argument(
        "--graceful-timeout",
        type=int,
        default=60,
        help="seconds in-flight requests get to finish after SIGTERM (default 60)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    if args.min_size % SIZE_MULTIPLE or args.max_size % SIZE_MULTIPLE or not 0 < args.min_size <= args.max_size:
        parser.error(
            f"--min-size and --max-size must be multiples of {SIZE_MULTIPLE} with 0 < min ≤ max, "
            f"got {args.min_size} and {args.max_size}"
        )
    return args


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    return ServeSettings(
        model_dir=args.model_dir or contract.model_dir(),
        host=args.host,
        port=args.port,
        max_queue=args.max_queue,
        limits=SizeLimits(min_size=args.min_size, max_size=args.max_size, max_prompt_chars=args.max_prompt_chars),
        device=args.device,
        dtype=args.dtype,
        graceful_timeout=args.graceful_timeout,
        log_level=args.log_level,
    )


def main(args: argparse.Namespace | None = None) -> int:
    import uvicorn

    args = args if args is not None else parse_args()
    settings = settings_from_args(args)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    stop_signals: list[int] = []

    def _record_stop(signum: int, frame: Any) -> None:
        stop_signals.append(signum)

    # uvicorn re-raises the signal that stopped it once it has shut down, into the handler
    # that was installed before it started; recording it here turns a graceful SIGTERM
    # into exit status 0, which is what SageMaker and the local runtime expect.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _record_stop)
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=settings.graceful_timeout,
        # One process: a second worker would load a second copy of the model.
        workers=1,
    )
    server = uvicorn.Server(config)
    LOG.info("serving %s on %s:%d", settings.model_dir, settings.host, settings.port)
    server.run()
    if stop_signals:
        LOG.info("stopped by %s", signal.Signals(stop_signals[0]).name)
    # uvicorn returns normally when it could not bind; that start-up failure is not a clean stop.
    return 0 if server.started or stop_signals else 1


if __name__ == "__main__":
    sys.exit(main())
