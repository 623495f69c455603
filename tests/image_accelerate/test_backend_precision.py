"""The precision each part of a run is in, where it matters on a GPU and a CPU test can see it:
the frozen parts (text encoders, VAE, a LoRA base) are in the training precision before they
move to the device, the LoRA adapter in fp32; SD 3's VAE encodes in fp32; FSDP2 gives SD 3.5's
transformer its timesteps in fp32. Tiny models built in code, one process (gloo) on the CPU."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sdflow_image.backends.accelerate import AccelerateBackend
from sdflow_image.training import loop, train

pytestmark = pytest.mark.image

RUN_HP = {"backend": "accelerate", "plugin": "ddp", "resolution": "32", "train_batch_size": "2", "seed": "0",
          "dataloader_num_workers": "0", "sd3_t5": "false"}  # fmt: skip


def run_args(base: Path, dataset: Path, **hp: str) -> Any:
    argv = ["--pretrained_model_name_or_path", str(base), "--dataset_dir", str(dataset)]
    return train.parse_args(argv, {**RUN_HP, **hp})


@contextlib.contextmanager
def trainer_of(args: Any) -> Iterator[loop.Trainer]:
    """A Trainer built as a job builds it (load, freeze, adapters, wrap), in a world of one."""
    import torch

    backend = AccelerateBackend(args)
    with backend.distributed(args.seed, cuda=False):
        yield loop.Trainer(args, torch.device("cpu"), backend)


def moved_to_a_device(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, set[Any], set[Any]]]:
    """Every Module.to of a whole model (a pipeline's part) that names a device, as (class, frozen
    parameters' dtypes, trainable ones'), recorded before the move: on a GPU, what crosses to the
    device is in these dtypes. (peft moves each new adapter layer to its base layer's device and
    dtype before the adapter is made fp32: that is on the host, the part not moved yet.)"""
    import torch
    from diffusers import ModelMixin
    from transformers import PreTrainedModel

    moves: list[tuple[str, set[Any], set[Any]]] = []
    to = torch.nn.Module.to

    def recording_to(self: Any, *args: Any, **kwargs: Any) -> Any:
        named = "device" in kwargs or any(isinstance(a, torch.device | str) for a in args)
        if named and isinstance(self, ModelMixin | PreTrainedModel):
            params = list(self.parameters())
            moves.append((
                type(self).__name__,
                {p.dtype for p in params if not p.requires_grad},
                {p.dtype for p in params if p.requires_grad},
            ))  # fmt: skip
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", recording_to)
    return moves


def test_trainer_lora_bf16_frozen_parts_are_bf16_before_they_reach_the_device_and_the_adapter_fp32(
    bases: Callable[[str], Path], dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    args = run_args(bases("flux2"), dataset, training_method="lora", mixed_precision="bf16", lora_rank="4")
    moves = moved_to_a_device(monkeypatch)
    with trainer_of(args) as trainer:
        denoiser = trainer.parts.denoiser
        frozen_after = {p.dtype for p in denoiser.parameters() if not p.requires_grad}
        trained_after = {p.dtype for p in denoiser.parameters() if p.requires_grad}
    moved = {name for name, _, _ in moves}
    assert {"Flux2Transformer2DModel", "Qwen3ForCausalLM", "AutoencoderKLFlux2"} <= moved, moved
    for name, frozen, trained in moves:
        assert frozen <= {torch.bfloat16}, f"{name} moved with frozen weights in {frozen}"
        assert trained <= {torch.float32}, f"{name} moved with trainable weights in {trained}"
    assert (frozen_after, trained_after) == ({torch.bfloat16}, {torch.float32})


def test_trainer_sd35_bf16_vae_encodes_in_fp32_beside_bf16_text_encoders(
    bases: Callable[[str], Path], dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    args = run_args(bases("sd35"), dataset, training_method="lora", mixed_precision="bf16", lora_rank="4")
    with trainer_of(args) as trainer:
        parts = trainer.parts
        assert {p.dtype for e in parts.text_encoders for p in e.parameters()} == {torch.bfloat16}
        assert {p.dtype for p in parts.vae.parameters()} == {torch.float32}
        seen: list[Any] = []
        parts.vae.encoder.register_forward_pre_hook(lambda _m, inputs: seen.append(inputs[0].dtype))
        ids = trainer.family.caption_ids(parts)("a red square")
        batch = {"pixel_values": torch.zeros(1, 3, 32, 32), **{k: v[None] for k, v in ids.items()}}
        encoded = trainer.family.encode_batch(batch, parts, torch.device("cpu"), torch.Generator(), 0.0)
    assert seen == [torch.float32]
    assert encoded.latents.dtype == torch.float32


def test_fsdp2_bf16_sd35_transformer_embeds_fp32_timesteps_and_computes_its_blocks_in_bf16(
    bases: Callable[[str], Path], dataset: Path
) -> None:
    import torch

    args = run_args(bases("sd35"), dataset, plugin="fsdp2", mixed_precision="bf16")
    with trainer_of(args) as trainer:
        parts, family, model = trainer.parts, trainer.family, trainer.backend.model
        timesteps: list[Any] = []
        blocks: list[Any] = []
        model.time_text_embed.register_forward_pre_hook(lambda _m, inputs: timesteps.append(inputs[0]))
        model.transformer_blocks[0].register_forward_pre_hook(
            lambda _m, args, kwargs: blocks.append(kwargs["hidden_states"].dtype), with_kwargs=True
        )
        ids = family.caption_ids(parts)("a red square")
        batch = {"pixel_values": torch.zeros(2, 3, 32, 32), **{k: torch.stack([v, v]) for k, v in ids.items()}}
        encoded = family.encode_batch(batch, parts, torch.device("cpu"), torch.Generator().manual_seed(0), 0.0)
        loss = family.compute_loss(model, parts, encoded, torch.Generator().manual_seed(1))
    assert torch.isfinite(loss)
    [seen] = timesteps
    assert seen.dtype == torch.float32, "FSDP2 cast the timesteps to bf16 (steps of 4 near 1000)"
    assert torch.isin(seen, parts.noise_scheduler.timesteps).all(), "the schedule's own values, unrounded"
    assert blocks == [torch.bfloat16]
