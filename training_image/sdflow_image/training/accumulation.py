"""Gradient accumulation under each plugin: which ZeRO stage, which micro-batches skip the
gradient communication, and what a step communicates (said once in the job log).

Read in Colossal-AI 0.5.0's source:
- LowLevelZeroPlugin.support_no_sync() is `self.stage == 1`, and LowLevelZeroOptimizer.backward
  asserts "ZeRO2(partition_grads) and no_sync are not compatible" (zero/low_level/low_level_optim.py).
  So stage 2 reduce-scatters every micro-batch's gradients in its backward: k collectives per
  optimizer step. Stage 1 under `optimizer.no_sync()` skips the reduction hooks, the working
  gradients add up in `param.grad`, and the last micro-batch's backward all-reduces their sum
  once. Per step and rank that is 2(N-1)/N of the gradient bytes (a ring all-reduce) against
  k(N-1)/N for stage 2: the same at k = 2, less from k = 3 on, and one synchronisation instead
  of k either way. The price: stage 1 keeps the whole averaged gradient on every rank in the
  working precision (2 bytes a parameter in bf16/fp16, about 1.7 GB for SD 1.5's 860M-parameter
  UNet; not measured) where stage 2 keeps 1/N of it. The fp32 masters and Adam's moments stay
  sharded 1/N in both stages, and the master shards are cut the same way
  (`_create_master_param_current_rank` does not read the stage), so a checkpoint saved under
  one stage resumes under the other (training/precision_state.py).
  Choice: stage 1 with `no_sync` on the micro-batches before the last whenever
  gradient_accumulation_steps > 1 (what DDP users expect of accumulation), stage 2 otherwise.
- GeminiPlugin.support_no_sync() is False and its no_sync raises NotImplementedError; with
  enable_gradient_accumulation its grad hook adds into the gradient chunks and still reduces
  every chunk in every backward (zero/gemini/gemini_ddp.py: grad_handle -> reduce_chunk), and
  each forward gathers the parameters' chunks again. Gemini is chosen for memory, not speed, so
  accumulation stays allowed (it is how a large effective batch fits); the job log says what it
  costs instead of refusing the run.
- TorchDDPPlugin: DDP's no_sync, as before.
"""

from __future__ import annotations

import contextlib
from typing import Any

LOW_LEVEL_ZERO_PLUGIN = "low_level_zero"


def low_level_zero_stage(gradient_accumulation_steps: int) -> int:
    """ZeRO stage for low_level_zero: 1 (no_sync possible) when accumulating, else 2."""
    return 1 if gradient_accumulation_steps > 1 else 2


def skips_sync(plugin: str, gradient_accumulation_steps: int, world_size: int) -> bool:
    """Whether the micro-batches before a step's last run without gradient communication."""
    if world_size <= 1 or gradient_accumulation_steps <= 1:
        return False
    if plugin == "torch_ddp":
        return True
    return plugin == LOW_LEVEL_ZERO_PLUGIN and low_level_zero_stage(gradient_accumulation_steps) == 1


def no_sync(booster: Any, model: Any, optimizer: Any, *, skip: bool) -> contextlib.AbstractContextManager[Any]:
    """The plugin's no_sync for an accumulation micro-batch (`skip`); a null context otherwise.

    torch_ddp's no_sync wants the TorchDDPModel inside the Booster's wrappers (backends/colossalai.py
    `ddp_model`); LowLevelZeroPlugin's wants the boosted optimizer (stage 1 only)."""
    if not skip:
        return contextlib.nullcontext()
    from colossalai.booster.plugin import LowLevelZeroPlugin

    if isinstance(booster.plugin, LowLevelZeroPlugin):
        return booster.plugin.no_sync(model, optimizer)
    return booster.plugin.no_sync(ddp_model(model), optimizer)


def communication_note(plugin: str, gradient_accumulation_steps: int, world_size: int) -> str | None:
    """One line for the job log: a step's gradient communication under this plugin, or None
    when there is nothing to say (one process, or no accumulation)."""
    k = gradient_accumulation_steps
    if world_size <= 1 or k <= 1:
        return None
    if plugin in ("torch_ddp", "ddp"):
        return f"gradient accumulation: {k} micro-batches a step, gradients all-reduced once a step (DDP no_sync)"
    if plugin == "fsdp2":
        return (
            f"gradient accumulation: {k} micro-batches a step, gradients reduce-scattered once a step (FSDP2 "
            "set_requires_gradient_sync(False) before the last micro-batch); each rank holds the unsharded "
            "gradients meanwhile, and every micro-batch still all-gathers the parameters"
        )
    if plugin == LOW_LEVEL_ZERO_PLUGIN:
        return (
            f"gradient accumulation: {k} micro-batches a step, low_level_zero runs ZeRO stage 1 so that the "
            "gradients are all-reduced once a step (no_sync); stage 2 would reduce-scatter every micro-batch. "
            "Each rank holds the whole gradient in the working precision instead of 1/world_size of it"
        )
    return (
        f"gradient accumulation: {k} micro-batches a step, and gemini has no no_sync (Colossal-AI 0.5.0): every "
        f"micro-batch gathers the parameters and reduce-scatters the gradients, so a step communicates {k} times "
        "what one micro-batch does. Accumulation saves memory here, not communication; a larger "
        "train_batch_size, where it fits, communicates less"
    )


def ddp_model(model: Any) -> Any:
    """The TorchDDPModel inside the Booster's wrappers (AMP's TorchAMPModule wraps it for fp16)."""
    from colossalai.booster.plugin.torch_ddp_plugin import TorchDDPModel
    from colossalai.interface import ModelWrapper

    inner = model
    while not isinstance(inner, TorchDDPModel):
        if not isinstance(inner, ModelWrapper):
            raise TypeError(f"{type(model).__name__} wraps no TorchDDPModel: boost it with TorchDDPPlugin first")
        inner = inner.module
    return inner
