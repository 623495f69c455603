"""The `train` entrypoint: one host, one process → train in this process; otherwise torchrun.

From resourceconfig.json (SageMaker's `hosts` and `current_host`) it starts torchrun with
one process per GPU (one per host on CPU) and the rendezvous on the first host. Local
emulation of several hosts on one machine overrides the address and port with
`SDFLOW_MASTER_ADDR` (default: the first host's name) and `SDFLOW_MASTER_PORT` (default 29500).

SIGTERM and SIGINT are passed to torchrun, which passes them to the training processes
(they save a checkpoint and exit 143, see sdflow_image.train). The exit status is the
child's; a child that failed without leaving a failure file gets one written here.
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

TRAINING_IMAGE_DIR = Path(__file__).resolve().parent.parent
DEFAULT_MASTER_PORT = 29500


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
        "in_process": len(hosts) == 1 and nproc == 1,
        "nnodes": len(hosts),
        "node_rank": hosts.index(current),
        "nproc_per_node": nproc,
        "master_addr": environ.get("SDFLOW_MASTER_ADDR", hosts[0]),
        "master_port": int(port),
        "interface": resource_config.get("network_interface_name"),
    }


def torchrun_command(topology: dict[str, Any], argv: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={topology['nnodes']}",
        f"--node_rank={topology['node_rank']}",
        f"--nproc_per_node={topology['nproc_per_node']}",
        f"--master_addr={topology['master_addr']}",
        f"--master_port={topology['master_port']}",
        "-m",
        "sdflow_image.train",
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


def run_torchrun(topology: dict[str, Any], argv: list[str]) -> int:
    command = torchrun_command(topology, argv)
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
        topology = plan(contract.read_resource_config(), _gpu_count(), dict(os.environ))
    except Exception as exc:
        return contract.fail(exc)
    if topology["in_process"]:
        from sdflow_image import train

        return train.cli(argv)
    return run_torchrun(topology, argv)


if __name__ == "__main__":
    sys.exit(main())
