"""The second stack's training runs as the tests start them: a job's /opt/ml written in a temporary
folder, `bin/train` for one process or the launcher's torchrun command for two, the step losses read
off its output. Shared by the backend's and the families' training tests (tests/image_accelerate)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from train_fixtures import write_job_config

from sdflow_image.training import launcher
from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]
BIN_TRAIN = REPO / "training_image" / "bin" / "train"
STEP_LINE = re.compile(r"^step=(\d+) loss=([0-9.eE+-]+)$", re.MULTILINE)
TIMEOUT = 240
STEPS = 4

HP = {
    "backend": "accelerate",
    "resolution": "32",
    "train_batch_size": "2",
    "learning_rate": "1e-3",
    "max_train_steps": str(STEPS),
    "checkpointing_steps": "100",
    "seed": "0",
    "validation_prompts": '["a red square on a blue background"]',
    "validation_inference_steps": "1",
    "dataloader_num_workers": "0",
    "interleave_shards": "2",
    "proportion_empty_prompts": "0.25",
}
SD3_HP = {**HP, "sd3_t5": "false"}


def job_env(opt_ml: Path) -> dict[str, str]:
    # Two processes on two cores: one thread each keeps them from thrashing.
    return {**os.environ, "SDFLOW_OPT_ML": str(opt_ml), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1"}  # fmt: skip


def job(tmp: Path, name: str, hp: dict[str, str], base: Path, dataset: Path) -> Path:
    return write_job_config(tmp / name, hp, dataset_dir=dataset, base_model_dir=base)


def start(opt_ml: Path, nproc: int) -> subprocess.Popen[str]:
    """`bin/train` for one process; for two, the launcher's torchrun command on this one host
    (the launcher itself starts one process per GPU, so one on a CPU host)."""
    if nproc == 1:
        command = [sys.executable, str(BIN_TRAIN)]
    else:
        topology = {"stop_grace_s": 60.0, "nnodes": 1, "node_rank": 0, "nproc_per_node": nproc,
                    "master_addr": "127.0.0.1", "master_port": free_port()}  # fmt: skip
        command = launcher.torchrun_command(topology, [])
    env = {**launcher.child_environment({}), **job_env(opt_ml)}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run(opt_ml: Path, nproc: int, stop_at: int | None = None) -> tuple[int, str]:
    """Exit status and output; with `stop_at`, SIGTERM once that step's line is printed."""
    proc = start(opt_ml, nproc)
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + TIMEOUT
    if stop_at is not None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(f"step={stop_at} "):
                proc.send_signal(signal.SIGTERM)
                break
            assert time.monotonic() < deadline, "".join(lines[-40:])
    rest, _ = proc.communicate(timeout=TIMEOUT)
    return proc.returncode, "".join(lines) + rest


def losses(out: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in STEP_LINE.finditer(out)}


def summary(opt_ml: Path) -> dict[str, Any]:
    return json.loads((opt_ml / "model" / "training_summary.json").read_text())


def resumed_copy(tmp: Path, done: Path, hp: dict[str, str], base: Path, dataset: Path, nproc: int) -> dict[int, float]:
    """A new attempt of a finished job, given the checkpoints it left (SageMaker's restart
    downloads them): it resumes from the newest and trains to the end; returns its step losses."""
    again = job(tmp, f"{done.name}-again", hp, base, dataset)
    shutil.copytree(done / "checkpoints", again / "checkpoints")
    code, out = run(again, nproc)
    assert code == 0, out[-4000:]
    assert "resumed from checkpoint" in out
    return losses(out)
