"""A job whose container sees a GPU but whose torch finds no CUDA fails at once, naming the host's driver.

Without this, a CUDA build of torch on a host whose driver is too old for its CUDA (the accelerate image's CUDA 13
needs an R580 driver; SageMaker's inference hosts run R470 to R550, "Best practices to minimize interruptions
during GPU driver upgrades") finds `torch.cuda.is_available()` False, and the job goes on without a word: training
on the CPU over gloo for the whole paid run, evaluation and serving on the CPU. Every entrypoint (training
launcher, serve, evaluate) calls `require_cuda` first.

Before that, `enable_cuda_compat` does what AWS's CUDA 13 containers' start_cuda_compat.sh does
(aws/deep-learning-containers, scripts/docker/pytorch/start_cuda_compat.sh): when the image ships NVIDIA's
forward-compatibility libraries (SDFLOW_CUDA_COMPAT_DIR, set by Dockerfile.accelerate) and the host's driver is
older than the one they come from (the version libcuda.so.1 links to), it puts their folder first on
LD_LIBRARY_PATH. The dynamic loader reads LD_LIBRARY_PATH once, at a process's start, so the entrypoint starts
itself again with it (os.execve); the folder then leads the path and nothing repeats. Forward compatibility
works on data-center GPUs from a supported driver branch only (Validate run refuses the rest where AWS documents
the driver, sdflow_common.instance_types); where it cannot bridge, torch finds no CUDA and the check below fails.

A GPU is seen when the NVIDIA container runtime put a device node in the container (/dev/nvidia0, ...), or when
NVIDIA_VISIBLE_DEVICES names devices (indices or GPU UUIDs). Its value "all" is no evidence: both images set it
as ENV so that the runtime exposes whatever GPUs the host has, CPU hosts included. The driver's version is the
kernel module's, read from /proc/driver/nvidia/version (as AWS's start_cuda_compat.sh reads it). The paths are
module attributes so that a test on a CPU machine can fake a device and a driver file.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

DEV_DIR = Path("/dev")
DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")
# The oldest driver branch that runs each CUDA major without a compatibility package (NVIDIA's "Supported Drivers
# and CUDA Toolkit Versions"; CUDA 12's minor version compatibility starts at R525).
NATIVE_BRANCH = {12: 525, 13: 580}
_MODULE_VERSION = re.compile(r"Kernel Module\s+([0-9][0-9.]*)")
_NOT_DEVICES = ("", "all", "none", "void")


COMPAT_DIR_VARIABLE = "SDFLOW_CUDA_COMPAT_DIR"


def _numbers(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def compat_driver(compat_dir: Path) -> str | None:
    """The driver version the image's cuda-compat libraries come from ('580.95.05'), from the name libcuda.so.1
    links to (libcuda.so.580.95.05), as start_cuda_compat.sh reads it; None without them."""
    try:
        target = os.readlink(compat_dir / "libcuda.so.1")
    except OSError:
        return None
    version = Path(target).name.removeprefix("libcuda.so.")
    return version if _numbers(version) else None


def compat_library_path(environ: Mapping[str, str], driver_file: Path | None = None) -> str | None:
    """LD_LIBRARY_PATH with the compat folder first, when the image has one and the host's driver is older than
    its libraries; None when nothing is to change (no compat, newer or unknown driver, or already first)."""
    folder = environ.get(COMPAT_DIR_VARIABLE, "")
    current = environ.get("LD_LIBRARY_PATH", "")
    if not folder or current.split(":")[0] == folder:
        return None
    compat, host = compat_driver(Path(folder)), host_driver(driver_file)
    if compat is None or host is None or _numbers(host) >= _numbers(compat):
        return None
    return f"{folder}:{current}" if current else folder


def enable_cuda_compat(
    environ: Mapping[str, str] | None = None,
    driver_file: Path | None = None,
    execve: Callable[[str, list[str], dict[str, str]], object] = os.execve,
) -> None:
    """Start this entrypoint again with cuda-compat first on LD_LIBRARY_PATH when the host's driver needs it."""
    env = dict(os.environ if environ is None else environ)
    path = compat_library_path(env, driver_file)
    if path is None:
        return
    print(
        f"host NVIDIA driver {host_driver(driver_file)} is older than the image's cuda-compat "
        f"{compat_driver(Path(env[COMPAT_DIR_VARIABLE]))}: starting again with {env[COMPAT_DIR_VARIABLE]} first on "
        "LD_LIBRARY_PATH",
        file=sys.stderr,
        flush=True,
    )
    execve(sys.executable, [sys.executable, *sys.argv], {**env, "LD_LIBRARY_PATH": path})


class NoCudaError(RuntimeError):
    """The container sees a GPU and torch cannot use it."""


def visible_gpus(dev_dir: Path | None = None, environ: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs the container was given: its /dev/nvidia<N> nodes, else what NVIDIA_VISIBLE_DEVICES names."""
    nodes = sorted(p.name for p in (dev_dir or DEV_DIR).glob("nvidia*") if p.name.removeprefix("nvidia").isdigit())
    if nodes:
        return [f"/dev/{name}" for name in nodes]
    named = (environ if environ is not None else os.environ).get("NVIDIA_VISIBLE_DEVICES", "").strip()
    if named.lower() in _NOT_DEVICES:
        return []
    return [f"NVIDIA_VISIBLE_DEVICES={named}"]


def host_driver(driver_file: Path | None = None) -> str | None:
    """The host's NVIDIA kernel module version (e.g. '535.104.05'), or None when the file is absent or unreadable."""
    try:
        text = (driver_file or DRIVER_VERSION_FILE).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    found = _MODULE_VERSION.search(text)
    return found.group(1) if found else None


def _torch_cuda() -> tuple[bool, str, str | None, list[str]]:
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    return available, torch.__version__, torch.version.cuda, [str(w.message) for w in caught]


def problem(
    dev_dir: Path | None = None,
    driver_file: Path | None = None,
    environ: Mapping[str, str] | None = None,
    probe: Callable[[], tuple[bool, str, str | None, list[str]]] = _torch_cuda,
) -> str | None:
    """Why the job must not start (a GPU seen, no CUDA in torch), or None."""
    gpus = visible_gpus(dev_dir, environ)
    if not gpus:
        return None
    available, torch_version, cuda, notes = probe()
    if available:
        return None
    driver = host_driver(driver_file)
    shown_driver = (
        f"host NVIDIA driver {driver}"
        if driver
        else f"no NVIDIA driver version in {driver_file or DRIVER_VERSION_FILE} (the driver is not mounted)"
    )
    major = int(cuda.split(".")[0]) if cuda else None
    need = (
        f"CUDA {cuda} needs driver R{NATIVE_BRANCH[major]} or newer"
        if major in NATIVE_BRANCH
        else f"this torch is {'a CPU build' if cuda is None else f'built for CUDA {cuda}'}"
    )
    said = f" (torch said: {notes[0].strip()[:300]})" if notes else ""
    env = os.environ if environ is None else environ
    folder = env.get(COMPAT_DIR_VARIABLE, "")
    if folder and env.get("LD_LIBRARY_PATH", "").split(":")[0] == folder:
        need += f", or R535+ on a data-center GPU with the cuda-compat {compat_driver(Path(folder))} in use here"
    return (
        f"the container sees GPU(s) {', '.join(gpus)} but torch {torch_version} (CUDA {cuda}) finds no usable CUDA "
        f"device; {shown_driver}; {need}{said}. Refusing to run on the CPU: pick an instance type whose driver runs "
        "this image (Validate run's table: sdflow_common.instance_types)"
    )


def require_cuda(
    dev_dir: Path | None = None, driver_file: Path | None = None, environ: Mapping[str, str] | None = None
) -> None:
    """cuda-compat first when the host's driver needs it (enable_cuda_compat: may start the process again), then
    NoCudaError when the container sees a GPU and torch finds no CUDA (see the module docstring)."""
    enable_cuda_compat(environ, driver_file)
    found = problem(dev_dir, driver_file, environ)
    if found is not None:
        raise NoCudaError(found)
