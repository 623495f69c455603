"""The download job: one LAION-style parquet file -> webdataset shards, with img2dataset.

SageMaker runs it as a processing job (`ContainerEntrypoint = ["download"]`, arguments in
docs/contracts.md, "The download job"). What it promises:
- the parquet is checked before anything is downloaded (readable, has rows, has the named
  columns), so a bad input fails in seconds with a message that names the problem;
- img2dataset runs in a child process with its own process group, and the whole group is
  killed at --deadline-seconds: a URL can hang img2dataset forever (img2dataset#437), and
  a per-URL timeout alone does not prevent it;
- `_SUCCESS` (JSON totals) is written last, after the shards are in place, and a run on an
  output folder that already has it does nothing: retries and reruns are free;
- work happens in a folder inside --output; a crash leaves finished shards there for the
  next run (img2dataset resumes from them) and never a half-written `_SUCCESS`.
Any error goes to the SageMaker failure file (and the processing job's ExitMessage file),
and the exit status is non-zero."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import multiprocessing
import os
import re
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from sdflow_image import contract

LOG = logging.getLogger("sdflow.download")

SUCCESS_FILE = "_SUCCESS"
WORK_DIR = "_sdflow_work"  # inside --output; removed once the shards are published
RESIZE_MODES = ("no", "keep_ratio", "keep_ratio_largest", "center_crop", "border")
# img2dataset names shards with 5 digits (oom_shard_count=5): NNNNN.tar, NNNNN_stats.json, NNNNN.parquet
SHARD_FILE = re.compile(r"^(\d{5,})(\.tar|_stats\.json|\.parquet)$")
STATS_FILE = re.compile(r"^(\d{5,})_stats\.json$")
EXIT_MESSAGE_LIMIT = 1024  # bytes DescribeProcessingJob keeps as ExitMessage


class DownloadError(RuntimeError):
    """The download job cannot produce the shard; the message says why and what to change."""


class InvalidArguments(DownloadError):
    pass


class InputNotFound(DownloadError):
    pass


class UnreadableParquet(DownloadError):
    pass


class EmptyParquet(DownloadError):
    pass


class MissingColumn(DownloadError):
    pass


class DeadlineExceeded(DownloadError):
    pass


class DownloaderFailed(DownloadError):
    pass


class IncompleteShards(DownloadError):
    pass


class Terminated(DownloadError):
    """SIGTERM: SageMaker is stopping the job."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse would print and exit 2; raising lets main() put the reason in the failure file.
        raise InvalidArguments(f"{message} (see `download --help`)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a positive, finite number of seconds, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="download",
        description="Download the images of one LAION-style parquet file into webdataset shards.",
    )
    parser.add_argument(
        "--input",
        type=Path,
        required=True,
        help="the parquet file, or a folder holding exactly one parquet file (the processing input)",
    )
    parser.add_argument(
        "--output", type=Path, required=True, help="folder for the shards and _SUCCESS (processing output)"
    )
    parser.add_argument("--url-col", default="URL", help="parquet column with the image URLs (default: URL)")
    parser.add_argument("--caption-col", default="TEXT", help="parquet column with the captions (default: TEXT)")
    parser.add_argument("--image-size", type=_positive_int, default=256, help="side of the stored images in pixels")
    parser.add_argument("--resize-mode", choices=RESIZE_MODES, default="center_crop", help="img2dataset resize mode")
    parser.add_argument("--samples-per-shard", type=_positive_int, default=1000, help="rows per webdataset tar file")
    parser.add_argument("--processes", type=_positive_int, default=4, help="img2dataset worker processes")
    parser.add_argument("--threads", type=_positive_int, default=16, help="download threads per process")
    parser.add_argument(
        "--url-timeout",
        type=_positive_float,
        default=10.0,
        help="seconds a single URL may stall (socket timeout) before it counts as failed",
    )
    parser.add_argument(
        "--deadline-seconds",
        type=_positive_float,
        default=3300.0,
        help="hard limit for the whole job; the downloader is killed and the job fails when it passes",
    )
    parser.add_argument(
        "--retries", type=_non_negative_int, default=0, help="extra attempts per failed URL (default 0)"
    )
    parser.add_argument(
        "--shard-id", default=None, help="recorded in _SUCCESS when given (the index uses the folder name)"
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the job's arguments; raises InvalidArguments with argparse's message."""
    return build_parser().parse_args(argv)


# --- input checks -------------------------------------------------------------------------


def resolve_input(path: Path) -> Path:
    """The parquet file named by --input: the file itself, or the single one in a folder."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise InputNotFound(f"--input {path} does not exist; pass the parquet file or its folder")
    files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    parquets = [p for p in files if p.suffix == ".parquet"]
    # An S3 key need not end in .parquet, so a folder with one file of any name is accepted too.
    candidates = parquets or files
    if len(candidates) != 1:
        listing = ", ".join(p.name for p in candidates) or "nothing"
        raise InputNotFound(f"--input {path} must hold exactly one parquet file, found {len(candidates)}: {listing}")
    return candidates[0]


def validate_parquet(path: Path, url_col: str, caption_col: str) -> int:
    """Check that the file is a parquet file with rows and the named columns; return the row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        columns = parquet.schema_arrow.names
        rows = parquet.metadata.num_rows
    except (pa.ArrowException, OSError) as exc:
        raise UnreadableParquet(
            f"{path.name} is not a readable parquet file ({exc}); --input must point at a parquet file"
        ) from exc
    for flag, column in (("--url-col", url_col), ("--caption-col", caption_col)):
        if column not in columns:
            raise MissingColumn(
                f"column {column!r} ({flag}) is not in {path.name}; columns present: {columns}. "
                f"Set the run's dataset column names to match the parquet file"
            )
    url_type = parquet.schema_arrow.field(url_col).type
    if not (pa.types.is_string(url_type) or pa.types.is_large_string(url_type)):
        raise MissingColumn(f"column {url_col!r} (--url-col) in {path.name} holds {url_type}, not URL strings")
    if rows == 0:
        raise EmptyParquet(f"{path.name} has no rows: there is nothing to download")
    return rows


# --- the downloader in its own process group ----------------------------------------------


def img2dataset_options(args: argparse.Namespace, parquet: Path, output_folder: Path) -> dict[str, Any]:
    """The keyword arguments for img2dataset.download; bench/bench_download.py reuses them."""
    return {
        "url_list": str(parquet),
        "input_format": "parquet",
        "url_col": args.url_col,
        "caption_col": args.caption_col,
        "output_format": "webdataset",
        "output_folder": str(output_folder),
        "image_size": args.image_size,
        "resize_mode": args.resize_mode,
        "processes_count": args.processes,
        "thread_count": args.threads,
        "number_sample_per_shard": args.samples_per_shard,
        "timeout": args.url_timeout,
        "retries": args.retries,
        "encode_format": "jpg",
        "distributor": "multiprocessing",
        "enable_wandb": False,
        # Resume: shards whose stats file exists are skipped on a rerun after a crash.
        "incremental_mode": "incremental",
    }


def _import_img2dataset() -> Any:
    # Albumentations (an img2dataset dependency) checks PyPI for updates at import time.
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    os.environ.setdefault("WANDB_MODE", "disabled")
    import img2dataset

    return img2dataset


def _run_img2dataset(options: dict[str, Any]) -> None:
    _import_img2dataset().download(**options)


def _child_entry(target: Callable[..., None], args: tuple[Any, ...], error_file: str) -> None:
    # A session of its own makes this process the leader of a group that holds every worker
    # img2dataset spawns, so the parent can kill them all at once.
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        target(*args)
    except BaseException as exc:
        traceback.print_exc()
        Path(error_file).write_text(f"{type(exc).__name__}: {exc}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()


def _kill_group(process: multiprocessing.process.BaseProcess) -> None:
    if process.pid is None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        # The child died or has not reached setsid() yet: then it has no workers to take along.
        process.kill()
    process.join(timeout=10)


def run_with_deadline(target: Callable[..., None], args: tuple[Any, ...], deadline: float, error_file: Path) -> None:
    """Run target(*args) in a forked child that leads its own process group; kill the whole
    group when the monotonic clock passes `deadline` (or this process is interrupted).
    Raises DeadlineExceeded, or DownloaderFailed when the child fails."""
    # fork, not spawn: a spawned child would pay img2dataset's multi-second import again.
    process = multiprocessing.get_context("fork").Process(
        target=_child_entry, args=(target, args, str(error_file)), name="sdflow-download", daemon=False
    )
    error_file.unlink(missing_ok=True)
    # Frozen objects are left alone by the child's garbage collector, so it does not touch
    # (and copy-on-write) every page of the parent's heap.
    gc.freeze()
    try:
        process.start()
    finally:
        gc.unfreeze()
    try:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    except BaseException:  # SIGTERM (Terminated) or Ctrl-C while waiting
        _kill_group(process)
        raise
    timed_out = process.is_alive()
    # Also after a normal exit: a worker img2dataset left behind must not outlive the job.
    _kill_group(process)
    if timed_out:
        raise DeadlineExceeded("the downloader did not finish before the deadline")
    if process.exitcode != 0:
        if error_file.exists():
            raise DownloaderFailed(f"img2dataset failed: {error_file.read_text()}")
        raise DownloaderFailed(
            f"img2dataset exited with status {process.exitcode}"
            + (" (killed by a signal: out of memory?)" if (process.exitcode or 0) < 0 else "")
        )


# --- results ------------------------------------------------------------------------------


def _read_stats(folder: Path) -> dict[int, dict[str, Any]]:
    stats = {}
    for path in folder.iterdir():
        match = STATS_FILE.match(path.name)
        if match:
            stats[int(match.group(1))] = json.loads(path.read_text())
    return stats


def _publish(work: Path, output: Path) -> list[str]:
    """Move the shard files into --output (same file system: renames), replacing leftovers of
    an earlier attempt; return the tar file names."""
    produced = {p.name: p for p in work.iterdir() if SHARD_FILE.match(p.name)}
    for stale in output.iterdir():
        if SHARD_FILE.match(stale.name) and stale.name not in produced:
            stale.unlink()
    for name, path in sorted(produced.items()):
        os.replace(path, output / name)
    return sorted(name for name in produced if name.endswith(".tar"))


def _write_json_atomically(path: Path, payload: dict[str, Any], scratch: Path) -> None:
    tmp = scratch / f".{path.name}.tmp"
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


def _job_options(args: argparse.Namespace, parquet: Path) -> dict[str, Any]:
    return {
        "input": parquet.name,
        "input_bytes": parquet.stat().st_size,
        "url_col": args.url_col,
        "caption_col": args.caption_col,
        "image_size": args.image_size,
        "resize_mode": args.resize_mode,
        "samples_per_shard": args.samples_per_shard,
        "url_timeout": args.url_timeout,
        "retries": args.retries,
    }


def _prepare_work_dir(work: Path, options: dict[str, Any]) -> None:
    """Keep finished shards of an earlier attempt with the same options (img2dataset resumes
    from them); start afresh when the options or the input changed."""
    options_file = work / "options.json"
    if work.exists():
        previous = json.loads(options_file.read_text()) if options_file.exists() else None
        if previous == options:
            LOG.info("resuming: keeping the finished shards of an earlier attempt in %s", work)
            return
        shutil.rmtree(work)
    (work / "img2dataset").mkdir(parents=True)
    options_file.write_text(json.dumps(options, indent=2))


def download(args: argparse.Namespace) -> dict[str, Any] | None:
    """Do the job; return the _SUCCESS document, or None when it was already done."""
    started = time.monotonic()
    deadline = started + args.deadline_seconds
    output: Path = args.output
    success = output / SUCCESS_FILE
    if success.exists():
        LOG.info("%s exists: this shard was finished by an earlier run, nothing to do", success)
        return None
    parquet = resolve_input(args.input)
    rows = validate_parquet(parquet, args.url_col, args.caption_col)
    options = _job_options(args, parquet)
    LOG.info("downloading %d rows of %s into %s with %s", rows, parquet, output, json.dumps(options))

    output.mkdir(parents=True, exist_ok=True)
    work = output / WORK_DIR
    _prepare_work_dir(work, options)
    shards_dir = work / "img2dataset"
    _import_img2dataset()  # here, so that the forked child starts with it loaded
    try:
        run_with_deadline(
            _run_img2dataset, (img2dataset_options(args, parquet, shards_dir),), deadline, work / "error.txt"
        )
    except DeadlineExceeded:
        raise DeadlineExceeded(
            f"the download did not finish within --deadline-seconds {args.deadline_seconds:g} s and was "
            f"stopped (img2dataset can hang on a URL, img2dataset#437). Finished shards stay in {work} "
            f"for a rerun; raise the deadline or lower --url-timeout"
        ) from None

    stats = _read_stats(shards_dir)
    expected = math.ceil(rows / args.samples_per_shard)
    missing = sorted(set(range(expected)) - set(stats))
    if missing:
        raise IncompleteShards(
            f"img2dataset finished without shards {[f'{m:05d}' for m in missing]} of {expected} "
            f"(a worker failed after retries); rerun the job to resume"
        )
    samples = sum(int(s["successes"]) for s in stats.values())
    count = sum(int(s["count"]) for s in stats.values())
    tar_files = _publish(shards_dir, output)
    summary: dict[str, Any] = {"shard_id": args.shard_id} if args.shard_id is not None else {}
    summary |= {
        "samples": samples,
        "failed": count - samples,
        "failed_to_download": sum(int(s.get("failed_to_download", 0)) for s in stats.values()),
        "failed_to_resize": sum(int(s.get("failed_to_resize", 0)) for s in stats.values()),
        "tar_files": tar_files,
        "url_col": args.url_col,
        "caption_col": args.caption_col,
        "image_size": args.image_size,
        "options": options,
        "duration_s": round(time.monotonic() - started, 3),
    }
    # Written last, atomically: readers take its presence as "every shard file is in place".
    _write_json_atomically(success, summary, work)
    shutil.rmtree(work, ignore_errors=True)
    LOG.info(
        "done: %d samples, %d failed, %d tar files in %.1f s",
        samples,
        count - samples,
        len(tar_files),
        summary["duration_s"],
    )
    return summary


# --- entrypoint ---------------------------------------------------------------------------


def write_exit_message(message: str) -> None:
    """Processing jobs report /opt/ml/output/message (first 1 KB, UTF-8) as ExitMessage; the
    failure file is the training-job contract. Never raises: it runs while failing."""
    path = contract.output_dir() / "message"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = message.encode("utf-8")[:EXIT_MESSAGE_LIMIT]
        path.write_text(data.decode("utf-8", errors="ignore"), encoding="utf-8")
    except OSError:
        print(f"could not write {path}: {message}", file=sys.stderr)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Terminated(f"stopped by signal {signum} (SageMaker stops jobs with SIGTERM)")


def main(args: argparse.Namespace | None = None) -> int:
    """Run the job; return the exit status (0 done or already done, 1 failed)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # signal handlers can only be installed from the main thread (tests may call from others)
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main_thread else None
    try:
        if args is None:
            args = parse_args()
        summary = download(args)
        if summary is None:
            write_exit_message("already complete: _SUCCESS was present, nothing done")
        else:
            write_exit_message(
                f"ok: {summary['samples']} samples, {summary['failed']} failed, {len(summary['tar_files'])} tar files"
            )
        return 0
    except Exception as exc:
        write_exit_message(f"{type(exc).__name__}: {exc}")
        return contract.fail(exc)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
