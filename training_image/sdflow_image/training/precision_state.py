"""What a checkpoint holds besides Colossal-AI's own model and optimizer files, so that a resumed
run continues exactly where it stopped: the fp16 loss scaler, and low_level_zero's fp32 masters.

Read in Colossal-AI 0.5.0's source, and measured on an H100 (README, GPU acceptance):
- low_level_zero saves the module's working weights (fp16/bf16) and, on load,
  `update_master_params` copies them over the fp32 masters (zero/low_level/low_level_optim.py);
  its optimizer state_dict holds Adam's moments only. A resumed bf16 run drifted from the
  uninterrupted one from its first step (loss 1.8e-2, weights 1.7e-3 apart after two steps).
  Each rank keeps its shard of the masters (`get_working_to_master_map`): saved per rank here
  and copied back after Colossal-AI's load.
- No plugin saves its loss scaler: torch_ddp's AMP optimizer has a torch GradScaler (`scaler`),
  low_level_zero and gemini a DynamicGradScaler in their mixed-precision mixin. A resumed fp16
  run started again at 2**16 and skipped steps to find its scale while the schedule moved on.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sdflow_image.training.checkpoints import CheckpointError

# Where each plugin's optimizer keeps its scaler (torch_ddp fp16, low_level_zero, gemini).
SCALER_PATHS = (("scaler",), ("mixed_precision_mixin", "grad_scaler"), ("mix_precision_mixin", "grad_scaler"))
# DynamicGradScaler's counters, which its state_dict leaves out.
SCALER_COUNTERS = ("_growth_step", "_hysteresis_step")
MASTERS_PLUGINS = ("low_level_zero",)


def scaler_file(rank: int) -> str:
    return f"loss_scaler_rank{rank}.pt"


def masters_file(rank: int) -> str:
    return f"zero_masters_rank{rank}.pt"


def loss_scaler(optimizer: Any) -> Any | None:
    """The boosted optimizer's loss scaler, or None (bf16 and fp32 have none)."""
    for path in SCALER_PATHS:
        found = optimizer
        for name in path:
            found = getattr(found, name, None)
        if found is not None and callable(getattr(found, "state_dict", None)):
            return found
    return None


def scaler_state(scaler: Any) -> dict[str, Any]:
    state = dict(scaler.state_dict())
    state.update({name: getattr(scaler, name) for name in SCALER_COUNTERS if hasattr(scaler, name)})
    return state


def restore_scaler(scaler: Any, state: dict[str, Any]) -> None:
    state = dict(state)
    counters = {name: state.pop(name) for name in SCALER_COUNTERS if name in state}
    scaler.load_state_dict(state)
    for name, value in counters.items():
        setattr(scaler, name, value)


def master_shards(optimizer: Any, parameters: Iterable[Any]) -> list[Any]:
    """This rank's fp32 master shards, in the model's parameter order, on the CPU."""
    masters = optimizer.get_working_to_master_map()
    return [masters[id(p)].detach().cpu() for p in parameters if id(p) in masters]


def restore_master_shards(optimizer: Any, parameters: Iterable[Any], saved: list[Any]) -> None:
    import torch

    masters = optimizer.get_working_to_master_map()
    targets = [masters[id(p)] for p in parameters if id(p) in masters]
    shapes = [tuple(t.shape) for t in targets], [tuple(s.shape) for s in saved]
    if shapes[0] != shapes[1]:
        raise CheckpointError(
            f"the checkpoint's fp32 master weights ({len(saved)} shards) do not match this run's "
            f"({len(targets)}): it was saved by another model or number of processes; resume with the same ones"
        )
    with torch.no_grad():
        for target, value in zip(targets, saved, strict=True):
            target.copy_(value)


def save(folder: Path, plugin: str, optimizer: Any, parameters: Iterable[Any], rank: int) -> None:
    """This rank's part (every rank calls it)."""
    import torch

    scaler = loss_scaler(optimizer)
    if scaler is not None:
        torch.save(scaler_state(scaler), folder / scaler_file(rank))
    if plugin in MASTERS_PLUGINS:
        torch.save(master_shards(optimizer, parameters), folder / masters_file(rank))


def load(folder: Path, plugin: str, optimizer: Any, parameters: Iterable[Any], rank: int) -> None:
    """After Colossal-AI's load_model and load_optimizer. A checkpoint from before these files
    existed loads as it did (and resumes as inexactly)."""
    import torch

    scaler, scaler_path = loss_scaler(optimizer), folder / scaler_file(rank)
    if scaler is not None and scaler_path.is_file():
        restore_scaler(scaler, torch.load(scaler_path, map_location="cpu", weights_only=False))
    masters_path = folder / masters_file(rank)
    if plugin in MASTERS_PLUGINS and masters_path.is_file():
        restore_master_shards(optimizer, parameters, torch.load(masters_path, map_location="cpu", weights_only=True))
