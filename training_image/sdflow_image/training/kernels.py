"""Colossal-AI's Adam kernels, built once per host at the start of a training job.

The image carries no prebuilt kernels: Colossal-AI 0.5.0's setup.py compiles them only where it
sees a GPU (`BUILD_EXT=1` with no device raises "[extension] Could not find any kernel compatible
with the current environment"; with `FORCE_CUDA=1` it next calls
`torch.cuda.get_device_capability()`), and image builders (docker build, CodeBuild, a laptop)
have none. So the job builds them, for exactly the GPU it runs on, before torchrun starts the
workers: the workers then load the built kernels instead of racing to build them. Only the
plugins that use HybridAdam (gemini, low_level_zero) need them; the seconds go to the job log.
Measured on an H100 with 16 cores (CPU Adam + fused optimizer, nvcc 13.0): 95 s and 108 s on
two fresh machines (README, GPU acceptance).
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("sdflow.train")

ADAM_PLUGINS = ("gemini", "low_level_zero")  # plugins whose optimizer is Colossal-AI's HybridAdam


class KernelBuildError(RuntimeError):
    """Colossal-AI's kernels could not be built or loaded on this host."""


def prepare(plugin: str, cuda: bool) -> float | None:
    """Build (or load, when built already) the kernels `plugin` needs; returns the seconds taken,
    or None when it needs none here (torch_ddp, or no CUDA: check_plugin refuses that later)."""
    if plugin not in ADAM_PLUGINS or not cuda:
        return None
    from colossalai.kernel.kernel_loader import CPUAdamLoader, FusedOptimizerLoader

    print(f"building Colossal-AI's Adam kernels for plugin={plugin} (the image carries none; minutes)", flush=True)
    started = time.perf_counter()
    try:
        CPUAdamLoader().load()
        FusedOptimizerLoader().load()
    except Exception as exc:
        raise KernelBuildError(
            f"Colossal-AI's Adam kernels for plugin={plugin} could not be built: {exc}. The image needs nvcc and "
            "g++ (its -devel base); or train with plugin=torch_ddp, which needs no kernel"
        ) from exc
    seconds = time.perf_counter() - started
    print(f"Colossal-AI's Adam kernels ready in {seconds:.1f} s", flush=True)
    return seconds
