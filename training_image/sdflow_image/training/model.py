"""The pipeline's parts as training uses them, the EMA, and SD's encode and loss: what every
backend trains with (the optimizers and wrappers are each backend's, sdflow_image.backends).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sdflow_image.families.base import (  # the pipeline's parts as training uses them
    LOADER_DTYPES,
    PartDtypes,
    Parts,
    diffusers_dtype,
    grad_if_training,
    transformers_dtype,
)


def load_parts(base: str, dtypes: PartDtypes = LOADER_DTYPES) -> Parts:
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    def sub(name: str) -> dict[str, Any]:
        return {"subfolder": name, "local_files_only": True}

    return Parts(
        tokenizer=CLIPTokenizer.from_pretrained(base, **sub("tokenizer")),
        text_encoder=CLIPTextModel.from_pretrained(
            base, **sub("text_encoder"), **transformers_dtype(dtypes.text_encoders)
        ),
        vae=AutoencoderKL.from_pretrained(base, **sub("vae"), **diffusers_dtype(dtypes.vae)),
        unet=UNet2DConditionModel.from_pretrained(base, **sub("unet"), **diffusers_dtype(dtypes.denoiser)),
        noise_scheduler=DDPMScheduler.from_pretrained(base, **sub("scheduler")),
    )


def precision_dtype(mixed_precision: str) -> Any:
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mixed_precision, torch.float32)


def part_dtypes(mixed_precision: str, *, lora: bool, vae_fp32: bool) -> PartDtypes:
    """The dtype each part loads in. What does not train runs in the training precision, loaded in
    it (diffusers' train_dreambooth_lora_flux2*.py load with `torch_dtype=weight_dtype`; the SD 3
    and SDXL scripts cast to it before moving): the text encoders, the VAE (fp32 where the family
    keeps it so: `vae_fp32`) and a LoRA run's base denoiser, whose adapter `lora.add_adapters`
    then makes fp32 (the examples' cast_training_params). A full run's denoiser loads in fp32:
    those are the master weights the optimizer updates (autocast or FSDP2's policy computes in
    the training precision). So a LoRA base never reaches the GPU in fp32 (Qwen-Image's 20.4 B
    parameters: 82 GB in fp32, 41 GB in bf16)."""
    import torch

    frozen = precision_dtype(mixed_precision)
    return PartDtypes(
        denoiser=frozen if lora else torch.float32,
        text_encoders=frozen,
        vae=torch.float32 if vae_fp32 else frozen,
    )


def prepare_parts(
    parts: Parts, *, mixed_precision: str, gradient_checkpointing: bool, device: Any, vae_fp32: bool = False
) -> None:
    """Freeze the VAE and the text encoders on `device`; the denoiser trains (the Booster moves it)."""
    import torch

    # Frozen parts run in the training precision (as diffusers' examples do), on the CPU as on a
    # GPU: one rule wherever the job runs, so the CPU tests see what a GPU run does (they were
    # loaded in it by `part_dtypes`; the cast here is for parts loaded otherwise).
    dtype = precision_dtype(mixed_precision)
    for frozen in (parts.vae, *parts.text_encoders):
        frozen.requires_grad_(False)
        frozen.eval()
        frozen.to(device, dtype=torch.float32 if vae_fp32 and frozen is parts.vae else dtype)
    if gradient_checkpointing:
        parts.denoiser.enable_gradient_checkpointing()
    parts.denoiser.train()


def make_ema(unet: Any, decay: float, device: Any) -> Any:
    """diffusers' EMAModel, with its `step` mended for transformers >= 4.46 (`EMAStep`)."""
    from diffusers.training_utils import EMAModel

    class EMA(EMAStep, EMAModel):
        pass

    ema = EMA(unet.parameters(), decay=decay, model_cls=type(unet), model_config=unet.config)
    ema.to(device)
    return ema


def restore_ema(ema: Any, ema_file: Path, parameters: Iterable[Any], device: Any) -> None:
    """Put a resumed run's EMA where make_ema puts a new one: on the training device, in fp32.

    The checkpoint's state is read on the CPU (it may come from another device) and must move:
    EMAModel.load_state_dict keeps the tensors where they were loaded, and the next step would
    mix a CPU average with CUDA weights. Without a saved state (use_ema turned on for the resumed
    run) the average restarts from the resumed weights, in fp32: the ZeRO plugins' working copy is
    fp16/bf16, too coarse to take a 0.9999 average's small updates."""
    import torch

    if ema_file.is_file():
        ema.load_state_dict(torch.load(ema_file, map_location="cpu", weights_only=False))
    else:
        ema.shadow_params = [p.detach().float().clone() for p in parameters]
    ema.to(device, dtype=torch.float32)


class EMAStep:
    """EMAModel.step of diffusers 0.29 without its DeepSpeed ZeRO-3 branch: that branch reads
    `transformers.deepspeed`, which transformers 4.46 removed (now transformers.integrations.deepspeed;
    huggingface/transformers#34582), so on Colossal-AI 0.5.0's own pins (diffusers 0.29.0,
    transformers 4.51.3) every EMA step raises AttributeError. No DeepSpeed here; same update."""

    def step(self: Any, parameters: Iterable[Any]) -> None:
        import torch

        parameters = list(parameters)
        self.optimization_step += 1
        decay = self.get_decay(self.optimization_step)
        self.cur_decay_value = decay
        trained = [(s, p) for s, p in zip(self.shadow_params, parameters, strict=True) if p.requires_grad]
        with torch.no_grad():
            for shadow, param in zip(self.shadow_params, parameters, strict=True):
                if not param.requires_grad:
                    shadow.copy_(param)
            # One fused update over every tensor (SD 1.5's UNet has ~700), not a Python loop of
            # three kernels each: shadow += (1 - decay) * (param - shadow). The ZeRO plugins'
            # working weights are fp16/bf16 while the average is fp32: cast them to it first.
            for group in _chunks(trained, EMA_CHUNK):
                shadows = [s for s, _ in group]
                torch._foreach_lerp_(shadows, [p.detach().to(s.dtype) for s, p in group], 1 - decay)


EMA_CHUNK = 64  # tensors per fused EMA update: bounds the fp32 copies of half-precision weights


def _chunks(items: list[Any], size: int) -> Iterable[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def encode_batch(
    batch: dict[str, Any], parts: Parts, device: Any, generator: Any, proportion_empty_prompts: float = 0.0
) -> tuple[Any, Any]:
    """Latents and text embeddings of a batch, through the frozen VAE and text encoder. With
    `proportion_empty_prompts`, that share of the captions (drawn from `generator`) is replaced
    by the empty prompt, so the UNet also learns the unconditional prediction that
    classifier-free guidance subtracts (diffusers' examples use the same flag name)."""
    import torch

    vae = parts.vae
    input_ids = batch["input_ids"].to(device, non_blocking=True)
    if proportion_empty_prompts > 0:
        tokenizer = parts.tokenizer
        empty = tokenizer(
            "", padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
        ).input_ids.to(device)
        dropped = torch.rand(input_ids.shape[0], generator=generator, device=device) < proportion_empty_prompts
        input_ids = torch.where(dropped[:, None], empty, input_ids)
    with torch.no_grad():
        pixels = batch["pixel_values"].to(device, dtype=vae.dtype, non_blocking=True)
        latents = vae.encode(pixels).latent_dist.sample(generator=generator) * vae.config.scaling_factor
    with grad_if_training(parts.text_encoder):
        hidden = parts.text_encoder(input_ids, return_dict=False)[0]
    return latents, hidden


def compute_loss(
    model: Any,
    noise_scheduler: Any,
    latents: Any,
    encoder_hidden_states: Any,
    generator: Any,
    noise_offset: float = 0.0,
    autocast: Any = None,
    snr_gamma: float = 0.0,
    added_cond_kwargs: dict[str, Any] | None = None,
) -> Any:
    """The epsilon (or v) prediction MSE of diffusers' text-to-image example (SDXL's passes the
    pooled embeddings and time ids as `added_cond_kwargs`, as train_text_to_image_sdxl.py); with `snr_gamma`,
    weighted by min(SNR, gamma) / SNR per sample (Min-SNR, Hang et al. 2023, as the example's
    --snr_gamma does): the nearly noise-free timesteps stop dominating the gradient, which
    speeds up learning of what the prompt decides at high noise (layout and colour)."""
    import torch
    import torch.nn.functional as F

    device = latents.device
    noise = torch.randn(latents.shape, generator=generator, device=device, dtype=latents.dtype)
    if noise_offset:
        offset_shape = (latents.shape[0], latents.shape[1], 1, 1)
        noise += noise_offset * torch.randn(offset_shape, generator=generator, device=device, dtype=latents.dtype)
    timesteps = torch.randint(
        0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],), generator=generator, device=device
    ).long()
    noisy = noise_scheduler.add_noise(latents, noise, timesteps)
    prediction_type = noise_scheduler.config.prediction_type
    if prediction_type == "epsilon":
        target = noise
    elif prediction_type == "v_prediction":
        target = noise_scheduler.get_velocity(latents, noise, timesteps)
    else:
        raise ValueError(f"unsupported prediction_type {prediction_type!r} in the base model's scheduler")
    dtype = next(model.parameters()).dtype
    ctx = torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    with ctx:
        extra = {}
        if added_cond_kwargs is not None:
            extra["added_cond_kwargs"] = {key: value.to(dtype) for key, value in added_cond_kwargs.items()}
        pred = model(noisy.to(dtype), timesteps, encoder_hidden_states.to(dtype), return_dict=False, **extra)[0]
    if not snr_gamma:
        return F.mse_loss(pred.float(), target.float(), reduction="mean")
    from diffusers.training_utils import compute_snr

    snr = compute_snr(noise_scheduler, timesteps)
    weights = torch.clamp(snr, max=snr_gamma) / (snr + 1 if prediction_type == "v_prediction" else snr)
    per_sample = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
    return (per_sample * weights).mean()
