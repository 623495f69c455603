"""SDXL: two CLIP text encoders (the second with a projection, whose pooled output joins the
time embedding) and a UNet conditioned on `add_time_ids`, each sample's original size, crop
corner and target size (diffusers 0.29's examples/text_to_image/train_text_to_image_sdxl.py and
train_text_to_image_lora_sdxl.py). The loss is SD's: epsilon or v-prediction, Min-SNR optional.

The original size is what img2dataset recorded of the image before it resized it
(`original_width`/`original_height` in each sample's json), the crop corner where the loader
cropped the resized image (sdflow_image.training.data); SDXL learned to draw a "full, uncropped" image
when asked for crop (0, 0) at inference, as the pipeline does by default."""

from __future__ import annotations

from typing import Any

from sdflow_image.families.base import (
    LOADER_DTYPES,
    Encoded,
    Family,
    PartDtypes,
    Parts,
    diffusers_dtype,
    grad_if_training,
    transformers_dtype,
)
from sdflow_image.families.sd import unet_loss


class StableDiffusionXL(Family):
    name = "sdxl"
    pipeline_class_name = "StableDiffusionXLPipeline"
    # SDXL's VAE overflows in fp16 (its config says force_upcast); the example keeps it in fp32
    # unless given a fixed fp16 VAE.
    vae_fp32 = True

    def load_parts(self, base: str, left_out: tuple[str, ...] = (), dtypes: PartDtypes = LOADER_DTYPES) -> Parts:
        from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

        def sub(name: str) -> dict[str, Any]:
            return {"subfolder": name, "local_files_only": True}

        text = transformers_dtype(dtypes.text_encoders)

        return Parts(
            tokenizer=CLIPTokenizer.from_pretrained(base, **sub("tokenizer")),
            text_encoder=CLIPTextModel.from_pretrained(base, **sub("text_encoder"), **text),
            tokenizer_2=CLIPTokenizer.from_pretrained(base, **sub("tokenizer_2")),
            text_encoder_2=CLIPTextModelWithProjection.from_pretrained(base, **sub("text_encoder_2"), **text),
            vae=AutoencoderKL.from_pretrained(base, **sub("vae"), **diffusers_dtype(dtypes.vae)),
            unet=UNet2DConditionModel.from_pretrained(base, **sub("unet"), **diffusers_dtype(dtypes.denoiser)),
            # The inference scheduler's betas read as DDPM's, as the example does.
            noise_scheduler=DDPMScheduler.from_pretrained(base, **sub("scheduler")),
        )

    def encode_batch(
        self, batch: dict[str, Any], parts: Parts, device: Any, generator: Any, proportion_empty_prompts: float
    ) -> Encoded:
        import torch

        ids = self.drop_prompts(batch, parts, device, generator, proportion_empty_prompts)
        vae = parts.vae
        with torch.no_grad():
            pixels = batch["pixel_values"].to(device, dtype=vae.dtype, non_blocking=True)
            latents = vae.encode(pixels).latent_dist.sample(generator=generator) * vae.config.scaling_factor
        with grad_if_training(parts.text_encoder, parts.text_encoder_2):
            hidden, pooled = [], None
            # The penultimate layer of each encoder, side by side; the pooled (projected) output of
            # the last one, as the pipeline's encode_prompt.
            for encoder, rows in zip((parts.text_encoder, parts.text_encoder_2), ids, strict=True):
                out = encoder(rows, output_hidden_states=True)
                pooled = out[0]
                hidden.append(out.hidden_states[-2])
        target = torch.tensor([pixels.shape[-2], pixels.shape[-1]], device=device)
        time_ids = torch.cat(
            [
                batch["original_size"].to(device),
                batch["crop_top_left"].to(device),
                target.expand(pixels.shape[0], 2),
            ],
            dim=1,
        ).float()
        return Encoded(latents, torch.cat(hidden, dim=-1), {"text_embeds": pooled, "time_ids": time_ids})

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
        return unet_loss(model, parts, encoded, generator, noise_offset, autocast, snr_gamma)


FAMILY = StableDiffusionXL()
