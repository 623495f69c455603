"""The `train` launcher and its torchrun: topology, the command, and the stop grace.

The stop tests run a real torchrun (through sdflow_image.training.elastic_run) with two gloo worker
processes whose SIGTERM "checkpoint" takes longer than torchrun's own 30 s wait, and stop
the launcher the way SageMaker stops a container: SIGTERM to its main process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from sdflow_image.training import elastic_run, launcher
from tests.helpers import free_port, wait_for

pytestmark = pytest.mark.image

REPO = Path(__file__).resolve().parents[2]
ONE_HOST = {"hosts": ["algo-1"], "current_host": "algo-1", "network_interface_name": "lo"}

# A training loop in miniature: steps agree on the stop through an all_reduce (so every rank
# leaves the loop after the same step), then each rank "saves" for STOP_TEST_SAVE_S seconds,
# writes its file, meets the others and exits 143 as sdflow_image.training.train does.
STOP_WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    import torch
    import torch.distributed as dist

    out = Path(os.environ["STOP_TEST_DIR"])
    save_s = float(os.environ["STOP_TEST_SAVE_S"])
    stop = torch.zeros(1)
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.fill_(1))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    (out / f"ready-{rank}").write_text(str(os.getpid()))
    while True:
        flag = stop.clone()
        dist.all_reduce(flag)
        if flag.item() > 0:
            break
        time.sleep(0.05)
    time.sleep(save_s)
    (out / f"checkpoint-{rank}").write_text("saved")
    dist.barrier()
    sys.exit(143)
    """
)


def _launch(tmp_path: Path, *, save_s: float, grace_s: float) -> subprocess.Popen[bytes]:
    (tmp_path / "stop_worker.py").write_text(STOP_WORKER)
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO / "training_image"), str(REPO)]),
        SDFLOW_OPT_ML=str(tmp_path / "opt_ml"),
        SDFLOW_MASTER_ADDR="127.0.0.1",
        SDFLOW_MASTER_PORT=str(free_port()),
        SDFLOW_STOP_GRACE_S=str(grace_s),
        STOP_TEST_DIR=str(tmp_path),
        STOP_TEST_SAVE_S=str(save_s),
    )
    script = (
        "import os, sys; from sdflow_image.training import launcher; "
        "topology = launcher.plan({'hosts': ['algo-1'], 'current_host': 'algo-1'}, 2, dict(os.environ)); "
        "sys.exit(launcher.run_torchrun(topology, [], module='stop_worker'))"
    )
    log = (tmp_path / "launcher.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-c", script], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _stop_after_ready(tmp_path: Path, proc: subprocess.Popen[bytes]) -> tuple[int, float, list[int]]:
    """SIGTERM the launcher once both workers run; (exit status, seconds to exit, worker pids)."""
    pids: list[int] = []
    try:
        wait_for(
            lambda: all((tmp_path / f"ready-{r}").exists() for r in (0, 1)) or proc.poll() is not None,
            timeout_s=120,
            what="both workers to join the gloo group",
            interval_s=0.2,
        )
        assert proc.poll() is None, (tmp_path / "launcher.log").read_text()[-4000:]
        pids = [int((tmp_path / f"ready-{r}").read_text()) for r in (0, 1)]
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=150)
        return code, time.monotonic() - started, pids
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in pids:  # torchrun starts each worker in a session of its own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_run_torchrun_sigterm_workers_saving_past_30s_finish_and_exit_143(tmp_path: Path) -> None:
    proc = _launch(tmp_path, save_s=40, grace_s=110)
    code, elapsed, _ = _stop_after_ready(tmp_path, proc)
    log = (tmp_path / "launcher.log").read_text()
    assert code == 128 + signal.SIGTERM, log[-4000:]
    for rank in (0, 1):
        assert (tmp_path / f"checkpoint-{rank}").read_text() == "saved", log[-4000:]
    assert elapsed >= 40, "the workers' 40 s save is what the launcher waited for"
    assert not (tmp_path / "opt_ml" / "output" / "failure").exists(), "a stop is not a failure"


@pytest.mark.slow
def test_run_torchrun_sigterm_worker_outliving_grace_is_killed_at_grace(tmp_path: Path) -> None:
    proc = _launch(tmp_path, save_s=40, grace_s=4)
    code, elapsed, pids = _stop_after_ready(tmp_path, proc)
    log = (tmp_path / "launcher.log").read_text()
    assert code == 128 + signal.SIGTERM, log[-4000:]
    assert elapsed < 25, f"the 4 s grace, not torch's 30 s, bounds the stop (took {elapsed:.0f} s)"
    assert not any((tmp_path / f"checkpoint-{rank}").exists() for rank in (0, 1))
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


@pytest.mark.slow
def test_run_torchrun_worker_failing_writes_failure_file_and_exits_nonzero(tmp_path: Path) -> None:
    (tmp_path / "crash_worker.py").write_text("import sys\nsys.exit(3)\n")
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO / "training_image"), str(REPO)]),
        SDFLOW_OPT_ML=str(tmp_path / "opt_ml"),
    )
    script = (
        "import sys; from sdflow_image.training import launcher; "
        "topology = launcher.plan({'hosts': ['algo-1'], 'current_host': 'algo-1'}, 2, "
        "{'SDFLOW_MASTER_ADDR': '127.0.0.1', 'SDFLOW_MASTER_PORT': sys.argv[1]}); "
        "sys.exit(launcher.run_torchrun(topology, [], module='crash_worker'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(free_port())], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr[-4000:]
    failure = (tmp_path / "opt_ml" / "output" / "failure").read_text()
    assert "training processes exited with status 1" in failure


# --- plan and command ---------------------------------------------------------------------


def test_plan_one_host_one_device_runs_in_process() -> None:
    topology = launcher.plan(ONE_HOST, 0, {})
    assert topology["in_process"] is True
    assert topology["stop_grace_s"] == elastic_run.DEFAULT_STOP_GRACE_S == 110


def test_plan_second_of_two_hosts_gets_rank_and_first_host_as_master() -> None:
    config = {"hosts": ["algo-1", "algo-2"], "current_host": "algo-2"}
    topology = launcher.plan(config, 4, {"SDFLOW_MASTER_PORT": "29555"})
    assert topology["in_process"] is False
    assert (topology["nnodes"], topology["node_rank"], topology["nproc_per_node"]) == (2, 1, 4)
    assert (topology["master_addr"], topology["master_port"]) == ("algo-1", 29555)


@pytest.mark.parametrize("value", ["0", "-5", "121", "ten", ""])
def test_plan_bad_stop_grace_raises_naming_the_variable(value: str) -> None:
    with pytest.raises(launcher.ResourceConfigError, match="SDFLOW_STOP_GRACE_S"):
        launcher.plan(ONE_HOST, 0, {"SDFLOW_STOP_GRACE_S": value})


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"hosts": [], "current_host": "algo-1"}, "'hosts' must be a non-empty list"),
        ({"hosts": ["algo-1"], "current_host": "algo-9"}, "current_host='algo-9'"),
    ],
)
def test_plan_bad_resource_config_raises_naming_the_field(config: dict, message: str) -> None:
    with pytest.raises(launcher.ResourceConfigError, match=message):
        launcher.plan(config, 0, {})


def test_plan_bad_master_port_raises_naming_the_variable() -> None:
    with pytest.raises(launcher.ResourceConfigError, match="SDFLOW_MASTER_PORT"):
        launcher.plan(ONE_HOST, 0, {"SDFLOW_MASTER_PORT": "70000"})


def test_torchrun_command_goes_through_elastic_run_with_the_grace() -> None:
    config = {"hosts": ["algo-1", "algo-2"], "current_host": "algo-2"}
    topology = launcher.plan(config, 2, {"SDFLOW_STOP_GRACE_S": "95"})
    command = launcher.torchrun_command(topology, ["--seed", "1"])
    assert command[1:6] == ["-m", "sdflow_image.training.elastic_run", "--stop_grace_s=95", "--", "--nnodes=2"]
    assert "--node_rank=1" in command
    assert "--nproc_per_node=2" in command
    assert command[-4:] == ["-m", "sdflow_image.training.train", "--seed", "1"]


# --- elastic_run ---------------------------------------------------------------------------


def test_elastic_run_parse_args_strips_separator_and_keeps_torchrun_args() -> None:
    args = elastic_run.parse_args(["--stop_grace_s", "30", "--", "--nnodes=1", "-m", "x"])
    assert args.stop_grace_s == 30
    assert args.torchrun_args == ["--nnodes=1", "-m", "x"]


@pytest.mark.parametrize("argv", [["--stop_grace_s", "soon", "--", "x"], ["--stop_grace_s", "0", "--", "x"], ["--"]])
def test_elastic_run_parse_args_bad_input_exits_2_naming_the_flag(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        elastic_run.parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--stop_grace_s" in err or "torchrun arguments are required" in err


def test_install_stop_grace_agent_closes_workers_with_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher import api as launcher_api

    monkeypatch.setattr(launcher_api, "LocalElasticAgent", LocalElasticAgent)
    elastic_run.install_stop_grace(77)
    agent_class = launcher_api.LocalElasticAgent
    assert issubclass(agent_class, LocalElasticAgent)
    assert agent_class is not LocalElasticAgent

    calls: list[tuple[object, ...]] = []

    class FakePContext:
        def close(self, death_sig: object = None, timeout: int = 30) -> None:
            calls.append((death_sig, timeout))

    agent: Any = agent_class.__new__(agent_class)  # only the attributes _shutdown reads
    agent._pcontext = FakePContext()
    agent._worker_watchdog = agent._health_check_server = agent._rdzv_handler = None
    agent._shutdown(signal.SIGTERM)
    assert calls[0] == (signal.SIGTERM, 77), "the workers get the grace, not close's default 30 s"
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN, "stop signals are restored after close"


def test_install_stop_grace_on_changed_torch_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.launcher import api as launcher_api

    monkeypatch.setattr(launcher_api, "LocalElasticAgent", object)
    with pytest.raises(elastic_run.IncompatibleTorchError, match=r"torch 2\.5\.1"):
        elastic_run.install_stop_grace(10)


def test_install_stop_grace_on_later_torch_passes_the_grace_as_shutdowns_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Later torch's agent takes close's timeout itself: `_shutdown(death_sig, timeout=30)`."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher import api as launcher_api

    calls: list[tuple[object, ...]] = []

    class LaterAgent(LocalElasticAgent):
        def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:  # type: ignore[override]
            calls.append((death_sig, timeout, signal.getsignal(signal.SIGTERM)))

    from torch.distributed.elastic.agent.server import local_elastic_agent

    monkeypatch.setattr(launcher_api, "LocalElasticAgent", LaterAgent)
    monkeypatch.setattr(local_elastic_agent, "LocalElasticAgent", LaterAgent)
    monkeypatch.setattr(elastic_run, "_check_torch", lambda *_: elastic_run.SHUTDOWN_WITH_TIMEOUT)
    elastic_run.install_stop_grace(77)
    agent: Any = launcher_api.LocalElasticAgent.__new__(launcher_api.LocalElasticAgent)
    agent._shutdown(signal.SIGTERM)
    assert calls == [(signal.SIGTERM, 77, signal.SIG_IGN)], "the grace, with repeated stop signals ignored meanwhile"


@pytest.mark.parametrize(("plugin", "cuda"), [("torch_ddp", True), ("gemini", False), ("low_level_zero", False)])
def test_kernels_prepare_without_hybrid_adam_or_cuda_builds_nothing(plugin: str, cuda: bool) -> None:
    from sdflow_image.training import kernels

    assert kernels.prepare(plugin, cuda=cuda) is None


def _fake_loaders(monkeypatch: pytest.MonkeyPatch, loaded: list[str], fail: bool = False) -> None:
    from colossalai.kernel import kernel_loader

    def loader(name: str) -> type:
        class Fake:
            def load(self) -> None:
                if fail:
                    raise RuntimeError("nvcc not found")
                loaded.append(name)

        return Fake

    monkeypatch.setattr(kernel_loader, "CPUAdamLoader", loader("cpu_adam"))
    monkeypatch.setattr(kernel_loader, "FusedOptimizerLoader", loader("fused_optim"))


def test_kernels_prepare_zero_plugin_on_cuda_builds_both_and_logs_the_seconds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from sdflow_image.training import kernels

    loaded: list[str] = []
    _fake_loaders(monkeypatch, loaded)
    seconds = kernels.prepare("low_level_zero", cuda=True)
    assert loaded == ["cpu_adam", "fused_optim"]
    assert seconds is not None
    assert seconds >= 0
    assert f"Colossal-AI's Adam kernels ready in {seconds:.1f} s" in capsys.readouterr().out


def test_kernels_prepare_build_failure_names_plugin_and_the_kernel_free_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    from sdflow_image.training import kernels

    _fake_loaders(monkeypatch, [], fail=True)
    with pytest.raises(kernels.KernelBuildError, match=r"plugin=gemini could not be built: nvcc not found.*torch_ddp"):
        kernels.prepare("gemini", cuda=True)


def test_launcher_main_builds_kernels_for_the_cli_plugin_before_training(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from sdflow_image.training import kernels, train

    config = tmp_path / "input" / "config"
    config.mkdir(parents=True)
    (config / "resourceconfig.json").write_text('{"current_host": "algo-1", "hosts": ["algo-1"]}')
    (config / "hyperparameters.json").write_text('{"plugin": "torch_ddp"}')
    monkeypatch.setenv("SDFLOW_OPT_ML", str(tmp_path))
    order: list[tuple[str, object]] = []
    monkeypatch.setattr(kernels, "prepare", lambda plugin, cuda: order.append(("kernels", plugin)))
    monkeypatch.setattr(train, "cli", lambda argv: order.append(("train", argv)) or 0)
    assert launcher.main(["--plugin", "low_level_zero"]) == 0
    assert order == [("kernels", "low_level_zero"), ("train", ["--plugin", "low_level_zero"])]
