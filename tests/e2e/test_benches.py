"""The orchestration benches (bench/ on .venv) run at a tiny size, so they cannot rot: each through its own
command line, as a person runs it, against this checkout's code. A run that fails says why. The benches of the
image (bench/ on .venv-image) run in tests/image/test_image_benches.py; bench/gpu_acceptance.py and its --quick in
tests/image/test_gpu_acceptance.py and tests/image_accelerate/test_gpu_quick.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def bench(name: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    # This checkout's packages first: the venv's editable install may point at another checkout.
    path = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "layers" / "common")])
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / name), *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, env=env, check=False,
    )  # fmt: skip


def test_bench_local_runtime_two_shards_succeed() -> None:
    done = bench("bench_local_runtime.py", "--shards", "2", "--concurrency", "2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("shards=2 status=SUCCEEDED "), last
    assert "peak_rss_mb=" in last


def test_bench_local_runtime_refused_run_prints_its_cause() -> None:
    done = bench("bench_local_runtime.py", "--shards", "2", "--concurrency", "2", "--set", "training.resolution=4096")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("shards=2 status=FAILED error=InvalidRunDocument cause="), last
    assert "training.resolution" in last


def test_bench_console_two_shards_succeed_with_and_without_the_console() -> None:
    done = bench("bench_console.py", "--shards", "2", "--concurrency", "2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "shards=2 console_requests_per_s=" in done.stdout
