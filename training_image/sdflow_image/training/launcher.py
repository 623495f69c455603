"""The `train` entrypoint: one host, one process → train in this process; otherwise torchrun.

From resourceconfig.json (SageMaker's `hosts` and `current_host`) it starts torchrun with
one process per GPU (one per host on CPU) and the rendezvous on the first host. Local
emulation of several hosts on one machine overrides the address and port with
`SDFLOW_MASTER_ADDR` (default: the first host's name) and `SDFLOW_MASTER_PORT` (default 29500).

SIGTERM and SIGINT are passed to torchrun, which passes them to the training processes
(they save a checkpoint and exit 143, see sdflow_image.training.train). torchrun runs through
sdflow_image.training.elastic_run, which gives the workers `SDFLOW_STOP_GRACE_S` seconds (default
110, inside SageMaker's 120) to do so instead of torchrun's fixed 30. The exit status is the
child's (143 after a stop); a child that failed without leaving a failure file gets one
written here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from sdflow_image import contract
from sdflow_image.training.elastic_run import DEFAULT_STOP_GRACE_S

TRAINING_IMAGE_DIR = Path(__file__).resolve().parents[2]  # training_image/: sdflow_image/training/launcher.py
DEFAULT_MASTER_PORT = 29500
TRAIN_MODULE = "sdflow_image.training.train"


class ResourceConfigError(ValueError):
    """resourceconfig.json does not describe this host."""


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan(resource_config: dict[str, Any], gpus: int, environ: dict[str, str]) -> dict[str, Any]:
    """How to run on this host: in-process, or the torchrun topology."""
    hosts = resource_config.get("hosts")
    current = resource_config.get("current_host")
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) for h in hosts):
        raise ResourceConfigError(f"resourceconfig.json 'hosts' must be a non-empty list of names, got {hosts!r}")
    if current not in hosts:
        raise ResourceConfigError(f"resourceconfig.json current_host={current!r} is not one of hosts {hosts}")
    nproc = max(gpus, 1)
    port = environ.get("SDFLOW_MASTER_PORT", str(DEFAULT_MASTER_PORT))
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ResourceConfigError(f"SDFLOW_MASTER_PORT={port!r} is not a TCP port number")
    return {
        "stop_grace_s": _stop_grace(environ),
        "in_process": len(hosts) == 1 and nproc == 1,
        "nnodes": len(hosts),
        "node_rank": hosts.index(current),
        "nproc_per_node": nproc,
        "master_addr": environ.get("SDFLOW_MASTER_ADDR", hosts[0]),
        "master_port": int(port),
        "interface": resource_config.get("network_interface_name"),
    }


def _stop_grace(environ: dict[str, str]) -> float:
    raw = environ.get("SDFLOW_STOP_GRACE_S", str(DEFAULT_STOP_GRACE_S))
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    # SageMaker SIGKILLs 120 s after SIGTERM: a longer grace would never be used.
    if not 0 < seconds <= 120:
        raise ResourceConfigError(f"SDFLOW_STOP_GRACE_S={raw!r} must be seconds in (0, 120]; unset it for 110")
    return seconds


def torchrun_command(topology: dict[str, Any], argv: list[str], module: str = TRAIN_MODULE) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sdflow_image.training.elastic_run",
        f"--stop_grace_s={topology['stop_grace_s']:g}",
        "--",
        f"--nnodes={topology['nnodes']}",
        f"--node_rank={topology['node_rank']}",
        f"--nproc_per_node={topology['nproc_per_node']}",
        f"--master_addr={topology['master_addr']}",
        f"--master_port={topology['master_port']}",
        "-m",
        module,
        *argv,
    ]


def child_environment(topology: dict[str, Any]) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TRAINING_IMAGE_DIR), env.get("PYTHONPATH", "")) if p)
    interface = topology.get("interface")
    # Only an interface this machine has: local emulation may describe one it lacks.
    if interface and Path("/sys/class/net", interface).exists():
        env.setdefault("GLOO_SOCKET_IFNAME", interface)
        env.setdefault("NCCL_SOCKET_IFNAME", interface)
    return env


def run_torchrun(topology: dict[str, Any], argv: list[str], module: str = TRAIN_MODULE) -> int:
    command = torchrun_command(topology, argv, module)
    print("launching: " + " ".join(command), flush=True)
    child = subprocess.Popen(command, env=child_environment(topology))
    signalled: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        signalled.append(signum)
        if child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if code < 0:
        code = 128 - code  # killed by a signal: report it the shell's way
    if code != 0 and not signalled and not contract.failure_file().exists():
        contract.write_failure(f"training processes exited with status {code}; see the job log for the traceback")
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        gpus = _gpu_count()
        topology = plan(contract.read_resource_config(), gpus, dict(os.environ))
        from sdflow_image.training import accumulation, earlier_attempts, kernels, train

        args = train.parse_args(argv)
        world_size = topology["nnodes"] * topology["nproc_per_node"]
        note = accumulation.communication_note(args.plugin, args.gradient_accumulation_steps, world_size)
        if note:
            print(note, flush=True)
        kernels.prepare(args.plugin, cuda=gpus > 0)
        earlier_attempts.adopt(args.checkpoint_s3_uri, args.checkpoints_dir)
    except Exception as exc:
        return contract.fail(exc)
    if topology["in_process"]:
        return train.cli(argv)
    return run_torchrun(topology, argv)


if __name__ == "__main__":
    sys.exit(main())
