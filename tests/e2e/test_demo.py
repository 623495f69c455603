"""`sdflow demo` as a user runs it: the whole pipeline on this machine at the demo's full size
(real CPU training of the tiny model, minutes), ending with the endpoint's image. The suite's
longest test: `make test` starts it first, on a worker of its own (tests/conftest.py)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from sdflow.demo import DEMO_ENDPOINT, DEMO_GATE, HOLDOUT_SAMPLES
from tests.e2e.commands import SDFLOW

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.longest]


def test_demo_command_runs_pipeline_and_writes_endpoint_image(tmp_path: Path) -> None:
    output = tmp_path / "demo.png"
    result = subprocess.run(
        [*SDFLOW, "--workdir", str(tmp_path / "work"), "demo", "-o", str(output)],
        capture_output=True, text=True, cwd=tmp_path, timeout=900, check=False,
    )  # fmt: skip

    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "--- SNS: [sdflow] Run demo" in result.stdout
    # The run exists only on this machine: the demo and its notification point at the local run console.
    assert re.search(r"run console: http://127\.0\.0\.1:\d+/", result.stdout)
    assert re.search(r"Console: +http://127\.0\.0\.1:\d+/#/runs/demo", result.stdout)
    assert "console.aws.amazon.com" not in result.stdout
    assert "succeeded" in result.stdout
    assert "3 of 3 shards downloaded" in result.stdout
    assert f"Endpoint:  {DEMO_ENDPOINT} (created" in result.stdout
    assert "orchestration overhead" in result.stdout
    # The demo's model visibly learns: the evaluation job's held-out prompts (issue 10's goal:
    # trained ≥ 0.8 while the untrained base stays near chance, 1/8).
    match = re.search(r"^prompt adherence: base ([0-9.]+) → trained ([0-9.]+) \(48 prompts\)$", result.stdout, re.M)
    assert match, result.stdout[-4000:]
    base, trained = float(match[1]), float(match[2])
    assert base <= 0.3
    assert trained >= 0.8
    assert "model-package/sdf-demo/" in result.stdout
    # The held-out rows (issue 31): the tiny CLIP fitted to the scenes scores the trained model's images
    # against their captions far above the untrained base's, and their KID to the real images falls.
    clip = re.search(
        r"^clip_score ↑: base ([0-9.]+) → trained ([0-9.]+) \((\d+) held-out samples\)$", result.stdout, re.M
    )
    kid = re.search(r"^kid ↓: base (-?[0-9.]+) → trained (-?[0-9.]+) \((\d+) held-out samples\)$", result.stdout, re.M)
    assert clip, result.stdout[-4000:]
    assert kid, result.stdout[-4000:]
    # 32 asked for; the split holds ~47 of the 300 good rows out, by their URLs' hashes (the port changes).
    assert 16 <= int(clip[3]) == int(kid[3]) <= HOLDOUT_SAMPLES
    assert float(clip[2]) >= DEMO_GATE["clip_score"]["min"] > float(clip[1])
    assert float(kid[2]) < float(kid[1])
    assert re.search(r"^held-out grid \(real \| base \| trained per caption\): .*holdout\.png$", result.stdout, re.M)
    assert (tmp_path / "work" / "demo" / "holdout.png").is_file()
    assert (tmp_path / "work" / "demo" / "adherence.png").is_file()
    with Image.open(output) as image:
        assert image.format == "PNG"
        # Serving defaults to the trained size: the demo trains at 32 px (sdflow/demo.py).
        assert image.size == (32, 32)
    assert not (tmp_path / "work" / "cloud.json").exists(), "the demo cleans up its state file"
