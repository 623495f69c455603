"""The dedup job: which training samples repeat another sample of the run, by URL or by exact pixels.

SageMaker runs it as a processing job (`ContainerEntrypoint = ["dedup"]`, the download job's image;
arguments and outputs in docs/contracts.md, "The dedup job"). An external hash partition, so that no
process ever holds every hash:
1. read (sdflow_image.dedup.spill): --processes readers read each shard's `_SUCCESS` and
   `hashes.parquet` once and append 25-byte records to --partitions spill files per kind (url, image)
   on --work_dir;
2. group (sdflow_image.dedup.groups): each (kind, partition) is loaded alone, --processes at a time,
   and sorted; in each group of equal hashes the keeper is the min of (holdout 0 / train 1, position
   in shards.json, key); every other training sample is a drop (held-out samples never are);
3. resolve: drops are partitioned again by shard; a sample dropped for both counts as `url`; each shard
   with drops gets `dropped/<shard_id>.json` (sorted keys), and `summary.json` is written LAST.
Shards without `_SUCCESS` are ignored; shards whose `_SUCCESS` names no hashes file (made before
hashes existed) are listed as `unhashed_shards` and not deduplicated.

Memory bound. A grouping process holds one partition: R = hashed samples / P records of 25 bytes
each, plus lexsort's index (8 bytes a record) and the sorted copy (25): about 60 bytes x R at peak.
LAION-2B (2.3e9 samples) with P = 64: 36e6 records, 2.2 GB per process, 8 processes 17 GB (an
ml.m5.2xlarge has 32 GB); raise P to shrink it. A reader holds 8 shards' tables and at most
spill.FLUSH_ROWS buffered records (25 MB; about 3x that while it sorts them into the partition
files). The main process holds per-shard counts only. Measured (bench/bench_dedup.py, 2 processes,
P = 64): 1e6 samples in 10,000 shards peaked at 196 MB, 1e5 in 1,000 at 135 MB.
Disk bound: 25 bytes x hashed samples x 2 kinds for the spill, the drops (9 bytes each) and the sorted
keys (about 12 bytes a sample): about 75 bytes x hashed samples (170 GB for LAION-2B, 1.5 GB for 20e6).

Any error goes to the SageMaker failure file (and the ExitMessage), the exit status is non-zero and no
summary.json is written: its presence means every dropped file is in place."""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import re
import resource
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from sdflow_image import contract, flags
from sdflow_image.dedup import groups, spill
from sdflow_image.dedup.spill import DedupError, ShardRef
from sdflow_image.s3_uri import S3Prefix

LOG = logging.getLogger("sdflow.dedup")
SUMMARY_FILE = "summary.json"
SHARD_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # it names dropped/<shard_id>.json


class BadManifest(DedupError):
    pass


class Terminated(DedupError):
    """SIGTERM: SageMaker is stopping the job."""


def s3_object(text: str) -> str:
    where = S3Prefix.parse(text) if text.startswith("s3://") else None
    if where is None or not where.prefix:
        raise ValueError("is not an S3 object URI (expected s3://<bucket>/runs/<run>/shards.json)")
    return text.strip()


def s3_prefix(text: str) -> str:
    try:
        return S3Prefix.parse(text).uri
    except ValueError:
        raise ValueError("is not an S3 URI (expected s3://<bucket>/runs/<run>/dataset/dedup/)") from None


FLAGS: list[flags.Flag] = [
    flags.Flag(
        "shards_manifest",
        s3_object,
        None,
        "the run's shards.json: a list of {shard_id, parquet_uri, output_uri}, in the order that picks keepers",
        required=True,
    ),
    flags.Flag("output_uri", s3_prefix, None, "where dropped/<shard_id>.json and summary.json go", required=True),
    flags.Flag("processes", flags.positive_int, 8, "reader and grouping processes"),
    flags.Flag("partitions", flags.number(int, 1, maximum=65536), 64, "spill partitions per kind (memory ~ 1/P)"),
    flags.Flag(
        "work_dir", flags.path, None, "local folder for the spill files (default: $SDFLOW_OPT_ML/processing/work)"
    ),
]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the job's arguments; raises flags.FlagError naming the flag."""
    parser = flags.build_parser("dedup", "Find the run's duplicate training samples by URL and by pixels.", FLAGS)
    return flags.parse(parser, FLAGS, argv)


def s3_client() -> Any:
    """One client per process (made after the fork: a client must not cross one)."""
    from sdflow_image.download.shard_upload import s3_client as make

    return make()


_CLIENTS: dict[int, Any] = {}


def _process_client() -> Any:
    """This process's client, made once: a worker resolves many partitions (pid: never a parent's)."""
    pid = os.getpid()
    if pid not in _CLIENTS:
        _CLIENTS[pid] = s3_client()
    return _CLIENTS[pid]


def read_manifest(client: Any, uri: str) -> list[ShardRef]:
    where = S3Prefix.parse(uri.rsplit("/", 1)[0] + "/")
    raw = spill._read_object(client, where.uri, uri.rsplit("/", 1)[1])
    if raw is None:
        raise BadManifest(
            f"--shards_manifest {uri} does not exist; pass the run's shards.json (Validate run writes it)"
        )
    try:
        items = json.loads(raw)
    except ValueError as exc:
        raise BadManifest(f"--shards_manifest {uri} is not JSON: {exc}") from exc
    if not isinstance(items, list):
        raise BadManifest(f"--shards_manifest {uri} must be a JSON list of shard items, not {type(items).__name__}")
    shards, seen = [], set()
    for position, item in enumerate(items):
        shard_id = item.get("shard_id") if isinstance(item, dict) else None
        output = item.get("output_uri") if isinstance(item, dict) else None
        if not isinstance(shard_id, str) or not SHARD_ID.match(shard_id) or shard_id in seen:
            raise BadManifest(f"--shards_manifest item {position}: shard_id {shard_id!r} is missing, repeated or "
                              "not a plain name ([A-Za-z0-9._-])")  # fmt: skip
        if not isinstance(output, str) or not output.startswith("s3://"):
            raise BadManifest(f"--shards_manifest item {position} ({shard_id}): output_uri {output!r} is not s3://")
        seen.add(shard_id)
        shards.append(ShardRef(position, shard_id, S3Prefix.parse(output).uri))
    return shards


def _pool(processes: int) -> Any:
    # fork: the children start with the package imported; each makes its own S3 client.
    return multiprocessing.get_context("fork").Pool(processes)


def _reader(work: Path, partitions: int, task: tuple[int, list[ShardRef]]) -> list[spill.ShardRead]:
    return spill.read_shards(task[1], work, task[0], partitions, _process_client)


def _grouper(work: Path, partitions: int, task: tuple[str, int]) -> int:
    return groups.group_partition(work, task[0], task[1], partitions)


def _resolver(work: Path, output: S3Prefix, shard_ids: dict[int, str], q: int) -> dict[str, dict[str, int]]:
    client = _process_client()
    with ThreadPoolExecutor(spill.FETCH_THREADS) as pool:  # PUTs in flight, as the readers' GETs
        pending: list[Future[Any]] = []

        def put(name: str, body: bytes) -> None:
            kwargs = {"Bucket": output.bucket, "Key": output.key(name), "Body": body, "ContentType": "application/json"}
            pending.append(pool.submit(client.put_object, **kwargs))

        counts = groups.resolve(work, q, shard_ids, put)
        for future in pending:
            future.result()  # raises the first failed PUT's error
    return counts


def peak_rss_mb() -> float:
    """The largest resident set of this process or any worker it waited for, in MB (Linux counts kB).

    This process's own peak is its memory's high-water mark (VmHWM): getrusage's RUSAGE_SELF keeps,
    across execve, the peak of the process that forked it (a bench or test process holding GBs would
    be reported as the job's). RUSAGE_CHILDREN is the largest reaped worker's, forked from this one."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        status = Path("/proc/self/status").read_text()
        own = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError, IndexError):
        pass  # no procfs (not Linux): getrusage's figure stands
    return round(max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024, 1)


def _summary(shards: list[ShardRef], reads: list[spill.ShardRead], counts: dict[str, dict[str, int]],
             partitions: int) -> dict[str, Any]:  # fmt: skip
    by_position = {read.position: read for read in reads}
    per_shard: dict[str, Any] = {}
    for shard in shards:
        if by_position[shard.position].state != "hashed":
            continue
        found = counts.get(shard.shard_id, {})
        per_shard[shard.shard_id] = {
            "url_duplicates": found.get("url_duplicates", 0),
            "image_duplicates": found.get("image_duplicates", 0),
            "dropped_file": f"dropped/{shard.shard_id}.json" if found else None,
        }
    return {
        "version": 1,
        "partitions": partitions,
        "shards": per_shard,
        "url_duplicates": sum(s["url_duplicates"] for s in per_shard.values()),
        "image_duplicates": sum(s["image_duplicates"] for s in per_shard.values()),
        "hashed_samples": sum(read.rows for read in reads),
        "unhashed_shards": [s.shard_id for s in shards if by_position[s.position].state == "unhashed"],
    }


def dedup(args: argparse.Namespace) -> dict[str, Any]:
    """Do the job; return the summary it wrote."""
    started = time.monotonic()
    output = S3Prefix.parse(args.output_uri)
    client = s3_client()
    shards = read_manifest(client, args.shards_manifest)
    work = args.work_dir if args.work_dir is not None else contract.opt_ml() / "processing" / "work"
    if work.exists():
        shutil.rmtree(work)  # a leftover of an earlier attempt would add its records twice
    work.mkdir(parents=True)
    n, p = args.processes, args.partitions
    # here, once: the forked workers start with pyarrow loaded
    import pyarrow.compute
    import pyarrow.parquet  # noqa: F401

    LOG.info("deduplicating %d shards with %d processes and %d partitions in %s", len(shards), n, p, work)
    with _pool(n) as pool:
        tasks = [(i, shards[i::n]) for i in range(n)]
        reads = [r for part in pool.map(partial(_reader, work, p), tasks) for r in part]
        phase_read = time.monotonic()
        pool.map(partial(_grouper, work, p), [(kind, q) for kind in spill.KINDS for q in range(p)], chunksize=1)
        phase_group = time.monotonic()
        ids = {s.position: s.shard_id for s in shards}
        counts: dict[str, dict[str, int]] = {}
        for found in pool.map(partial(_resolver, work, output, ids), range(p), chunksize=1):
            counts |= found
        pool.close()
        pool.join()  # reaped: their peak RSS counts in RUSAGE_CHILDREN
    summary = _summary(shards, reads, counts, p)
    summary["duration_s"] = round(time.monotonic() - started, 3)
    summary["peak_rss_mb"] = peak_rss_mb()
    LOG.info("read %.1f s, grouped %.1f s, resolved %.1f s", phase_read - started, phase_group - phase_read,
             time.monotonic() - phase_group)  # fmt: skip
    # Last: its presence says every dropped file is in place.
    body = (json.dumps(summary, indent=1) + "\n").encode()
    client.put_object(Bucket=output.bucket, Key=output.key(SUMMARY_FILE), Body=body, ContentType="application/json")
    shutil.rmtree(work, ignore_errors=True)
    return summary


def main(args: argparse.Namespace | None = None) -> int:
    """Run the job; return the exit status (0 done, 1 failed)."""

    def work() -> str:
        summary = dedup(args if args is not None else parse_args())
        return (
            f"ok: {summary['hashed_samples']} samples hashed, {summary['url_duplicates']} URL and "
            f"{summary['image_duplicates']} image duplicates, {len(summary['unhashed_shards'])} unhashed shards"
        )

    stopped: Callable[[int], BaseException] = lambda signum: Terminated(  # noqa: E731
        f"stopped by signal {signum} (SageMaker stops jobs with SIGTERM); no summary.json was written, a rerun "
        "starts over"
    )
    return contract.run_processing_job(work, stopped)


if __name__ == "__main__":
    sys.exit(main())
