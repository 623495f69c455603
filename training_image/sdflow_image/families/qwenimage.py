"""Qwen-Image: Qwen2.5-VL as the text encoder, the `AutoencoderKLQwenImage` VAE (a video VAE read
one frame at a time) whose latents are normalised by its published per-channel mean and std, and a
`QwenImageTransformer2DModel` trained on the flow-matching loss.

After diffusers 0.42.1's examples/dreambooth/train_dreambooth_lora_qwen_image.py and the
`QwenImagePipeline` it trains for:
- the prompt: the pipeline's `_get_qwen_prompt_embeds`: the caption inside its system/user
  template (`PROMPT_TEMPLATE`), the encoder's last hidden state at the tokens its attention mask
  keeps, less the template's first 34 (the system turn, `prompt_template_encode_start_idx`), each
  row padded to the batch's longest with a mask of the real tokens, which the 0.42 transformer
  takes as `encoder_hidden_states_mask` (its `txt_seq_lens` argument is gone). Captions are
  tokenized to 512 tokens after the template, the script's `--max_sequence_length` default;
- the latents: the posterior sampled (`latent_dist.sample()`, as the script does) from the image as
  a one-frame video (B, C, 1, H, W), then `(x - latents_mean) / latents_std` from the VAE's config,
  which the pipeline undoes before decoding;
- the loss: a uniform draw on the training schedule (`weighting_scheme=none`), the noisy input
  packed into 2x2 patches (`_pack_latents`), `img_shapes` of one frame per sample, the timestep /
  1000, and the squared error of the unpacked prediction to `noise - x0`, weighted 1. Qwen-Image's
  transformer has no guidance embedding (`guidance_embeds: false`); classifier-free guidance is the
  pipeline's `true_cfg_scale` with a negative prompt, at inference only.
- LoRA: the script's targets, the attention projections `to_k`, `to_q`, `to_v`, `to_out.0`.
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

# QwenImagePipeline.prompt_template_encode and prompt_template_encode_start_idx (diffusers 0.42.1).
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
TEMPLATE_START = 34
MAX_SEQUENCE_LENGTH = 512  # train_dreambooth_lora_qwen_image.py's --max_sequence_length default
CAPTION_KEYS = ("input_ids", "attention_mask")


class QwenCaptions:
    """Picklable caption → {"input_ids", "attention_mask"}: the templated caption, padded to a fixed
    length so that the DataLoader can batch it (the mask keeps the padding out of the encoding)."""

    def __init__(self, tokenizer: Any, length: int) -> None:
        self.tokenizer, self.length = tokenizer, length

    def __call__(self, caption: str) -> dict[str, Any]:
        out = self.tokenizer(
            PROMPT_TEMPLATE.format(caption),
            max_length=self.length,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
        )
        return {key: out[key][0] for key in CAPTION_KEYS}


def prompt_rows(hidden: Any, mask: Any) -> list[Any]:
    """The pipeline's `_extract_masked_hidden`: each row's kept tokens less the template's system turn."""
    return [states[keep.bool()][TEMPLATE_START:] for states, keep in zip(hidden, mask, strict=True)]


def pad_rows(rows: list[Any]) -> tuple[Any, Any]:
    """What follows `_extract_masked_hidden` in the pipeline: the rows padded with zeros to the
    longest; (embeddings, mask of real tokens)."""
    import torch

    length = max(row.shape[0] for row in rows)
    embeds = torch.stack([torch.cat([row, row.new_zeros(length - row.shape[0], row.shape[1])]) for row in rows])
    kept = torch.stack(
        [torch.cat([torch.ones(r.shape[0], dtype=torch.long), torch.zeros(length - r.shape[0], dtype=torch.long)])
         for r in rows]
    ).to(embeds.device)  # fmt: skip
    return embeds, kept


def prompt_embeds(hidden: Any, mask: Any) -> tuple[Any, Any]:
    """(embeddings, mask of real tokens) of the encoder's last hidden states and the captions' mask."""
    return pad_rows(prompt_rows(hidden, mask))


def normalise(latents: Any, vae: Any) -> Any:
    """VAE latents (B, z, 1, h, w) → `(x - latents_mean) / latents_std` from the VAE's config."""
    import torch

    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents)
    std = torch.tensor(vae.config.latents_std).view(shape).to(latents)
    return (latents - mean) / std


class QwenImage(Family):
    name = "qwenimage"
    resolution_multiple = 16  # VAE factor 8 x the transformer's 2x2 latent patch
    pipeline_class_name = "QwenImagePipeline"
    denoiser_name = "transformer"
    denoiser_class_name = "QwenImageTransformer2DModel"
    text_encoder_lora = False  # QwenImageLoraLoaderMixin loads the transformer's adapter only
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
            text_encoder=new_transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
                base, **sub("text_encoder"), **transformers_dtype(dtypes.text_encoders)
            ),
            vae=new_diffusers.AutoencoderKLQwenImage.from_pretrained(base, **sub("vae"), **diffusers_dtype(dtypes.vae)),
            unet=None,
            transformer=new_diffusers.QwenImageTransformer2DModel.from_pretrained(
                base, **sub("transformer"), **diffusers_dtype(dtypes.denoiser)
            ),
            noise_scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(base, **sub("scheduler")),
        )

    def caption_ids(self, parts: Parts) -> Callable[[str], dict[str, Any]]:
        return QwenCaptions(parts.tokenizer, MAX_SEQUENCE_LENGTH + TEMPLATE_START)

    def call_kwargs(self, pipe: Any, prompt: Any, negative_prompt: Any, guidance_scale: float) -> dict[str, Any]:
        # QwenImagePipeline's classifier-free guidance is `true_cfg_scale` with a negative prompt (its
        # `guidance_scale` is for guidance-distilled transformers, which Qwen-Image's is not); a
        # blank one enables it where the request gave none, as the pipeline's docstring advises.
        kwargs: dict[str, Any] = {"prompt": prompt, "true_cfg_scale": guidance_scale}
        if guidance_scale > 1:
            negative = negative_prompt or " "
            kwargs["negative_prompt"] = [negative] * len(prompt) if isinstance(prompt, list) else negative
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
        """Pixels in [-1, 1] → normalised latents (B, z, 1, h, w), drawn from the posterior with
        `generator` as the script does."""
        import torch

        vae = parts.vae
        with torch.no_grad():
            return normalise(vae.encode(pixels.unsqueeze(2)).latent_dist.sample(generator=generator), vae)

    def encode_prompts(self, rows: dict[str, Any], parts: Parts) -> tuple[Any, dict[str, Any]]:
        """Token ids and masks (`QwenCaptions`'s) → (prompt embeddings, {"mask"}), padded to the
        batch's longest caption; each row is encoded on its own, so it can be kept and re-padded."""
        hidden, mask = prompt_embeds(self.last_hidden(rows, parts), rows["attention_mask"])
        return hidden, {"mask": mask}

    def last_hidden(self, rows: dict[str, Any], parts: Parts) -> Any:
        """The text encoder's last hidden states of the token rows (B, length, width)."""
        import torch

        with torch.no_grad():
            # The language model alone (`.model`): the pipeline's call also computes logits over the
            # 152,064-token vocabulary, which it never reads; the hidden states are the same.
            encoder = getattr(parts.text_encoder, "model", parts.text_encoder)
            out = encoder(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"], output_hidden_states=True)
        return out.hidden_states[-1]

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
            raise ValueError("noise_offset and snr_gamma belong to the DDPM loss; Qwen-Image trains on flow matching")
        latents = encoded.latents  # (B, z, 1, h, w)
        device, batch = latents.device, latents.shape[0]
        channels, height, width = latents.shape[1], latents.shape[3], latents.shape[4]
        noise, timesteps, noisy = flow.noised(latents, parts.noise_scheduler, generator)
        # (B, z, 1, h, w) → (B, 1, z, h, w): one frame, packed into (B, h/2 * w/2, 4z) tokens.
        packed = new_diffusers.QwenImagePipeline._pack_latents(
            noisy.permute(0, 2, 1, 3, 4), batch, channels, height, width
        )
        img_shapes = [[(1, height // 2, width // 2)]] * batch
        dtype = next(model.parameters()).dtype
        ctx = torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext()
        with ctx:
            pred = model(
                hidden_states=packed.to(dtype),
                encoder_hidden_states=encoded.hidden.to(dtype),
                encoder_hidden_states_mask=encoded.extra["mask"],
                timestep=(timesteps / 1000).to(dtype),
                img_shapes=img_shapes,
                return_dict=False,
            )[0]
        # _unpack_latents takes the pixel size and the VAE's factor; 1 makes the latent size read as one.
        pred = new_diffusers.QwenImagePipeline._unpack_latents(pred, height, width, 1)
        return flow.mse(pred, noise - latents)


FAMILY = QwenImage()
