"""The download job: one LAION-style parquet file -> webdataset shards in S3, with img2dataset.

SageMaker runs it as a processing job (`ContainerEntrypoint = ["download"]`, arguments in
docs/contracts.md, "The download job"). What it promises:
- the parquet is checked before anything is downloaded (readable, has rows, has the named
  columns), and the shard's S3 prefix (--output_uri) is listed, so a bad input or an unusable
  bucket fails in seconds with a message that names the problem;
- each shard goes to --output_uri as soon as img2dataset finishes it (tar, parquet, then its
  stats file), and its local tar and parquet are deleted then: the disk holds only the shards in
  progress (one per img2dataset process), never the whole dataset (sdflow_image.download.shard_upload);
- a shard img2dataset has not finished never reaches S3;
- img2dataset runs in a child process with its own process group, and the whole group is
  killed at --deadline_seconds: a URL can hang img2dataset forever (img2dataset#437), and
  a per-URL timeout alone does not prevent it;
- `_SUCCESS` (JSON totals) is written last, after every shard is in S3, and a run on a prefix
  that already has it does nothing: retries and reruns are free;
- a retried job (SageMaker starts it on an empty volume) lists --output_uri and skips every
  shard that is complete there: it downloads only what is missing;
- with --holdout_rate r > 0, each finished tar is split before its upload: the samples whose URL
  is held out (sdflow_image.holdout) go to `holdout/NNNNN.tar`, never into the training tar, and
  `_SUCCESS` counts them apart (sdflow_image.download.holdout_split).
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
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sdflow_image import contract, flags
from sdflow_image.download import filters
from sdflow_image.download.shard_upload import (
    SUCCESS_FILE,
    S3Prefix,
    ShardUploader,
    holdout_name,
    holdout_samples,
    read_stats,
)

LOG = logging.getLogger("sdflow.download")

RESIZE_MODES = ("no", "keep_ratio", "keep_ratio_largest", "center_crop", "border")
# How often finished shards are looked for while img2dataset runs: a shard waits at most this
# long on the disk before its upload starts.
UPLOAD_POLL_SECONDS = 0.5


class DownloadError(RuntimeError):
    """The download job cannot produce the shard; the message says why and what to change."""


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


def s3_uri(text: str) -> str:
    try:
        return S3Prefix.parse(text).uri
    except ValueError:
        raise ValueError("is not an S3 URI (expected s3://<bucket>/<shard prefix>/)") from None


_path = flags.path


FLAGS: list[flags.Flag] = [
    flags.Flag(
        "input",
        _path,
        None,
        "the parquet file, or a folder holding exactly one parquet file (the processing input)",
        required=True,
    ),
    flags.Flag(
        "output_uri",
        s3_uri,
        None,
        "the shard's S3 prefix: each finished tar, its parquet and stats go there at once, _SUCCESS last",
        required=True,
    ),
    flags.Flag(
        "work_dir",
        _path,
        None,
        "local folder for the shards in progress (default: $SDFLOW_OPT_ML/processing/work, on the job's volume)",
    ),
    flags.Flag("url_col", flags.text, "URL", "parquet column with the image URLs"),
    flags.Flag("caption_col", flags.text, "TEXT", "parquet column with the captions"),
    flags.Flag("image_size", flags.positive_int, 256, "side of the stored images in pixels"),
    flags.Flag("resize_mode", flags.choice(RESIZE_MODES), "center_crop", "img2dataset resize mode"),
    flags.Flag("samples_per_shard", flags.positive_int, 1000, "rows per webdataset tar file"),
    flags.Flag("processes", flags.positive_int, 4, "img2dataset worker processes (= shards on the disk at once)"),
    flags.Flag("threads", flags.positive_int, 16, "download threads per process"),
    flags.Flag(
        "url_timeout",
        flags.positive_float,
        10.0,
        "seconds a single URL may stall (socket timeout) before it counts as failed",
    ),
    flags.Flag(
        "deadline_seconds",
        flags.positive_float,
        3300.0,
        "hard limit for the whole job; the downloader is killed and the job fails when it passes",
    ),
    flags.Flag("retries", flags.non_negative_int, 0, "extra attempts per failed URL"),
    flags.Flag("shard_id", flags.text, None, "recorded in _SUCCESS when given (the index uses the folder name)"),
    flags.Flag(
        "holdout_rate",
        flags.number(float, 0, maximum=1),
        0.0,
        "share of URLs held out of training (0..1): their samples go to holdout/NNNNN.tar; 0: no split",
    ),
    flags.Flag("filters", filters.parse_filter, None, filters.FLAG_HELP, nargs="+"),
]


def build_parser() -> argparse.ArgumentParser:
    return flags.build_parser(
        "download", "Download the images of one LAION-style parquet file into webdataset shards in S3.", FLAGS
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the job's arguments; raises flags.FlagError naming the flag."""
    return flags.parse(build_parser(), FLAGS, argv)


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
    for flag, column in (("--url_col", url_col), ("--caption_col", caption_col)):
        if column not in columns:
            raise MissingColumn(
                f"column {column!r} ({flag}) is not in {path.name}; columns present: {columns}. "
                f"Set the run's dataset column names to match the parquet file"
            )
    url_type = parquet.schema_arrow.field(url_col).type
    if not (pa.types.is_string(url_type) or pa.types.is_large_string(url_type)):
        raise MissingColumn(f"column {url_col!r} (--url_col) in {path.name} holds {url_type}, not URL strings")
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
        # Resume: img2dataset skips every shard whose stats file is in output_folder; the
        # uploader puts there the stats of the shards already complete in S3.
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


def run_with_deadline(
    target: Callable[..., None],
    args: tuple[Any, ...],
    deadline: float,
    error_file: Path,
    *,
    on_tick: Callable[[], object] | None = None,
    tick_seconds: float = UPLOAD_POLL_SECONDS,
) -> None:
    """Run target(*args) in a forked child that leads its own process group; kill the whole
    group when the monotonic clock passes `deadline` (or this process is interrupted, or
    `on_tick`, called every `tick_seconds` while the child runs, raises).
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
        # on_tick runs here, in the main thread, so that SIGTERM and its errors end the job alike
        while process.is_alive() and time.monotonic() < deadline:
            wait = deadline - time.monotonic()
            process.join(timeout=max(0.0, min(wait, tick_seconds) if on_tick else wait))
            if on_tick is not None and process.is_alive():
                on_tick()
    except BaseException:  # SIGTERM (Terminated), Ctrl-C or an on_tick error while waiting
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
    for path in folder.glob("*_stats.json"):
        parsed = read_stats(path)
        if parsed is not None:
            stats[int(path.name.split("_", 1)[0])] = parsed
    return stats


def _job_options(args: argparse.Namespace, parquet: Path) -> dict[str, Any]:
    """What decides a shard's content and boundaries: a retry takes from S3 only shards made
    with these. (The URL timeout and retries change which URLs succeed, not the shard format.)
    The held-out rate is one only when set, so that shards made without a split keep their hash."""
    options = {
        "input": parquet.name,
        "input_bytes": parquet.stat().st_size,
        "url_col": args.url_col,
        "caption_col": args.caption_col,
        "image_size": args.image_size,
        "resize_mode": args.resize_mode,
        "samples_per_shard": args.samples_per_shard,
    }
    if args.holdout_rate > 0:
        options["holdout_rate"] = args.holdout_rate
    return options


def work_dir(args: argparse.Namespace) -> Path:
    # SageMaker puts a processing job's inputs and outputs under /opt/ml/processing
    # (S3Input.LocalPath must start there): the provisioned volume, not the image's layer.
    return args.work_dir if args.work_dir is not None else contract.opt_ml() / "processing" / "work"


def _fresh_dir(path: Path) -> None:
    # S3 is the record of what is done; a local leftover could hold a stats file whose shard
    # never reached S3, and img2dataset would skip that shard.
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def download(args: argparse.Namespace, *, uploader: ShardUploader | None = None) -> dict[str, Any] | None:
    """Do the job; return the _SUCCESS document, or None when it was already done."""
    started = time.monotonic()
    deadline = started + args.deadline_seconds
    output = S3Prefix.parse(args.output_uri)
    parquet = resolve_input(args.input)
    rows = validate_parquet(parquet, args.url_col, args.caption_col)
    row_filters = filters.resolve(args.filters)
    options = _job_options(args, parquet) | filters.job_options(row_filters)
    uploader = uploader or ShardUploader(output, options, holdout_rate=args.holdout_rate)
    if uploader.has_success():
        LOG.info("%s%s exists: this shard was finished by an earlier run, nothing to do", output.uri, SUCCESS_FILE)
        return None
    work = work_dir(args)
    shards_dir = work / "img2dataset"
    _fresh_dir(shards_dir)
    kept = filters.apply_filters(parquet, row_filters, work / "filtered", rows)  # img2dataset reads the kept rows
    parquet, rows = kept.parquet, kept.rows_to_download
    resumed = uploader.resume(shards_dir)
    expected = math.ceil(rows / args.samples_per_shard)
    LOG.info(
        "downloading %d rows of %s to %s (%d of %d shards already there) with %s",
        rows,
        parquet,
        output.uri,
        len(resumed),
        expected,
        json.dumps(options),
    )
    if len(resumed) < expected:
        _import_img2dataset()  # here, so that the forked child starts with it loaded
        try:
            run_with_deadline(
                _run_img2dataset,
                (img2dataset_options(args, parquet, shards_dir),),
                deadline,
                work / "error.txt",
                on_tick=lambda: uploader.sweep(shards_dir),
            )
        except DeadlineExceeded:
            raise DeadlineExceeded(
                f"the download did not finish within --deadline_seconds {args.deadline_seconds:g} s and was "
                f"stopped (img2dataset can hang on a URL, img2dataset#437). The {len(uploader.uploaded)} "
                f"finished shards are in {output.uri} and a rerun resumes from them; raise the deadline or "
                f"lower --url_timeout"
            ) from None
        uploader.sweep(shards_dir)  # the shards that ended after the last tick

    stats = _read_stats(shards_dir)
    missing = sorted(set(range(expected)) - (set(stats) & uploader.uploaded))
    if missing:
        raise IncompleteShards(
            f"img2dataset finished without shards {[f'{m:05d}' for m in missing]} of {expected} "
            f"(a worker failed after retries); rerun the job to resume"
        )
    stats = {shard: stats[shard] for shard in range(expected)}
    held_out = {shard: holdout_samples(s) for shard, s in stats.items()}
    successes = sum(int(s["successes"]) for s in stats.values())
    samples = successes - sum(held_out.values())  # the training samples
    count = sum(int(s["count"]) for s in stats.values())
    summary: dict[str, Any] = {"shard_id": args.shard_id} if args.shard_id is not None else {}
    summary |= {
        "samples": samples,
        "failed": count - successes,
        **kept.counts(),
        "failed_to_download": sum(int(s.get("failed_to_download", 0)) for s in stats.values()),
        "failed_to_resize": sum(int(s.get("failed_to_resize", 0)) for s in stats.values()),
        "tar_files": [f"{shard:05d}.tar" for shard in sorted(stats)],
        "holdout_rate": args.holdout_rate,
        "holdout_samples": sum(held_out.values()),
        "holdout_tar_files": [holdout_name(f"{shard:05d}") for shard in sorted(stats) if held_out[shard] > 0],
        "url_col": args.url_col,
        "caption_col": args.caption_col,
        "image_size": args.image_size,
        "options": options,
        "resumed_shards": len(resumed),
        "peak_local_tars": uploader.peak_local_tars,
        "duration_s": round(time.monotonic() - started, 3),
    }
    summary |= uploader.put_hashes([f"{shard:05d}" for shard in sorted(stats)])  # the dedup job's input
    # Written last: readers take its presence as "every shard file is in place".
    uploader.put_success(summary)
    shutil.rmtree(work, ignore_errors=True)
    LOG.info(
        "done: %d samples, %d held out, %d failed, %d tar files (%d resumed) in %.1f s",
        samples,
        summary["holdout_samples"],
        count - successes,
        len(stats),
        len(resumed),
        summary["duration_s"],
    )
    return summary


# --- entrypoint ---------------------------------------------------------------------------


def main(args: argparse.Namespace | None = None) -> int:
    """Run the job; return the exit status (0 done or already done, 1 failed)."""

    def work() -> str:
        summary = download(args if args is not None else parse_args())
        if summary is None:
            return "already complete: _SUCCESS was present, nothing done"
        return (
            f"ok: {summary['samples']} samples, {summary['holdout_samples']} held out, {summary['failed']} failed, "
            f"{len(summary['tar_files'])} tar files"
        )

    return contract.run_processing_job(
        work,
        lambda signum: Terminated(
            f"stopped by signal {signum} (SageMaker stops jobs with SIGTERM); the shards already in S3 stay, and a "
            "retry of the job resumes after them"
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
