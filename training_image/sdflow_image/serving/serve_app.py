"""The HTTP side of the serve job: GET /ping and POST /invocations (SageMaker's inference contract).

/ping: 200 once the model is loaded and timed; 503 while it loads; 500 at once when loading
failed, with the cause in the body and the log: a model that will never load should fail the
endpoint now, not after the health-check window runs out.

/invocations: every malformed request is a 4xx naming the field at fault (never a 422 or a
500). A request that would not end within SageMaker's limit behind the work already admitted
(serve_admission) is a 429 "busy": the throttle status (RFC 6585), which a client calling the
container directly retries after the Retry-After header (urllib3's Retry does so for 413, 429
and 503), with the seconds to wait twice: in that header and as `retry_after_s` in the body.
Through SageMaker only the body survives: InvokeEndpoint turns any 4xx/5xx of the container
into ModelError (424) carrying the status in OriginalStatusCode and the body in OriginalMessage,
and no header of the container's answer (see sdflow/local/sagemaker/invoke.py for what AWS
documents). Error bodies are ASCII
JSON, so an error that quotes the request (a lone surrogate in a field name) can always be
encoded.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from sdflow_image.serving.serve_model import ServeSettings, calibrate, load_pipeline
from sdflow_image.serving.serve_request import (
    JSON_TYPE,
    PNG_TYPE,
    BadRequestError,
    choose_media_type,
    parse_request,
)
from sdflow_image.serving.serve_worker import (
    BusyError,
    Calibrator,
    ClientGoneError,
    DeadlineError,
    Generation,
    ModelServer,
    PipelineLoader,
)

LOG = logging.getLogger("sdflow.serve")

DISCONNECT_POLL_S = 0.2
# nginx's "client closed request": nobody reads it, but the access log then says what happened.
CLIENT_CLOSED_REQUEST = 499
TOO_MANY_REQUESTS = 429


class AsciiJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _error(http_status: int, message: str, headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    return AsciiJSONResponse({"error": message, **extra}, status_code=http_status, headers=headers)


def _bad_request(exc: BadRequestError) -> JSONResponse:
    return _error(exc.status, exc.message, field=exc.field, errors=exc.errors, **exc.extra)


def _too_large(size: int, settings: ServeSettings) -> BadRequestError:
    return BadRequestError(f"body is {size} bytes; the limit is {settings.max_body_bytes}", field="body", status=413)


def _not_ready(server: ModelServer) -> JSONResponse:
    if server.status == "failed":
        return _error(500, f"model failed to load: {server.error}", status="failed")
    return _error(503, "model is loading", status="loading")


async def _watch_disconnect(request: Request, gone: threading.Event) -> None:
    while not gone.is_set():
        if await request.is_disconnected():
            gone.set()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


def _generation_response(generation: Generation, media_type: str, steps: int, guidance: float) -> Response:
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
            "num_inference_steps": steps,
            "guidance_scale": guidance,
            "num_images": len(generation.images),
            "elapsed_s": round(generation.elapsed_s, 3),
        },
        headers=headers,
    )


def _generation_failed(exc: Exception) -> JSONResponse:
    """The answer to a request whose generation did not finish."""
    if isinstance(exc, BadRequestError):  # more than the GPU holds: the caller's to change
        return _bad_request(exc)
    if isinstance(exc, BusyError):
        return _error(
            TOO_MANY_REQUESTS,
            str(exc),
            headers={"Retry-After": str(exc.retry_after_s)},
            status="busy",
            retry_after_s=exc.retry_after_s,
        )
    if isinstance(exc, ClientGoneError):
        LOG.info("request dropped: %s", exc)
        return _error(CLIENT_CLOSED_REQUEST, str(exc), status="dropped")
    if isinstance(exc, DeadlineError):
        LOG.warning("request stopped: %s", exc)
        return _error(503, str(exc), status="timed_out")
    # The model failing on valid input is the server's fault.
    LOG.error("generation failed", exc_info=exc)
    return _error(500, f"generation failed: {type(exc).__name__}: {exc}")


def create_app(
    settings: ServeSettings | None = None,
    loader: PipelineLoader = load_pipeline,
    calibrator: Calibrator = calibrate,
) -> FastAPI:
    """The ASGI app; `loader` and `calibrator` are the seams tests use to control loading."""
    settings = settings or ServeSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server = ModelServer(settings, loader, calibrator)
        app.state.server = server
        server.start_loading()
        yield
        LOG.info("shutting down")

    app = FastAPI(title="sdflow serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Routes parse their own bodies; this only keeps FastAPI from ever answering 422.
        return _error(400, "invalid request", field="body")

    @app.get("/ping")
    async def ping(request: Request) -> JSONResponse:
        server: ModelServer = request.app.state.server
        if server.status == "ready":
            return JSONResponse({"status": "ready"})
        return _not_ready(server)

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        arrived = time.monotonic()
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
        gone = threading.Event()
        try:
            parsed = parse_request(body, request.headers.get("content-type"), settings.limits)
            if server.status != "ready":
                return _not_ready(server)
            job = server.plan(parsed, gone, arrived)
        except BadRequestError as exc:
            return _bad_request(exc)
        watcher = asyncio.create_task(_watch_disconnect(request, gone))
        try:
            generation = await server.generate(job)
        except Exception as exc:
            return _generation_failed(exc)
        finally:
            watcher.cancel()
        return _generation_response(generation, media_type, parsed.num_inference_steps, parsed.guidance_scale)

    return app
