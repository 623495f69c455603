"""The SageMaker container contract: where a job finds its inputs and leaves its outputs.

Every path hangs off one root, `$SDFLOW_OPT_ML` (default `/opt/ml`), so that the local
runtime can give each job, and each emulated host, a folder of its own."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

FAILURE_REASON_LIMIT = 1024  # SageMaker keeps the first 1,024 characters as FailureReason
EXIT_MESSAGE_LIMIT = 1024  # bytes DescribeProcessingJob keeps as ExitMessage


def opt_ml() -> Path:
    return Path(os.environ.get("SDFLOW_OPT_ML", "/opt/ml"))


def input_config_dir() -> Path:
    return opt_ml() / "input" / "config"


def channel_dir(name: str) -> Path:
    return opt_ml() / "input" / "data" / name


def model_dir() -> Path:
    return opt_ml() / "model"


def checkpoints_dir() -> Path:
    return opt_ml() / "checkpoints"


def output_dir() -> Path:
    return opt_ml() / "output"


def output_data_dir() -> Path:
    """/opt/ml/output/data (the training toolkit's SM_OUTPUT_DATA_DIR): SageMaker uploads what a
    training job leaves here as `<S3OutputPath>/<job>/output/output.tar.gz`, next to model.tar.gz."""
    return output_dir() / "data"


def failure_file() -> Path:
    return output_dir() / "failure"


def _read_json(path: Path, default: Any) -> Any:
    if not path.exists():
        return default
    return json.loads(path.read_text())


def read_hyperparameters() -> dict[str, str]:
    """hyperparameters.json: every value is a string, as SageMaker writes it."""
    raw = _read_json(input_config_dir() / "hyperparameters.json", {})
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in raw.items()}


def read_resource_config() -> dict[str, Any]:
    """resourceconfig.json; a single local host when the file is absent (plain `python -m`)."""
    return _read_json(
        input_config_dir() / "resourceconfig.json",
        {"current_host": "algo-1", "hosts": ["algo-1"], "network_interface_name": "lo"},
    )


def read_input_data_config() -> dict[str, Any]:
    return _read_json(input_config_dir() / "inputdataconfig.json", {})


def write_failure(message: str) -> None:
    """Leave the reason where SageMaker looks for it; never raises (it runs while failing)."""
    try:
        failure_file().parent.mkdir(parents=True, exist_ok=True)
        failure_file().write_text(message[:FAILURE_REASON_LIMIT])
    except OSError:
        print(f"could not write {failure_file()}: {message}", file=sys.stderr)


def fail(exc: BaseException) -> int:
    """Report an exception the SageMaker way; return the exit status to use."""
    reason = f"{type(exc).__name__}: {exc}"
    traceback.print_exception(exc)
    write_failure(reason)
    return 1


def write_exit_message(message: str) -> None:
    """Processing jobs report /opt/ml/output/message (first 1 KB, UTF-8) as ExitMessage; the
    failure file is the training-job contract. Never raises: it runs while failing."""
    path = output_dir() / "message"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = message.encode("utf-8")[:EXIT_MESSAGE_LIMIT]
        path.write_text(data.decode("utf-8", errors="ignore"), encoding="utf-8")
    except OSError:
        print(f"could not write {path}: {message}", file=sys.stderr)


def _caused_by(exc: BaseException, cause: BaseException) -> bool:
    """`cause` is `exc` or in its chain (a library that wraps what it caught: transformers' lazy import
    re-raises a stop that landed inside it as a RuntimeError)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if current is cause:
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def run_processing_job(work: Callable[[], str], stopped: Callable[[int], BaseException]) -> int:
    """A processing job's entrypoint around `work` (which returns its one-line summary): logging
    on, SIGTERM raised inside the work as `stopped(signum)` (SageMaker stops jobs with SIGTERM, so
    the work can clean up), the summary or the error as ExitMessage, the failure file and exit 1
    on error. Returns the exit status. A stop is not a failure (as the training job's, train.cli):
    its log ends in one sentence, not a traceback, it writes no failure file, and it exits
    128 + the signal."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stops: list[tuple[int, BaseException]] = []

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        stops.append((signum, stopped(signum)))
        raise stops[-1][1]

    # Signal handlers can only be installed from the main thread (tests may call from others).
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if in_main_thread else None
    try:
        write_exit_message(work())
        return 0
    except Exception as exc:
        stop = next(((signum, s) for signum, s in stops if _caused_by(exc, s)), None)
        if stop is not None:
            sentence = str(stop[1]).rstrip(".") + "."
            logging.getLogger("sdflow").warning(sentence)
            write_exit_message(sentence)
            return 128 + stop[0]
        write_exit_message(f"{type(exc).__name__}: {exc}")
        return fail(exc)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
