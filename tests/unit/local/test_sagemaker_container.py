"""A local container ends with its main process, as a container ends with its PID 1: every process
it started goes at once, those in a session of their own included (torchrun's workers)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from sdflow.local.sagemaker.container import ContainerProcess, terminate

# The host's main process (like `train`) starts a launcher in its own process group (like torchrun),
# which starts a worker in a session of its own (torchrun starts its workers with start_new_session).
# The worker writes a heartbeat, as a training process writes steps and checkpoints.
MAIN = """
import subprocess, sys, time
launcher = '''
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True)
print("worker", worker.pid, flush=True)
time.sleep(600)
'''
worker = '''
import sys, time
while True:
    with open(sys.argv[1], "a") as beat:
        beat.write(".")
    time.sleep(0.05)
'''
subprocess.Popen([sys.executable, "-c", launcher, worker, sys.argv[1]])
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for every purpose but its parent's wait
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _beating_worker(process: ContainerProcess, beat: Path, timeout_s: float = 30.0) -> int:
    """The worker's pid, once its heartbeat has started."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        started = [line for line in list(process.tail) if line.startswith("worker ")]
        if started and beat.exists():
            return int(started[0].split()[1])
        time.sleep(0.05)
    raise AssertionError(f"no worker started: {process.tail_text()}")


def _start(tmp_path: Path, beat: Path) -> ContainerProcess:
    env = {"PATH": os.environ.get("PATH", "")}
    return ContainerProcess(
        "job/algo-1", [sys.executable, "-c", MAIN, str(beat)], env, tmp_path, tmp_path / "algo-1.log"
    )


def test_container_main_process_sigkilled_ends_every_process_of_the_container_at_once(tmp_path: Path) -> None:
    beat = tmp_path / "beat"
    process = _start(tmp_path, beat)
    worker = _beating_worker(process, beat)
    try:
        os.kill(process.pid, signal.SIGKILL)  # the main process only, as the OOM killer picks one
        killed = time.monotonic()
        # Nobody polls the container here: its end is noticed by itself, as the kernel ends a
        # PID namespace whose init died.
        while _alive(worker) and time.monotonic() - killed < 5:
            time.sleep(0.02)
        assert not _alive(worker), "the worker trains on after its container's main process died"
        size = beat.stat().st_size
        time.sleep(0.3)
        assert beat.stat().st_size == size, "no heartbeat after the container ended"
    finally:
        terminate([process], 1.0)
        if _alive(worker):  # what this test found running: not left behind
            os.kill(worker, signal.SIGKILL)


def test_container_terminate_reaches_worker_in_its_own_session(tmp_path: Path) -> None:
    beat = tmp_path / "beat"
    process = _start(tmp_path, beat)
    worker = _beating_worker(process, beat)
    terminate([process], 1.0)
    assert process.poll() is not None
    assert not _alive(worker)
