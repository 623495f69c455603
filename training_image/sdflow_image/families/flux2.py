"""FLUX.2 [klein] (4B and 9B, distilled or base): a Qwen3 causal LM as the text encoder, the
`AutoencoderKLFlux2` VAE whose latents are patchified 2x2 and normalised by its batch-norm
statistics, and a `Flux2Transformer2DModel` trained on the flow-matching loss.

After diffusers 0.42.1's examples/dreambooth/train_dreambooth_lora_flux2_klein.py and the
`Flux2KleinPipeline` it trains for:
- the prompt: the pipeline's `_get_qwen3_prompt_embeds`: the caption as a user turn of the
  tokenizer's chat template (generation prompt added, thinking off), padded to 512 tokens, and the
  hidden states of layers 9, 18 and 27 side by side per token (`Flux2KleinPipeline.encode_prompt`'s
  default). The script's own default is layers 10, 20, 30 (copied from its FLUX.2 [dev] twin, whose
  Mistral encoder reads those); the pipeline, which serves the model, reads 9, 18, 27, so training
  does too. The transformer attends to every one of the 512 positions (it takes no mask), so the
  length is the pipeline's, not the caption's.
- the latents: the VAE posterior's mode (the script's `latent_dist.mode()`), `_patchify_latents`,
  then `(x - bn.running_mean) / sqrt(bn.running_var + batch_norm_eps)`, which the pipeline undoes
  before decoding;
- the loss: a uniform draw on the training schedule (`weighting_scheme=none`), the noisy input
  `(1 - sigma) * x0 + sigma * noise` packed to tokens (`_pack_latents`) with `_prepare_latent_ids`
  positions, the timestep / 1000, and the squared error of the unpacked prediction to
  `noise - x0`, weighted 1;
- guidance: klein's transformer has no guidance embedding (`guidance_embeds: false`); the distilled
  and base variants differ only in the pipeline's `is_distilled`, which turns off classifier-free
  guidance at inference. Training is the same for both (the README trains with
  `--guidance_scale=1`); a transformer that does embed guidance is given `GUIDANCE_SCALE`, as the
  script does.
- LoRA: the script's targets, the double blocks' attention projections and the single blocks'
  fused `to_qkv_mlp_proj` and `attn.to_out` (each single block named: their `attn.to_out` is a
  Linear, the double blocks' a ModuleList that peft cannot adapt).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from sdflow_image.families import flow
from sdflow_image.families.base import (
    LOADER_DTYPES,
    Encoded,
    Family,
    PartDtypes,
    Parts,
    diffusers_dtype,
    second_stack,
    transformers_dtype,
)

MAX_SEQUENCE_LENGTH = 512  # Flux2KleinPipeline's max_sequence_length default
TEXT_ENCODER_OUT_LAYERS = (9, 18, 27)  # Flux2KleinPipeline.encode_prompt's text_encoder_out_layers
GUIDANCE_SCALE = 1.0  # README_flux2.md's klein commands (--guidance_scale=1)
SINGLE_BLOCKS = 48  # more than any FLUX.2 transformer has (klein 4B 20, 9B 24, dev 48)
CAPTION_KEYS = ("input_ids", "attention_mask")


def text_ids(hidden: Any) -> dict[str, Any]:
    """{"text_ids"}: the prompt tokens' positions, which depend on the embeddings' shape alone."""
    new_diffusers = second_stack("diffusers")
    return {"text_ids": new_diffusers.Flux2KleinPipeline._prepare_text_ids(hidden).to(hidden.device)}


class Flux2Captions:
    """Picklable caption → {"input_ids", "attention_mask"} as the pipeline tokenizes a prompt."""

    def __init__(self, tokenizer: Any, length: int) -> None:
        self.tokenizer, self.length = tokenizer, length

    def __call__(self, caption: str) -> dict[str, Any]:
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": caption}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        out = self.tokenizer(text, return_tensors="pt", padding="max_length", truncation=True, max_length=self.length)
        return {key: out[key][0] for key in CAPTION_KEYS}


class Flux2Klein(Family):
    name = "flux2"
    resolution_multiple = 16  # VAE factor 8 x the transformer's 2x2 latent patch
    pipeline_class_name = "Flux2KleinPipeline"
    denoiser_name = "transformer"
    denoiser_class_name = "Flux2Transformer2DModel"
    lora_targets = (
        "to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj",
        *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(SINGLE_BLOCKS)),
    )  # fmt: skip
    text_encoder_lora = False  # Flux2LoraLoaderMixin loads the transformer's adapter only
    lora_diffusers_keys = False  # the script saves get_peft_model_state_dict's names

    def load_parts(self, base: str, left_out: tuple[str, ...] = (), dtypes: PartDtypes = LOADER_DTYPES) -> Parts:
        from diffusers import FlowMatchEulerDiscreteScheduler

        new_diffusers = second_stack("diffusers")
        from transformers import AutoTokenizer

        new_transformers = second_stack("transformers")

        def sub(name: str) -> dict[str, Any]:
            return {"subfolder": name, "local_files_only": True}

        return Parts(
            tokenizer=AutoTokenizer.from_pretrained(base, **sub("tokenizer")),
            text_encoder=new_transformers.Qwen3ForCausalLM.from_pretrained(
                base, **sub("text_encoder"), **transformers_dtype(dtypes.text_encoders)
            ),
            vae=new_diffusers.AutoencoderKLFlux2.from_pretrained(base, **sub("vae"), **diffusers_dtype(dtypes.vae)),
            unet=None,
            transformer=new_diffusers.Flux2Transformer2DModel.from_pretrained(
                base, **sub("transformer"), **diffusers_dtype(dtypes.denoiser)
            ),
            noise_scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(base, **sub("scheduler")),
        )

    def caption_ids(self, parts: Parts) -> Callable[[str], dict[str, Any]]:
        return Flux2Captions(parts.tokenizer, MAX_SEQUENCE_LENGTH)

    def call_kwargs(self, pipe: Any, prompt: Any, negative_prompt: Any, guidance_scale: float) -> dict[str, Any]:
        # Flux2KleinPipeline takes no negative prompt, only its embeddings (it guides against the
        # empty prompt's by default); it guides at all only where the model is not distilled.
        kwargs: dict[str, Any] = {"prompt": prompt, "guidance_scale": guidance_scale}
        if negative_prompt and guidance_scale > 1 and not pipe.config.is_distilled:
            batch = len(prompt) if isinstance(prompt, list) else 1
            embeds, _ = pipe.encode_prompt([negative_prompt] * batch, device=pipe._execution_device)
            kwargs["negative_prompt_embeds"] = embeds
        return kwargs

    def encode_batch(
        self, batch: dict[str, Any], parts: Parts, device: Any, generator: Any, proportion_empty_prompts: float
    ) -> Encoded:
        empty = self.caption_ids(parts)("")
        rows = flow.drop_captions(batch, empty, device, generator, proportion_empty_prompts)
        pixels = batch["pixel_values"].to(device, dtype=parts.vae.dtype, non_blocking=True)
        latents = self.encode_images(pixels, parts, generator)
        hidden, extra = self.encode_prompts(rows, parts)
        return Encoded(latents, hidden, extra)

    def encode_images(self, pixels: Any, parts: Parts, generator: Any) -> Any:
        """Pixels in [-1, 1] → the transformer's latents (patchified, normalised); deterministic (the
        posterior's mode), so an encoding can be kept and reused."""
        import torch

        new_diffusers = second_stack("diffusers")
        vae = parts.vae
        with torch.no_grad():
            latents = new_diffusers.Flux2KleinPipeline._patchify_latents(vae.encode(pixels).latent_dist.mode())
            mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents)
            std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents)
            return (latents - mean) / std

    def encode_prompts(self, rows: dict[str, Any], parts: Parts) -> tuple[Any, dict[str, Any]]:
        """Token ids and masks (`Flux2Captions`'s) → (prompt embeddings, {"text_ids"}), each row on
        its own (no row reads another), so an encoding can be kept per caption and reused."""
        import torch

        with torch.no_grad():
            # The decoder stack alone (`.model`): the pipeline runs the whole causal LM, whose logits
            # (151,936 per token) it never reads; the hidden states are the same.
            encoder = getattr(parts.text_encoder, "model", parts.text_encoder)
            out = encoder(
                input_ids=rows["input_ids"],
                attention_mask=rows["attention_mask"],
                output_hidden_states=True,
                use_cache=False,
            )
            hidden = torch.stack([out.hidden_states[k] for k in TEXT_ENCODER_OUT_LAYERS], dim=1)
        batch_size, layers, length, width = hidden.shape
        hidden = hidden.permute(0, 2, 1, 3).reshape(batch_size, length, layers * width)
        return hidden, text_ids(hidden)

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

        new_diffusers = second_stack("diffusers")

        if noise_offset or snr_gamma:
            raise ValueError("noise_offset and snr_gamma belong to the DDPM loss; FLUX.2 trains on flow matching")
        latents = encoded.latents
        device, batch = latents.device, latents.shape[0]
        noise, timesteps, noisy = flow.noised(latents, parts.noise_scheduler, generator)
        packed = new_diffusers.Flux2KleinPipeline._pack_latents(noisy)
        latent_ids = new_diffusers.Flux2KleinPipeline._prepare_latent_ids(latents).to(device)
        config = getattr(model, "config", None) or parts.transformer.config
        guidance = torch.full((batch,), GUIDANCE_SCALE, device=device) if config.guidance_embeds else None
        dtype = next(model.parameters()).dtype
        ctx = torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext()
        with ctx:
            pred = model(
                hidden_states=packed.to(dtype),
                timestep=(timesteps / 1000).to(dtype),
                guidance=guidance,
                encoder_hidden_states=encoded.hidden.to(dtype),
                txt_ids=encoded.extra["text_ids"],
                img_ids=latent_ids,
                return_dict=False,
            )[0]
        pred = new_diffusers.Flux2KleinPipeline._unpack_latents_with_ids(pred[:, : packed.shape[1]], latent_ids)
        return flow.mse(pred, noise - latents)


FAMILY = Flux2Klein()
