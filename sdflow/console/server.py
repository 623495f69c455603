"""`sdflow console`: the run console's web server (FastAPI), on 127.0.0.1 only.

The page (static/, plain ES modules and a vendored dagre; no build step) polls the JSON API
below; every answer is computed from public AWS APIs by RunReader and JobReader, cached for about
a second so that several open pages cost the cloud what one does. API.md is the contract."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from botocore.exceptions import BotoCoreError, ClientError
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from sdflow.console.aws import Clients, ConsoleError, translate
from sdflow.console.jobs import JobReader
from sdflow.console.runs import RunReader

STATIC = Path(__file__).parent / "static"
HOST = "127.0.0.1"  # never another interface: the console has no authentication of its own
DEFAULT_PORT = 8566
LOG = logging.getLogger(__name__)


@dataclass
class ConsoleConfig:
    client: Any  # (service, config=...) -> boto3 client
    endpoint_url: str | None
    region: str | None
    bucket: str | None
    state_machine_arn: str | None
    notify_log_group: str | None = None


class InvokeRequest(BaseModel):
    prompt: str = Field(min_length=1, max_length=1000)
    seed: int | None = Field(default=None, ge=0, le=2**32 - 1)
    num_inference_steps: int | None = Field(default=None, ge=1, le=100)


def create_app(config: ConsoleConfig) -> FastAPI:
    clients = Clients(config.client, config.endpoint_url)
    runs = RunReader(clients, config.bucket, config.state_machine_arn)
    jobs = JobReader(clients, config.bucket, config.notify_log_group)
    app = FastAPI(title="sdflow console", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.clients = clients
    _add_error_handlers(app, config)
    _add_run_routes(app, config, runs, jobs)
    _add_job_routes(app, jobs)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def _add_error_handlers(app: FastAPI, config: ConsoleConfig) -> None:
    @app.exception_handler(ConsoleError)
    def console_error(_request: Request, exc: ConsoleError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(ClientError)
    @app.exception_handler(BotoCoreError)
    def aws_error(_request: Request, exc: Exception) -> JSONResponse:
        translated = translate(exc, config.endpoint_url)
        return JSONResponse(translated.body(), status_code=translated.status)

    @app.exception_handler(RequestValidationError)
    def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in problem.get('loc', ())[1:]) or 'request'}: {problem.get('msg')}"
            for problem in exc.errors()
        )
        error = ConsoleError(422, "InvalidRequest", problems[:300] or "invalid request", "correct it and try again")
        return JSONResponse(error.body(), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = ConsoleError(exc.status_code, f"HTTP{exc.status_code}", str(exc.detail)[:300])
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Logged here with its traceback; the page gets one line, never the trace.
        LOG.exception("console: %s %s failed", request.method, request.url.path)
        first_line = next(iter(str(exc).strip().splitlines()), "")
        error = ConsoleError(500, type(exc).__name__, f"the console failed to answer: {first_line}"[:300])
        return JSONResponse(error.body(), status_code=500)


def _add_run_routes(app: FastAPI, config: ConsoleConfig, runs: RunReader, jobs: JobReader) -> None:
    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    @app.get("/api/overview")
    def overview() -> dict[str, Any]:
        return {
            "endpoint_url": config.endpoint_url,
            "region": config.region,
            "state_machine_arn": config.state_machine_arn,
            "bucket": config.bucket,
            "runs": runs.runs(),
        }

    @app.get("/api/runs/{name}")
    def run(name: str) -> dict[str, Any]:
        found = runs.run(name)
        answer = {key: value for key, value in found.items() if key not in {"description", "history"}}
        answer["training"] = jobs.training(found)
        answer["evaluation"] = jobs.evaluation(found)
        answer["endpoint"] = endpoint = jobs.endpoint(found)
        if endpoint and endpoint.get("config_name") and not endpoint.get("serves_this_run"):
            endpoint["serving_run"] = runs.run_deploying(endpoint["config_name"])
        answer["notifications"] = jobs.notifications(found)
        answer["poll_after_s"] = 10.0 if found["finished"] else 1.5
        return answer

    @app.get("/api/runs/{name}/states/{state}")
    def state(name: str, state: str) -> dict[str, Any]:
        return runs.state(name, state)

    @app.get("/api/runs/{name}/maps/{state}/children")
    def children(name: str, state: str, status: str | None = None, next_token: str | None = None) -> dict[str, Any]:
        if status and status not in {"RUNNING", "SUCCEEDED", "FAILED", "TIMED_OUT", "ABORTED", "PENDING_REDRIVE"}:
            raise ConsoleError(400, "BadStatus", f"status {status[:40]!r} is not an execution status")
        return runs.children(name, state, status or None, next_token or None)


def _add_job_routes(app: FastAPI, jobs: JobReader) -> None:
    @app.get("/api/logs")
    def logs(group: str, stream: str, next_token: str | None = None) -> dict[str, Any]:
        if not group.startswith(("/aws/sagemaker/", "/aws/lambda/")):
            raise ConsoleError(403, "OtherLogGroup", f"the console reads the pipeline's log groups, not {group[:100]}")
        return jobs.logs(group, stream, next_token or None)

    @app.get("/api/artifact")
    def artifact(uri: str, member: str | None = None) -> Response:
        body, content_type = jobs.artifact(uri, member)
        return Response(body, media_type=content_type, headers={"Cache-Control": "max-age=60"})

    @app.post("/api/endpoints/{name}/invoke")
    def invoke(name: str, request: InvokeRequest) -> dict[str, Any]:
        body = request.model_dump(exclude_none=True)
        return jobs.invoke(name, body)


class ConsoleServer:
    """uvicorn in a daemon thread: `sdflow local up` and `sdflow demo` run the console beside
    the local cloud in their own process; `sdflow console` runs it alone."""

    def __init__(self, config: ConsoleConfig, port: int = DEFAULT_PORT) -> None:
        self.app = create_app(config)
        settings = uvicorn.Config(self.app, host=HOST, port=port, log_level="warning", access_log=False)
        self._server = uvicorn.Server(settings)
        self._thread = threading.Thread(target=self._server.run, name="sdflow-console", daemon=True)

    @property
    def url(self) -> str:
        sockets = [s for server in self._server.servers for s in server.sockets]
        port = sockets[0].getsockname()[1]
        return f"http://{HOST}:{port}/"

    def start(self, timeout_s: float = 15.0) -> ConsoleServer:
        self._thread.start()
        waited = 0.0
        while not self._server.started:
            if not self._thread.is_alive():
                raise OSError("the console's web server did not start (is its port taken? pass another --console-port)")
            threading.Event().wait(0.05)
            waited += 0.05
            if waited > timeout_s:
                raise OSError("the console's web server did not start within 15 s")
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    @property
    def api_calls(self) -> int:
        return int(self.app.state.clients.calls)

    @property
    def api_operations(self) -> dict[str, int]:
        return dict(self.app.state.clients.operations)

    def __enter__(self) -> ConsoleServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
