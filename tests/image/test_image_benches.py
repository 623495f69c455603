"""The image's benches (bench/ on .venv-image, as `make bench` runs them) run at a tiny size, so they cannot rot:
each through its own command line, against this checkout's code, ending in the line it reports. The orchestration
benches run in tests/e2e/test_benches.py; bench/gpu_acceptance.py in tests/image/test_gpu_acceptance.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

pytestmark = [pytest.mark.image, pytest.mark.slow]


def bench(name: str, *args: str, timeout: float = 600) -> str:
    path = os.pathsep.join([str(REPO_ROOT / "training_image"), str(REPO_ROOT)])
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / name), *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, check=False,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_bench_train_tiny_run_reports_the_ratio() -> None:
    out = bench(
        "bench_train.py", "--steps", "3", "--batch", "2", "--resolution", "32", "--workers", "0", "--rounds", "1"
    )
    assert "ratio train/plain" in out


def test_bench_cached_latents_tiny_run_reports_both_sides() -> None:
    out = bench("bench_cached_latents.py", "--steps", "3", "--batch", "2", "--resolution", "32", "--rounds", "1")
    assert "cache_latents=true" in out
    assert "cache_latents=false" in out


def test_bench_download_tiny_run_reports_the_ratio() -> None:
    out = bench("bench_download.py", "--images", "10", "--rounds", "1", "--processes", "1", "--threads", "2")
    assert "ratio ours/direct:" in out


def test_bench_data_scale_tiny_run_reports_each_size() -> None:
    out = bench("bench_data_scale.py", "--shards", "2", "--samples", "2", "--workers", "1", "--rounds", "1")
    assert "best of 1 rounds" in out


def test_bench_serve_admission_tiny_burst_reports_a_row() -> None:
    out = bench("bench_serve_admission.py", "--request_s", "0.05", "--bursts", "2", "--limit_s", "5")
    assert "answered_200 / refused_429" in out
    assert len([line for line in out.splitlines() if line.startswith("{")]) == 2  # one row per queue rule


def test_bench_dedup_tiny_run_finds_exactly_the_planted_duplicates() -> None:
    out = bench("bench_dedup.py", "--shards", "3,6", "--rows-per-shard", "10", "--partitions", "4")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [row["shards"] for row in rows] == [3, 6]
    assert all(row["planted_found_exactly"] and row["peak_rss_mb"] > 0 for row in rows)
