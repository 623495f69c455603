"""LoRA adapters: added to the denoiser as diffusers' LoRA examples add them, trained alone,
checkpointed alone, and written in diffusers' LoRA format.

Why not Colossal-AI's `Booster.enable_lora`: it wraps the model in a peft `PeftModel`, whose
state dict names every weight `base_model.model.<name>`, and diffusers' LoRA loaders
(`load_lora_weights`) read neither that nor peft's adapter folders for a UNet or SD3
transformer; for torch_ddp (`TorchDDPPlugin.enable_lora`) it does nothing besides that wrap. The
examples' way, `add_adapter` (peft's `inject_adapter_in_model`: the LoRA layers replace the
targeted Linear layers in place), keeps the denoiser's class, forward and names, and
`get_peft_model_state_dict` + `save_lora_weights` write what every diffusers pipeline loads.
Which plugins can train it: `sdflow_image.families.base.lora_plugin_refusal`.

With `train_text_encoder_lora` (SD, SDXL) the CLIP text encoders get adapters too, as the
examples' `--train_text_encoder` does. They run outside the boosted denoiser (the family encodes
the prompt before the denoiser's forward), so no DDP hook averages their gradients across
ranks: `TextEncoderAdapters.sync_gradients` does, once per optimizer step.

A checkpoint holds the trainable state only: the adapters' weights (`ADAPTER_FILE` for the
denoiser, `adapter_<text encoder>.safetensors`, under their module names) with the optimizer,
which only ever saw them.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from sdflow_image.families.base import Family, Parts

log = logging.getLogger("sdflow.train")

ADAPTER_FILE = "adapter.safetensors"  # in a checkpoint: the trainable weights by parameter name
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")  # the CLIP encoders that can take an adapter
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' name (save_lora_weights)


def describe(denoiser: Any, lora: bool) -> str:
    """The method and how many of the denoiser's parameters train, for the log."""
    trainable = sum(p.numel() for p in denoiser.parameters() if p.requires_grad)
    total = sum(p.numel() for p in denoiser.parameters())
    return f"method={'lora' if lora else 'full'} trainable parameters {trainable:,} of {total:,}"


def check_method(path: Path, trainer_state: dict[str, Any], lora: bool) -> None:
    """A checkpoint holds what its run trained: an adapter's cannot resume a full run, nor back."""
    from sdflow_image.training.checkpoints import CheckpointError

    method, saved = ("lora" if lora else "full"), trainer_state.get("training_method", "full")
    if saved != method:
        raise CheckpointError(
            f"{path.name} was saved by a training_method={saved} run, this one is {method}: resume with "
            f"training_method={saved}, or start afresh"
        )


def target_modules(args: argparse.Namespace, family: Family) -> list[str]:
    return list(args.lora_target_modules) or list(family.lora_targets)


def _config(args: argparse.Namespace, targets: list[str]) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        init_lora_weights="gaussian",
        target_modules=targets,
    )


def add_adapters(parts: Parts, args: argparse.Namespace, family: Family) -> dict[str, Any]:
    """Freeze the denoiser and add a trainable LoRA adapter to it, with the examples' settings
    (Gaussian init of A, zero B: the adapted model starts as the base); with
    `train_text_encoder_lora`, to the CLIP text encoders too. Returns those text encoders by name."""
    import torch

    denoiser = parts.denoiser
    denoiser.requires_grad_(False)
    try:
        denoiser.add_adapter(_config(args, target_modules(args, family)))
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"lora_target_modules: {exc}") from None
    encoders = {}
    if getattr(args, "train_text_encoder_lora", False):
        for name in TEXT_ENCODERS:
            encoder = getattr(parts, name)
            if encoder is not None:
                encoder.add_adapter(_config(args, list(family.text_encoder_lora_targets)))
                encoder.train()  # LoRA dropout; CLIP has no other dropout at its default 0.0
                encoders[name] = encoder
    # The adapters train in fp32 whatever the frozen weights' precision is on the GPU (the
    # examples' cast_training_params): AdamW's small updates vanish in bf16 weights.
    for module in (denoiser, *encoders.values()):
        for param in module.parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.float32)
    return encoders


class TextEncoderAdapters:
    """The text encoders' adapters: their parameters, gradient averaging, checkpoint files."""

    def __init__(self, encoders: dict[str, Any]) -> None:
        self.encoders = encoders

    def parameters(self) -> list[Any]:
        return [p for e in self.encoders.values() for p in e.parameters() if p.requires_grad]

    def sync_gradients(self, world_size: int) -> None:
        """Average the adapters' gradients over the ranks (what DDP does for the denoiser's)."""
        import torch.distributed as dist

        if world_size == 1:
            return
        for param in self.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad.div_(world_size)

    def broadcast(self) -> None:
        """Rank 0's adapter weights to every rank (a resume whose checkpoint only rank 0 holds)."""
        import torch.distributed as dist

        for param in self.parameters():
            dist.broadcast(param.data, src=0)

    def save(self, folder: Path) -> None:
        for name, encoder in self.encoders.items():
            save_trainable(encoder, folder / f"adapter_{name}.safetensors")

    def load(self, folder: Path) -> None:
        for name, encoder in self.encoders.items():
            load_trainable(encoder, folder / f"adapter_{name}.safetensors")


def trainable_state(module: Any) -> dict[str, Any]:
    """The weights that train (the adapter's), on the CPU, contiguous, by parameter name."""
    return {name: p.detach().cpu().contiguous() for name, p in module.named_parameters() if p.requires_grad}


def save_trainable(module: Any, path: Path) -> None:
    from safetensors.torch import save_file

    save_file(trainable_state(module), str(path))


def load_trainable(module: Any, path: Path) -> None:
    """Copy a checkpoint's adapter weights into `module`'s; every trainable weight must be there."""
    import torch
    from safetensors.torch import load_file

    from sdflow_image.training.checkpoints import CheckpointError

    if not path.is_file():
        raise CheckpointError(f"{path.parent.name} has no {path.name}: it was saved by another training_method")
    saved = load_file(str(path))
    params = {name: p for name, p in module.named_parameters() if p.requires_grad}
    if set(saved) != set(params):
        differ = sorted(set(saved) ^ set(params))[:5]
        raise CheckpointError(
            f"{path} holds another adapter than this run trains (e.g. {differ}): resume with the same "
            "lora_rank, lora_target_modules and model, or start afresh"
        )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(saved[name].to(param.dtype))


def diffusers_layers(family: Family, module: Any, rank: int, alpha: float) -> dict[str, Any]:
    """The denoiser's adapter as diffusers' save_lora_weights takes it, on the CPU, with the keys
    of the family's example (`lora_diffusers_keys`). diffusers 0.29 writes no alpha into the
    file and loads an adapter with alpha = rank (scale 1): the trained scale alpha / rank is
    folded into each B matrix here, so the loaded adapter computes what the trained one did."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    scale = alpha / rank
    layers = {  # in peft's names, where B is `lora_B` whatever the module
        name: (tensor.detach().float() * scale if scale != 1 and "lora_B" in name else tensor.detach())
        .cpu()
        .clone()
        .contiguous()
        for name, tensor in get_peft_model_state_dict(module).items()
    }
    return convert_state_dict_to_diffusers(layers) if family.lora_diffusers_keys else layers


def adapter_layers(family: Family, parts: Parts, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """save_lora_weights' keyword arguments: `<component>_lora_layers` of each adapted component."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = {f"{family.denoiser_name}_lora_layers": diffusers_layers(family, parts.denoiser, args.lora_rank,
                                                                      args.lora_alpha)}  # fmt: skip
    for name in TEXT_ENCODERS:
        encoder = getattr(parts, name)
        if encoder is not None and any(isinstance(m, BaseTunerLayer) for m in encoder.modules()):
            layers[f"{name}_lora_layers"] = diffusers_layers(family, encoder, args.lora_rank, args.lora_alpha)
    return layers


def save_adapter(family: Family, layers: dict[str, dict[str, Any]], out: Path) -> Path:
    """`out/pytorch_lora_weights.safetensors`, as the family's pipeline writes and loads it;
    `layers` as `adapter_layers` returns them."""
    out.mkdir(parents=True, exist_ok=True)
    family.pipeline_class().save_lora_weights(str(out), safe_serialization=True, **layers)
    path = out / LORA_WEIGHTS
    log.info("LoRA adapter: %s, %.2f MB", path, path.stat().st_size / 1e6)
    return path


def load_adapter(pipe: Any, folder: Path) -> None:
    """Load `folder`'s adapter onto `pipe` (its file named: offline, diffusers will not guess it)."""
    pipe.load_lora_weights(str(folder), weight_name=LORA_WEIGHTS)


def fuse(pipe: Any) -> None:
    """Merge the loaded adapter into the weights it adapts (W += scale * B @ A), as diffusers'
    fuse_lora does, for every family: 0.29's SD3 pipeline has no fuse_lora of its own."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name in ("unet", "transformer", "text_encoder", "text_encoder_2"):
        module = getattr(pipe, name, None)
        if module is None:
            continue
        for layer in module.modules():
            if isinstance(layer, BaseTunerLayer):
                layer.merge()
