"""A job whose container sees a GPU but whose torch finds no CUDA fails at once, naming the host's driver.

Without this, a CUDA build of torch on a host whose driver is too old for its CUDA (the accelerate image's CUDA 13
needs an R580 driver; SageMaker's inference hosts run R470 to R550, "Best practices to minimize interruptions
during GPU driver upgrades") finds `torch.cuda.is_available()` False, and the job goes on without a word: training
on the CPU over gloo for the whole paid run, evaluation and serving on the CPU. Every entrypoint (training
launcher, serve, evaluate) calls `require_cuda` first.

A GPU is seen when the NVIDIA container runtime put a device node in the container (/dev/nvidia0, ...), or when
NVIDIA_VISIBLE_DEVICES names devices (indices or GPU UUIDs). Its value "all" is no evidence: both images set it
as ENV so that the runtime exposes whatever GPUs the host has, CPU hosts included. The driver's version is the
kernel module's, read from /proc/driver/nvidia/version (as AWS's start_cuda_compat.sh reads it). The paths are
module attributes so that a test on a CPU machine can fake a device and a driver file.
"""

from __future__ import annotations

import os
import re
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
    return (
        f"the container sees GPU(s) {', '.join(gpus)} but torch {torch_version} (CUDA {cuda}) finds no usable CUDA "
        f"device; {shown_driver}; {need}{said}. Refusing to run on the CPU: pick an instance type whose driver runs "
        "this image (Validate run's table: sdflow_common.instance_types)"
    )


def require_cuda(
    dev_dir: Path | None = None, driver_file: Path | None = None, environ: Mapping[str, str] | None = None
) -> None:
    """Raise NoCudaError when the container sees a GPU and torch finds no CUDA (see the module docstring)."""
    found = problem(dev_dir, driver_file, environ)
    if found is not None:
        raise NoCudaError(found)
