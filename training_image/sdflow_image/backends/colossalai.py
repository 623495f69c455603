"""The colossalai backend: one Colossal-AI 0.5.0 Booster for every plugin (torch_ddp,
low_level_zero, gemini), the optimizer and Booster each plugin needs, behind
`sdflow_image.backends.base.Backend`.

Each plugin wants its own optimizer (Colossal-AI 0.5.0, read from its source):
- gemini: `GeminiOptimizer` asserts `type(optim) in {FusedAdam, CPUAdam, HybridAdam}`
  (colossalai/zero/gemini/gemini_optimizer.py, `_AVAIL_OPTIM_LIST`): HybridAdam, as Colossal-AI's
  own diffusion examples use, which updates CUDA parameters with its fused kernel and offloaded
  ones with its CPU kernel.
- low_level_zero: any torch optimizer; HybridAdam as in Colossal-AI's examples (fused kernel).
- torch_ddp: `torch.optim.AdamW`, the optimizer of diffusers' text-to-image example.
HybridAdam's constructor loads the CPU Adam kernel, which on x86 is built as a CUDA extension:
on a machine without CUDA it raises "No usable kernel found for CPUAdamLoader".

torch_ddp with fp16: the Booster wraps the DDP model in its AMP module (TorchAMPModule), and
TorchDDPPlugin.no_sync asserts a TorchDDPModel ("Model is not boosted by TorchDDPPlugin."):
`ddp_model` (training/accumulation.py) finds the DDP model inside the wrappers, for its no_sync.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from sdflow_image.backends.base import Backend, adam_kwargs, schedule, torchrun_environment, trainable
from sdflow_image.training import accumulation, checkpoints, precision_state
from sdflow_image.training.kernels import ADAM_PLUGINS  # plugins that get Colossal-AI's HybridAdam

LR_SCHEDULER_FILE = "lr_scheduler.pt"


def optimizer_class(plugin: str) -> type:
    """The optimizer class `plugin` needs (see the module docstring); imports HybridAdam lazily."""
    if plugin in ADAM_PLUGINS:
        from colossalai.nn.optimizer import HybridAdam

        return HybridAdam
    if plugin == "torch_ddp":
        import torch

        return torch.optim.AdamW
    raise ValueError(f"plugin={plugin!r} is not one of torch_ddp, low_level_zero, gemini")


def build_optimizer(
    plugin: str,
    params: Iterable[Any],
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    eps: float,
) -> Any:
    """AdamW for `plugin`: HybridAdam (decoupled weight decay, adamw_mode) or torch's AdamW."""
    cls = optimizer_class(plugin)
    kwargs: dict[str, Any] = {"lr": lr, "betas": betas, "weight_decay": weight_decay, "eps": eps}
    if plugin in ADAM_PLUGINS:
        kwargs["adamw_mode"] = True  # HybridAdam's default, said out loud: AdamW, not Adam + L2
    return cls(params, **kwargs)


def make_plugin(
    plugin: str, mixed_precision: str, *, max_grad_norm: float, gradient_accumulation_steps: int = 1
) -> Any:
    """The Colossal-AI plugin object (needs an initialised process group)."""
    precision = "fp32" if mixed_precision == "no" else mixed_precision
    if plugin == "torch_ddp":
        from colossalai.booster.plugin import TorchDDPPlugin

        return TorchDDPPlugin()
    if plugin == "low_level_zero":
        from colossalai.booster.plugin import LowLevelZeroPlugin

        # Stage 1 when accumulating, so that no_sync can skip the micro-batches' reduction
        # (stage 2 has none): training/accumulation.py.
        stage = accumulation.low_level_zero_stage(gradient_accumulation_steps)
        return LowLevelZeroPlugin(stage=stage, precision=precision, max_norm=max_grad_norm)
    if plugin == "gemini":
        from colossalai.booster.plugin import GeminiPlugin

        if precision == "fp32":
            raise ValueError("plugin=gemini trains in fp16 or bf16: set mixed_precision to fp16 or bf16")
        return GeminiPlugin(
            precision=precision,
            placement_policy="static",
            max_norm=max_grad_norm,
            enable_gradient_accumulation=gradient_accumulation_steps > 1,
        )
    raise ValueError(f"plugin={plugin!r} is not one of torch_ddp, low_level_zero, gemini")


def make_booster(
    plugin: str, mixed_precision: str, *, max_grad_norm: float, gradient_accumulation_steps: int = 1
) -> Any:
    """The Booster for `plugin`. torch_ddp: the Booster's fp16 is torch AMP with a grad scaler;
    its bf16 is a stub in 0.5.0, so bf16 is plain autocast in the loop (`autocast_dtype`) and
    clipping is the loop's (`optimizer.clip_grad_by_norm`). The ZeRO plugins own precision and clipping."""
    from colossalai.booster import Booster

    built = make_plugin(
        plugin, mixed_precision, max_grad_norm=max_grad_norm, gradient_accumulation_steps=gradient_accumulation_steps
    )
    if plugin == "torch_ddp":
        return Booster(plugin=built, mixed_precision="fp16" if mixed_precision == "fp16" else None)
    return Booster(plugin=built)


def autocast_dtype(plugin: str, mixed_precision: str) -> Any:
    """The dtype the loop autocasts the UNet's forward to itself, or None (see make_booster)."""
    import torch

    return torch.bfloat16 if plugin == "torch_ddp" and mixed_precision == "bf16" else None


def loop_clips_gradients(plugin: str, max_grad_norm: float) -> bool:
    return plugin == "torch_ddp" and max_grad_norm > 0


class ColossalAIBackend(Backend):
    """Checkpoints: the Booster's model and optimizer files (sharded under the ZeRO plugins, each
    rank its shard; one file of replicated state under torch_ddp), its schedule file, and what
    training/precision_state.py adds (loss scaler; low_level_zero's fp32 masters)."""

    name = "colossalai"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.booster: Any = None
        self.replicated = args.plugin == "torch_ddp"

    @contextlib.contextmanager
    def distributed(self, seed: int, cuda: bool) -> Iterator[None]:
        import colossalai

        with torchrun_environment():
            colossalai.launch_from_torch(backend="nccl" if cuda else "gloo", seed=seed, verbose=False)
            yield

    def _wrap(self, denoiser: Any, extra_params: list[Any], device: Any) -> None:
        args = self.args
        optimizer = build_optimizer(args.plugin, trainable(denoiser, extra_params), **adam_kwargs(args))
        lr_scheduler = schedule(args, optimizer)
        self.booster = make_booster(
            args.plugin,
            args.mixed_precision,
            max_grad_norm=args.max_grad_norm,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
        )
        self.model, self.optimizer, _, _, self.lr_scheduler = self.booster.boost(
            denoiser, optimizer, lr_scheduler=lr_scheduler
        )
        self.autocast_dtype = autocast_dtype(args.plugin, args.mixed_precision)

    def backward(self, loss: Any) -> None:
        self.booster.backward(loss, self.optimizer)

    def skips_sync(self, gradient_accumulation_steps: int, world_size: int) -> bool:
        return accumulation.skips_sync(self.args.plugin, gradient_accumulation_steps, world_size)

    def no_sync(self, skip: bool) -> contextlib.AbstractContextManager[Any]:
        return accumulation.no_sync(self.booster, self.model, self.optimizer, skip=skip)

    def step(self) -> None:
        if loop_clips_gradients(self.args.plugin, self.args.max_grad_norm):
            self.optimizer.clip_grad_by_norm(self.args.max_grad_norm)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad()

    def save(self, folder: Path, *, model: bool, rank: int) -> None:
        booster, plugin = self.booster, self.args.plugin
        if model:
            booster.save_model(self.model, str(folder / self.denoiser_name), shard=True, use_safetensors=True)
        if plugin == "torch_ddp":
            # Replicated state gains nothing from sharding, and colossalai 0.5.0's sharded
            # optimizer load calls an accelerator synchronize that the CPU accelerator lacks.
            booster.save_optimizer(self.optimizer, str(folder / checkpoints.OPTIMIZER_FILE), shard=False)
        else:
            booster.save_optimizer(self.optimizer, str(folder / "optimizer"), shard=True)
        if rank == 0 or not self.replicated:
            precision_state.save(folder, plugin, self.optimizer, self.model.parameters(), self._state_rank(rank))
        if rank == 0:
            booster.save_lr_scheduler(self.lr_scheduler, str(folder / LR_SCHEDULER_FILE))

    def load(self, folder: Path, *, model: bool, rank: int) -> None:
        booster = self.booster
        if model:
            booster.load_model(self.model, str(folder / self.denoiser_name))
        optimizer_file = folder / checkpoints.OPTIMIZER_FILE
        booster.load_optimizer(
            self.optimizer, str(optimizer_file if optimizer_file.is_file() else folder / "optimizer")
        )
        booster.load_lr_scheduler(self.lr_scheduler, str(folder / LR_SCHEDULER_FILE))
        precision_state.load(folder, self.args.plugin, self.optimizer, self.model.parameters(), self._state_rank(rank))

    def _state_rank(self, rank: int) -> int:
        """Whose loss scaler and masters files this rank reads and writes: its own under the ZeRO
        plugins (each holds a shard), rank 0's under torch_ddp (replicated)."""
        return 0 if self.replicated else rank

    def export(self, path: Path, rank: int) -> None:
        self.booster.save_model(self.model, str(path), shard=False, use_safetensors=True)

    def release(self) -> None:
        super().release()
        self.booster = None
