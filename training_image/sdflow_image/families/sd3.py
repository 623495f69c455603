"""Stable Diffusion 3: two CLIP text encoders with projections and T5 (optional: a base model
saved without it, `text_encoder_3: [null, null]`, conditions on zeros in its place, as the SD3
pipeline does), a `SD3Transformer2DModel` trained on the rectified-flow loss.

The loss is diffusers 0.29.0's examples/dreambooth/train_dreambooth_sd3.py (and its LoRA
twin): a uniformly drawn index into `FlowMatchEulerDiscreteScheduler`'s training timesteps and
the sigma there, the noisy input `sigma * noise + (1 - sigma) * x0`, the transformer's output
preconditioned back to x0 (`pred * -sigma + noisy`, EDM section 5), and the squared error to x0
weighted by `sigma ** -2` (the script's default `weighting_scheme=sigma_sqrt`). One change:
the latents are shifted by the VAE's `shift_factor` before scaling, as the SD3 pipeline undoes
when it decodes (0.29.0's script leaves the shift out; later diffusers releases add it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sdflow_image.families.base import (
    LOADER_DTYPES,
    CaptionIds,
    Encoded,
    Family,
    PartDtypes,
    Parts,
    diffusers_dtype,
    transformers_dtype,
)


class StableDiffusion3(Family):
    name = "sd3"
    resolution_multiple = 16  # VAE factor 8 x the transformer's 2x2 latent patch
    pipeline_class_name = "StableDiffusion3Pipeline"
    denoiser_name = "transformer"
    denoiser_class_name = "SD3Transformer2DModel"
    text_encoder_lora = False  # diffusers 0.29's SD3LoraLoaderMixin saves and loads the transformer's only
    lora_diffusers_keys = False
    # train_dreambooth_sd3.py and train_dreambooth_lora_sd3.py (0.29 and 0.42 alike) keep the VAE in
    # fp32 (`vae.to(accelerator.device, dtype=torch.float32)`) while the text encoders run in
    # weight_dtype: its latents are what the transformer learns to produce.
    vae_fp32 = True

    def left_out(self, args: Any) -> tuple[str, ...]:
        # T5-XXL is 4.7B of SD3 Medium's ~7B parameters: without it training and serving fit in
        # far less memory, at some cost to long prompts (the SD3 paper, section 5.3.2). A base
        # saved without it (`text_encoder_3: [null, null]`) trains without it whatever sd3_t5
        # says (load_parts), so it is left out of every pipeline built from it too: diffusers
        # refuses to load such a folder unless the missing parts are passed as None.
        base = getattr(args, "pretrained_model_name_or_path", None)
        without_t5 = base is not None and not (Path(base) / "text_encoder_3").is_dir()
        return ("text_encoder_3", "tokenizer_3") if without_t5 or not getattr(args, "sd3_t5", True) else ()

    def load_parts(self, base: str, left_out: tuple[str, ...] = (), dtypes: PartDtypes = LOADER_DTYPES) -> Parts:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
        from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

        def sub(name: str) -> dict[str, Any]:
            return {"subfolder": name, "local_files_only": True}

        with_t5 = (Path(base) / "text_encoder_3").is_dir() and "text_encoder_3" not in left_out
        text = transformers_dtype(dtypes.text_encoders)
        return Parts(
            tokenizer=CLIPTokenizer.from_pretrained(base, **sub("tokenizer")),
            text_encoder=CLIPTextModelWithProjection.from_pretrained(base, **sub("text_encoder"), **text),
            tokenizer_2=CLIPTokenizer.from_pretrained(base, **sub("tokenizer_2")),
            text_encoder_2=CLIPTextModelWithProjection.from_pretrained(base, **sub("text_encoder_2"), **text),
            tokenizer_3=T5TokenizerFast.from_pretrained(base, **sub("tokenizer_3")) if with_t5 else None,
            text_encoder_3=T5EncoderModel.from_pretrained(base, **sub("text_encoder_3"), **text) if with_t5 else None,
            vae=AutoencoderKL.from_pretrained(base, **sub("vae"), **diffusers_dtype(dtypes.vae)),
            unet=None,
            transformer=SD3Transformer2DModel.from_pretrained(
                base, **sub("transformer"), **diffusers_dtype(dtypes.denoiser)
            ),
            noise_scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(base, **sub("scheduler")),
        )

    def caption_ids(self, parts: Parts) -> Callable[[str], dict[str, Any]]:
        # T5 reads as many tokens as CLIP does: the pipeline's tokenizer_max_length for all three.
        tokenizers = self.tokenizers(parts)
        return CaptionIds(tokenizers, [int(parts.tokenizer.model_max_length)] * len(tokenizers))

    def encode_batch(
        self, batch: dict[str, Any], parts: Parts, device: Any, generator: Any, proportion_empty_prompts: float
    ) -> Encoded:
        import torch

        ids = self.drop_prompts(batch, parts, device, generator, proportion_empty_prompts)
        vae = parts.vae
        with torch.no_grad():
            pixels = batch["pixel_values"].to(device, dtype=vae.dtype, non_blocking=True)
            latents = self.scale_latents(vae.encode(pixels).latent_dist.sample(generator=generator), vae)
        hidden, pooled = self.encode_prompts(ids, parts)
        return Encoded(latents, hidden, {"pooled": pooled})

    @staticmethod
    def scale_latents(latents: Any, vae: Any) -> Any:
        """A posterior sample → the transformer's latents: the VAE's shift and scale."""
        return (latents - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor

    def encode_prompts(self, ids: list[Any], parts: Parts) -> tuple[Any, Any]:
        """Each tokenizer's ids → (the CLIP and T5 embeddings side by side, the pooled CLIP
        embeddings); each row on its own (no row reads another)."""
        import torch
        import torch.nn.functional as F

        with torch.no_grad():
            hidden, pooled = [], []
            for encoder, rows in zip((parts.text_encoder, parts.text_encoder_2), ids[:2], strict=True):
                out = encoder(rows, output_hidden_states=True)
                pooled.append(out[0])
                hidden.append(out.hidden_states[-2])
            clip = torch.cat(hidden, dim=-1)
            if parts.text_encoder_3 is not None:
                t5 = parts.text_encoder_3(ids[2])[0]
            else:
                width = parts.transformer.config.joint_attention_dim
                t5 = torch.zeros((clip.shape[0], clip.shape[1], width), device=clip.device, dtype=clip.dtype)
        clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5.to(clip.dtype)], dim=-2), torch.cat(pooled, dim=-1)

    def sample_timesteps(self, scheduler: Any, batch: int, device: Any, generator: Any) -> tuple[Any, Any]:
        """(timesteps, sigmas): a uniform index into the training schedule (0.29's script). The
        schedule's timesteps and sigmas are aligned arrays: the script's get_sigmas looks each
        timestep up again to find the same index."""
        import torch

        indices = torch.randint(0, scheduler.config.num_train_timesteps, (batch,), generator=generator, device=device)
        return scheduler.timesteps.to(device)[indices], scheduler.sigmas.to(device)[indices]

    def loss_weighting(self, sigmas: Any) -> Any:
        """0.29's default `weighting_scheme=sigma_sqrt`: sigma ** -2."""
        return sigmas**-2.0

    def compute_loss(
        self,
        model: Any,
        parts: Parts,
        encoded: Encoded,
        generator: Any,
        *,
        noise_offset: float = 0.0,
        autocast: Any = None,
        snr_gamma: float = 0.0,
    ) -> Any:
        import torch

        if noise_offset or snr_gamma:
            raise ValueError("noise_offset and snr_gamma belong to the DDPM loss; SD3 trains on rectified flow")
        latents = encoded.latents
        device, batch = latents.device, latents.shape[0]
        scheduler = parts.noise_scheduler
        noise = torch.randn(latents.shape, generator=generator, device=device, dtype=latents.dtype)
        timesteps, sigmas = self.sample_timesteps(scheduler, batch, device, generator)
        sigmas = sigmas.to(latents.dtype).reshape(batch, 1, 1, 1)
        noisy = sigmas * noise + (1.0 - sigmas) * latents
        dtype = next(model.parameters()).dtype
        ctx = torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext()
        with ctx:
            pred = model(
                hidden_states=noisy.to(dtype),
                timestep=timesteps,
                encoder_hidden_states=encoded.hidden.to(dtype),
                pooled_projections=encoded.extra["pooled"].to(dtype),
                return_dict=False,
            )[0]
        pred = pred.float() * (-sigmas) + noisy.float()
        weighting = self.loss_weighting(sigmas.float())
        per_sample = (weighting * (pred - latents.float()) ** 2).reshape(batch, -1).mean(dim=1)
        return per_sample.mean()


FAMILY = StableDiffusion3()
