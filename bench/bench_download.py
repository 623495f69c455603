"""Download throughput: the download job (sdflow_image.download.download.main) against
img2dataset.download called directly with the same settings, on the same parquet, from the
same local HTTP server, side by side in one run. Goal: ours >= 0.95x direct.

    .venv-image/bin/python bench/bench_download.py --images 400

The job adds input checks, a forked child with a deadline, uploading each finished shard to
S3 (moto's server on 127.0.0.1 here) and _SUCCESS; this measures what that costs. Rounds
alternate which side goes first so a warming page cache or a busy neighbour does not favour
one side."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "training_image")]

from sdflow.samples import ImageServer, make_laion_parquet  # noqa: E402
from sdflow_image.download import download  # noqa: E402

BUCKET = "sdflow-bench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=400, help="good URLs in the parquet")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side (alternating order)")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed direct runs first (cold page cache, first spawn)"
    )
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--samples-per-shard", type=int, default=100)
    parser.add_argument("--image-size", type=int, default=64)
    return parser.parse_args(argv)


def cpu_seconds() -> float:
    # children: every waited-for descendant (img2dataset's workers, our forked child)
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run_direct(options: dict[str, object]) -> tuple[float, float]:
    started, cpu = time.perf_counter(), cpu_seconds()
    download._import_img2dataset().download(**options)
    return time.perf_counter() - started, cpu_seconds() - cpu


def run_ours(argv: list[str]) -> tuple[float, float]:
    started, cpu = time.perf_counter(), cpu_seconds()
    status = download.main(download.parse_args(argv))
    if status != 0:
        raise SystemExit(f"the download job failed with status {status}")
    return time.perf_counter() - started, cpu_seconds() - cpu


def successes(folder: Path) -> int:
    return sum(json.loads(p.read_text())["successes"] for p in folder.glob("*_stats.json"))


def successes_in_s3(client: Any, prefix: str) -> int:
    return int(json.loads(client.get_object(Bucket=BUCKET, Key=prefix + "_SUCCESS")["Body"].read())["samples"])


@contextmanager
def local_s3() -> Iterator[Any]:
    """moto's S3 on 127.0.0.1, reached through AWS_ENDPOINT_URL as the local runtime gives a job."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        {
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    )
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    try:
        yield client
    finally:
        server.stop()


def main() -> None:
    bench = parse_args()
    work = Path(tempfile.mkdtemp(prefix="sdflow-bench-download-"))
    os.environ["SDFLOW_OPT_ML"] = str(work / "opt_ml")
    download._import_img2dataset()  # both sides measured without the one-off import
    try:
        with ImageServer() as server, local_s3() as s3:
            sample = make_laion_parquet(work / "input" / "urls.parquet", server, good=bench.images, seed=1)
            job_argv = [
                "--input", str(sample.path),
                "--image_size", str(bench.image_size), "--samples_per_shard", str(bench.samples_per_shard),
                "--processes", str(bench.processes), "--threads", str(bench.threads), "--url_timeout", "10",
            ]  # fmt: skip

            def ours_argv(round_: int) -> list[str]:
                output = ["--output_uri", f"s3://{BUCKET}/ours-{round_}/", "--work_dir", str(work / f"ours-{round_}")]
                return [*job_argv, *output]

            for n in range(bench.warmup):
                warm_out = work / f"warmup-{n}"
                run_direct(download.img2dataset_options(download.parse_args(ours_argv(-1)), sample.path, warm_out))
            times: dict[str, list[float]] = {"direct": [], "ours": []}
            cpu: dict[str, list[float]] = {"direct": [], "ours": []}
            for round_ in range(bench.rounds):
                direct_out = work / f"direct-{round_}"
                options = download.img2dataset_options(download.parse_args(ours_argv(round_)), sample.path, direct_out)
                sides = [
                    ("direct", lambda o=options: run_direct(o)),
                    ("ours", lambda r=round_: run_ours(ours_argv(r))),
                ]
                for name, run in sides if round_ % 2 == 0 else sides[::-1]:
                    wall, used = run()
                    times[name].append(wall)
                    cpu[name].append(used)
                got = {"direct": successes(direct_out), "ours": successes_in_s3(s3, f"ours-{round_}/")}
                if got["direct"] != bench.images or got["ours"] != bench.images:
                    raise SystemExit(f"round {round_}: expected {bench.images} images each, got {got}")
                print(
                    f"round {round_}: direct {times['direct'][-1]:.2f} s ({cpu['direct'][-1]:.1f} s cpu), "
                    f"ours {times['ours'][-1]:.2f} s ({cpu['ours'][-1]:.1f} s cpu), load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    direct_rate = bench.images / statistics.median(times["direct"])
    ours_rate = bench.images / statistics.median(times["ours"])
    settings = (
        f"{bench.images} images, {bench.processes} processes x {bench.threads} threads, "
        f"{bench.samples_per_shard}/shard, {bench.image_size}px, {os.cpu_count()} cores, "
        f"median of {bench.rounds} rounds"
    )
    print(f"direct runs (s):     {', '.join(f'{t:.2f}' for t in times['direct'])}")
    print(f"job runs (s):        {', '.join(f'{t:.2f}' for t in times['ours'])}")
    print(f"settings:            {settings}")
    print(f"img2dataset direct:  {direct_rate:8.1f} images/s")
    print(f"sdflow download job: {ours_rate:8.1f} images/s")
    print(f"ratio ours/direct:   {ours_rate / direct_rate:8.3f}  (goal >= 0.95)")
    cpu_ratio = statistics.median(cpu["direct"]) / statistics.median(cpu["ours"])
    print(f"cpu-time ratio:      {cpu_ratio:8.3f}  (direct cpu s / ours cpu s per run; less noisy on a shared host)")


if __name__ == "__main__":
    main()
