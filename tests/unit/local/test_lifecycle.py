"""Stopping the local runtime: signals unwind the CLI, shutdown leaves no worker behind."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sdflow import cli, session
from sdflow.local.lambda_runner import FunctionSpec, InvocationResult, LambdaRunner
from tests.constants import REGION
from tests.unit.local.helpers import HANDLERS, wait_for


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_runner_shutdown_busy_worker_killed_and_invocation_answers_exit_error(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(HANDLERS)
    runner = LambdaRunner("http://127.0.0.1:9", REGION, tmp_path / "logs")
    spec = FunctionSpec(
        "busy", "arn:aws:lambda:us-east-1:1:function:busy", "app.lambda_handler", tmp_path, timeout_s=60
    )
    results: list[InvocationResult] = []
    call = threading.Thread(target=lambda: results.append(runner.invoke(spec, json.dumps({"sleep": 60}))))
    call.start()
    try:
        (worker,) = wait_for(lambda: [w for w in runner._all_workers if w.ready], what="a busy worker")
        time.sleep(0.2)  # the handler is sleeping now
        started = time.monotonic()
        runner.shutdown()
        call.join(15)
    finally:
        runner.shutdown()
    assert not call.is_alive()
    assert time.monotonic() - started < 10
    assert _gone(worker.proc.pid)
    assert results[0].error_type == "Runtime.ExitError"


def _signal_inside_stop_on_signals(signum: int, again: bool = False) -> None:
    with cli.stop_on_signals():
        try:
            os.kill(os.getpid(), signum)
            time.sleep(5)
        finally:
            if again:  # a second signal while stopping must not abort the cleanup
                os.kill(os.getpid(), signum)
                time.sleep(0.05)


def test_stop_on_signals_sigterm_raises_stop_requested_once(capsys: pytest.CaptureFixture[str]) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(cli.StopRequested) as stopped:
        _signal_inside_stop_on_signals(signal.SIGTERM, again=True)
    assert stopped.value.signum == signal.SIGTERM
    assert stopped.value.exit_code == 143
    assert "still stopping" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == before


def test_stop_on_signals_sigint_raises_stop_requested_exit_130() -> None:
    with pytest.raises(cli.StopRequested) as stopped:
        _signal_inside_stop_on_signals(signal.SIGINT)
    assert stopped.value.exit_code == 130


def test_stop_on_signals_ignored_signal_stays_ignored() -> None:
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with cli.stop_on_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def _write(workdir: Path, state: dict[str, Any]) -> Path:
    path = workdir / session.STATE_FILE
    path.write_text(json.dumps(state))
    return path


def test_remove_state_own_pid_file_removed(tmp_path: Path) -> None:
    path = _write(tmp_path, {"pid": os.getpid()})
    session.remove_state(tmp_path)
    assert not path.exists()


def test_remove_state_other_process_file_kept(tmp_path: Path) -> None:
    path = _write(tmp_path, {"pid": os.getpid() + 1})
    session.remove_state(tmp_path)
    assert path.exists()
    session.remove_state(tmp_path / "missing")  # no file: nothing to do
