"""The dedup job's pass against the number of shards: time, peak memory and records per second, side by
side, and a check that it finds exactly the planted duplicates.

Each size is a run folder on a local S3 (moto's server on 127.0.0.1, tests/image/data_fixtures.local_s3,
as bench_data_scale.py uses it; the local cloud's S3 is the same moto, with the whole stack around it):
`--shards` shard folders with a `_SUCCESS` and a synthetic `hashes.parquet` each (the download job's
format, `--rows-per-shard` training samples) and the run's shards.json. Planted with `--dup-rate` r
(tests/image/dedup_fixtures.plant): URL copies and image copies of earlier shards' samples (r/2 each),
a near-identical pair (one pixel apart: both must stay) and a held-out sample whose training copy in
shard 0 must go. The job runs as SageMaker starts it, `bin/dedup` in a fresh process with
AWS_ENDPOINT_URL, and the bench compares its dropped files with what was planted.

Figures: wall time of the job process; peak RSS as the job records it (its own or any of its worker
processes', getrusage); records/s = hashed samples / time (each sample is a URL and an image record).
With S3 on this machine, reading the objects is most of the time: a real S3 serves the readers' GETs
in parallel.

usage: python bench/bench_dedup.py [--shards 1000,10000] [--rows-per-shard 100] [--dup-rate 0.1]
                                   [--processes 2] [--partitions 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "training_image"), str(REPO / "tests" / "image")]

BUCKET = "bench-dedup"


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of shard counts") from None
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError("each shard count must be >= 2 (copies come from earlier shards)")
    return sizes


def put_size(client: Any, run: str, shards: int, rows: int, dup_rate: float) -> tuple[str, Any, int]:
    """Upload one size's run folder; return (its shards.json URI, what was planted, hashed samples)."""
    from dedup_fixtures import plant, put_run

    tables, planted = plant(shards, rows, dup_rate, seed=shards)
    samples = sum(len(t) for t in tables)
    # put_run writes one shard after another; threads put ~8 shards' objects at a time.
    chunks = [list(range(i, min(i + 250, shards))) for i in range(0, shards, 250)]

    def put_chunk(positions: list[int]) -> None:
        only = [tables[p] if p in positions else None for p in range(shards)]
        put_run(client, BUCKET, run, only, manifest=False)  # one shards.json, at the end

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put_chunk, chunks))
    manifest = put_run(client, BUCKET, run, [None] * shards)  # shards.json (the objects are all there)
    return manifest, planted, samples


def run_job(manifest: str, output: str, args: argparse.Namespace, work: Path) -> tuple[float, str]:
    """The job's wall time, and its log line with each pass's time."""
    env = os.environ | {"SDFLOW_OPT_ML": str(work / "opt_ml"), "PYTHONPATH": str(REPO / "training_image")}
    command = [sys.executable, str(REPO / "training_image" / "bin" / "dedup"), "--shards_manifest", manifest,
               "--output_uri", output, "--processes", str(args.processes), "--partitions", str(args.partitions),
               "--work_dir", str(work / "spill")]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"the dedup job failed ({done.returncode}):\n{done.stderr[-3000:]}")
    phases = [line.split("INFO ", 1)[-1] for line in done.stderr.splitlines() if " grouped " in line]
    return elapsed, phases[-1] if phases else ""


def measure(client: Any, shards: int, args: argparse.Namespace) -> dict[str, Any]:
    from dedup_fixtures import found, read_json

    run = f"bench-{shards}"
    started = time.perf_counter()
    manifest, planted, samples = put_size(client, run, shards, args.rows_per_shard, args.dup_rate)
    setup = time.perf_counter() - started
    output = f"s3://{BUCKET}/runs/{run}/dataset/dedup/"
    with tempfile.TemporaryDirectory(prefix="bench-dedup-") as scratch:
        elapsed, phases = run_job(manifest, output, args, Path(scratch))
    summary = read_json(client, output + "summary.json")
    dropped, _ = found(client, output, summary)
    exact = (
        dropped == planted.url | planted.image
        and not dropped & planted.stays
        and (summary["url_duplicates"], summary["image_duplicates"]) == (len(planted.url), len(planted.image))
        and summary["hashed_samples"] == samples
    )
    return {
        "shards": shards, "samples": samples, "setup_s": round(setup, 1), "job_s": round(elapsed, 2),
        "job_reported_s": summary["duration_s"], "records_per_s": round(samples / elapsed),
        "peak_rss_mb": summary["peak_rss_mb"], "url_duplicates": summary["url_duplicates"],
        "image_duplicates": summary["image_duplicates"], "planted_found_exactly": exact, "passes": phases,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=_sizes, default=[1000, 10000], help="comma-separated shard counts")
    parser.add_argument("--rows-per-shard", type=int, default=100)
    parser.add_argument("--dup-rate", type=float, default=0.1)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--partitions", type=int, default=64)
    args = parser.parse_args()

    from data_fixtures import local_s3

    rows = []
    with local_s3() as client:
        client.create_bucket(Bucket=BUCKET)
        for shards in args.shards:
            rows.append(measure(client, shards, args))
            print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    print(f"\n{'shards':>8} {'samples':>10} {'job s':>8} {'records/s':>10} {'peak RSS MB':>12} "
          f"{'url dups':>9} {'image dups':>10} {'x time':>7} {'x RSS':>6}  exact")  # fmt: skip
    for row in rows:
        print(f"{row['shards']:>8} {row['samples']:>10} {row['job_s']:>8} {row['records_per_s']:>10} "
              f"{row['peak_rss_mb']:>12} {row['url_duplicates']:>9} {row['image_duplicates']:>10} "
              f"{row['job_s'] / base['job_s']:>7.2f} {row['peak_rss_mb'] / base['peak_rss_mb']:>6.2f}  "
              f"{row['planted_found_exactly']}")  # fmt: skip
    if not all(row["planted_found_exactly"] for row in rows):
        sys.exit("the job's drops differ from the planted duplicates")


if __name__ == "__main__":
    main()
