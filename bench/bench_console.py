"""What the run console costs the local cloud while a large run goes: N no-op shards, run twice
side by side, once with nobody watching and once with the console open in headless Chromium on
the run's page (graph, Map counts, training) and on its Map's child executions page.

Everything but the SageMaker work is real (bench_local_runtime.py's set-up). Measured per run:
the run's wall time, the local cloud process's CPU seconds (moto, the console's server and the
runtime's threads; the Lambda workers are child processes and counted apart), and the console's
own AWS API calls (requests per second to the cloud). The browser's own CPU is not the cloud's.

    .venv/bin/python bench/bench_console.py --shards 1000

A run that does not succeed prints its error and cause (`status=FAILED error=… cause=…`) and exits 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def _children_cpu(me: psutil.Process) -> float:
    total = 0.0
    for child in me.children(recursive=True):
        try:
            if any(part in " ".join(child.cmdline()) for part in ("chromium", "playwright")):
                continue  # the watching browser is the user's machine's cost, not the cloud's
            times = child.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


def _watch_in_browser(url: str, name: str, stop: threading.Event) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        run_page = browser.new_page()
        run_page.goto(f"{url}#/runs/{name}")
        children_page = browser.new_page()
        children_page.goto(f"{url}#/runs/{name}/maps/Download%20shards")
        while not stop.is_set():
            stop.wait(0.5)
        browser.close()


def run_one(shards: int, concurrency: int, console: bool) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_local_runtime import upload_noop_inputs  # type: ignore[import-not-found]

    from sdflow.console.server import ConsoleServer
    from sdflow.local.cloud import LocalCloud
    from sdflow.local.sagemaker.noop import NoOpSageMaker
    from sdflow.session import Session

    me = psutil.Process()
    with (
        tempfile.TemporaryDirectory() as workdir,
        LocalCloud(
            Path(workdir),
            port=0,
            sagemaker_factory=lambda w, url, lis: NoOpSageMaker(url, lis, direct_s3=True),
            quotas={"processing job": concurrency},
        ) as cloud,
    ):
        sfn = cloud.client("stepfunctions")
        document = upload_noop_inputs(cloud, Path(workdir), shards, concurrency)
        cloud.prewarm().join(timeout=300)
        server = ConsoleServer(Session.for_cloud(cloud).console_config(), port=0).start() if console else None
        stop = threading.Event()
        watcher = None
        try:
            cpu0, children0 = me.cpu_times(), _children_cpu(me)
            started = time.monotonic()
            arn = sfn.start_execution(
                stateMachineArn=cloud.outputs["PipelineStateMachineArn"], name="noop", input=json.dumps(document)
            )["executionArn"]
            if server is not None:
                watcher = threading.Thread(target=_watch_in_browser, args=(server.url, "noop", stop), daemon=True)
                watcher.start()
            while (described := sfn.describe_execution(executionArn=arn))["status"] == "RUNNING":
                time.sleep(0.5)
            run_s = time.monotonic() - started
            cpu1, children1 = me.cpu_times(), _children_cpu(me)
            calls = server.api_calls if server is not None else 0
            operations = server.api_operations if server is not None else {}
        finally:
            stop.set()
            if watcher is not None:
                watcher.join(30)
            if server is not None:
                server.stop()
    return {
        "console": console,
        "status": described["status"],
        "error": described.get("error"),  # why a run that did not succeed ended
        "cause": described.get("cause"),
        "run_s": run_s,
        "cloud_cpu_s": (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system),
        "workers_cpu_s": children1 - children0,
        "console_calls": calls,
        "operations": operations,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=1000, help="shards in the run")
    parser.add_argument("--concurrency", type=int, default=100, help="download.max_concurrency")
    parser.add_argument("--one", choices=["with", "without"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.shards, args.concurrency, args.one == "with")))
        return 0
    results = {}
    for mode in ("without", "with"):
        command = [sys.executable, __file__, "--one", mode, "--shards", str(args.shards)]
        command += ["--concurrency", str(args.concurrency)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(done.stdout[-2000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
            return done.returncode
        out = done.stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
        if results[mode]["status"] != "SUCCEEDED":
            r = results[mode]
            print(f"shards={args.shards} console={mode} status={r['status']} error={r['error']} cause={r['cause']}")
            return 1
    without, with_ = results["without"], results["with"]
    print(f"{'console':>8} {'status':>10} {'run s':>7} {'cloud CPU s':>12} {'workers CPU s':>14} {'console calls':>14}")
    for r in (without, with_):
        print(
            f"{'open' if r['console'] else 'closed':>8} {r['status']:>10} {r['run_s']:>7.1f} {r['cloud_cpu_s']:>12.1f} "
            f"{r['workers_cpu_s']:>14.1f} {r['console_calls']:>14}"
        )
    print(
        f"shards={args.shards} console_requests_per_s={with_['console_calls'] / with_['run_s']:.2f} "
        f"run_time_ratio={with_['run_s'] / without['run_s']:.3f} "
        f"cloud_cpu_ratio={with_['cloud_cpu_s'] / max(without['cloud_cpu_s'], 1e-9):.3f} "
        f"cloud_cpu_share_of_console={(with_['cloud_cpu_s'] - without['cloud_cpu_s']) / with_['run_s']:.3f} cores"
    )
    busiest = sorted(with_["operations"].items(), key=lambda item: -item[1])[:8]
    print("console calls by operation: " + ", ".join(f"{op} {n}" for op, n in busiest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
