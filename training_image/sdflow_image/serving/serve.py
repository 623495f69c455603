"""The serve job: a Stable Diffusion pipeline behind SageMaker's inference contract.

`docker run IMAGE serve` → GET /ping and POST /invocations on port
`$SAGEMAKER_BIND_TO_PORT` (default 8080). The pipeline is loaded from
`$SDFLOW_OPT_ML/model` in a background thread at startup so that the server answers
/ping at once (503 while loading, 500 with the cause when loading failed).

The pieces: serve_request (the request schema and parsing), serve_model (settings, loading,
the timing that bounds a request's duration), serve_admission (admitting what can end within
SageMaker's 60 s at the model's measured speed), serve_worker (the one-at-a-time worker per
GPU, dropping abandoned work), serve_app (the HTTP routes). uvicorn handles SIGTERM: it
stops accepting, lets in-flight requests finish (up to --graceful_timeout) and the process
exits 0.

CLI: `serve [--host H] [--port P] [--model_dir DIR] [--max_queue N] ...` (see --help).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sdflow_image import contract, flags, gpu_check
from sdflow_image.serving.serve_app import create_app
from sdflow_image.serving.serve_model import DEFAULT_BASE_MODEL_DIR, INVOCATION_LIMIT_S, ServeSettings, load_pipeline
from sdflow_image.serving.serve_request import SIZE_MULTIPLE, SizeLimits
from sdflow_image.serving.serve_worker import ModelServer

__all__ = ["FLAGS", "ModelServer", "ServeSettings", "create_app", "load_pipeline", "main", "parse_args"]

LOG = logging.getLogger("sdflow.serve")

FLAGS: list[flags.Flag] = [
    flags.Flag("host", flags.text, "0.0.0.0", "address to bind", env="SDFLOW_SERVE_HOST"),
    flags.Flag("port", flags.number(int, 1, maximum=65535), 8080, "port to bind", env="SAGEMAKER_BIND_TO_PORT"),
    flags.Flag("model_dir", flags.text, None, "diffusers pipeline folder (default $SDFLOW_OPT_ML/model)"),
    flags.Flag(
        "base_model_dir",
        flags.text,
        DEFAULT_BASE_MODEL_DIR,
        "a LoRA model's base pipeline (SageMaker's AdditionalModelDataSources channel 'base_model')",
        env="SDFLOW_BASE_MODEL_DIR",
    ),
    flags.Flag(
        "max_queue",
        flags.non_negative_int,
        1000,
        "most requests allowed to wait (a guard on memory: requests that would not end within "
        "--invocation_limit_s are refused first, with 429 and Retry-After)",
        env="SDFLOW_SERVE_MAX_QUEUE",
    ),
    flags.Flag("min_size", flags.positive_int, 64, "smallest width/height accepted"),
    flags.Flag("max_size", flags.positive_int, 1024, "largest width/height accepted"),
    flags.Flag("max_prompt_chars", flags.positive_int, 1000, "longest prompt accepted"),
    flags.Flag("device", flags.text, "auto", "torch device: auto, cpu, cuda, cuda:N"),
    flags.Flag(
        "dtype",
        flags.choice(["auto", "float32", "float16", "bfloat16"]),
        "auto",
        "weights dtype; auto: the dtype training saved (sdflow_model.json) on a GPU, float32 on a CPU",
    ),
    flags.Flag(
        "invocation_limit_s",
        flags.positive_float,
        INVOCATION_LIMIT_S,
        "seconds a request may take (SageMaker's InvokeEndpoint limit); longer ones are refused up front",
        env="SDFLOW_SERVE_INVOCATION_LIMIT_S",
    ),
    flags.Flag("graceful_timeout", flags.non_negative_int, 60, "seconds in-flight requests get after SIGTERM"),
    flags.Flag("log_level", flags.choice(["debug", "info", "warning", "error"]), "info", "log level"),
]


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    return flags.build_parser(
        "serve",
        "Serve the Stable Diffusion pipeline in $SDFLOW_OPT_ML/model "
        "(the SageMaker inference contract: GET /ping, POST /invocations).",
        FLAGS,
        environ,
    )


def parse_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Parse serve's flags (environment defaults from `environ`); raises flags.FlagError naming the flag."""
    args = flags.parse(build_parser(environ), FLAGS, argv)
    if args.min_size % SIZE_MULTIPLE or args.max_size % SIZE_MULTIPLE or args.min_size > args.max_size:
        raise flags.FlagError(
            f"--min_size and --max_size must be multiples of {SIZE_MULTIPLE} with min <= max, "
            f"got {args.min_size} and {args.max_size}"
        )
    return args


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    return ServeSettings(
        model_dir=Path(args.model_dir) if args.model_dir else contract.model_dir(),
        base_model_dir=Path(args.base_model_dir),
        host=args.host,
        port=args.port,
        max_queue=args.max_queue,
        limits=SizeLimits(min_size=args.min_size, max_size=args.max_size, max_prompt_chars=args.max_prompt_chars),
        device=args.device,
        dtype=args.dtype,
        graceful_timeout=args.graceful_timeout,
        log_level=args.log_level,
        invocation_limit_s=args.invocation_limit_s,
    )


def main(args: argparse.Namespace | None = None) -> int:
    import uvicorn

    if args is None:
        try:
            args = parse_args()
        except flags.FlagError as exc:
            print(f"serve: {exc}", file=sys.stderr)
            return 2
    try:
        gpu_check.require_cuda()  # cuda-compat if the driver needs it; a GPU torch cannot use fails, naming the driver
    except gpu_check.NoCudaError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 1
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
