"""Tiny SDXL and Stable Diffusion 3 pipelines built in code, beside tiny_model's SD: real
diffusers and transformers classes with small configs (those of diffusers' own pipeline
tests), saved in the diffusers layout with model_index.json. Nothing is downloaded; the CLIP
tokenizers are tiny_model's BPE learned from the scene captions, T5's tokenizer is a word-level
`tokenizers` model over the same words. Weights are random (the VAE too): these models prove
the code paths of each family, not image quality.

`builders.tiny.build_tiny(family, out_dir)` builds any family's; `python -m sdflow_image.builders OUT
--family sdxl` calls it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from sdflow_image.builders import tiny_model

TEXT_WIDTH = 32  # hidden size of each tiny CLIP text encoder (and its projection)
T5_WIDTH = 64  # = SD3's joint_attention_dim: the CLIP pair (2 x 32) padded to T5's width
# SD 3's positional embedding grid (in latent patches, square): the tiny model's own 32 px image is 8
# latent pixels, and an aspect-ratio bucket's long side is up to twice the resolution's (4:1 buckets, 64 px
# at resolution 32: training/buckets.py); four times leaves room to train the tiny model at 64 px too.
POS_EMBED_MAX_SIZE = 4 * tiny_model.IMAGE_SIZE // tiny_model.VAE_SCALE


def transformers_5() -> bool:
    """Whether this is the second stack's transformers (5.x), whose tokenizers are built from a
    vocabulary in memory (4.51's read files) and whose T5 tokenizer is always a Unigram model."""
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5


def _clip_tokenizer() -> Any:
    with tempfile.TemporaryDirectory(prefix="sdflow-tiny-bpe-") as tok_dir:
        tiny_model.write_clip_bpe(tok_dir)
        return tiny_model.clip_tokenizer(tok_dir)


def _clip_config(tokenizer: Any) -> Any:
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer.get_vocab()),
        hidden_size=TEXT_WIDTH,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=tiny_model.TOKENIZER_MAX_LENGTH,
        projection_dim=TEXT_WIDTH,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_tiny_sdxl_components(seed: int = 0) -> dict[str, Any]:
    import torch
    from diffusers import EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    tokenizer = _clip_tokenizer()
    time_embed_dim = 8
    unet = UNet2DConditionModel(
        sample_size=tiny_model.IMAGE_SIZE // tiny_model.VAE_SCALE,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        cross_attention_dim=2 * TEXT_WIDTH,  # both encoders' penultimate layers side by side
        addition_embed_type="text_time",
        addition_time_embed_dim=time_embed_dim,
        # six time ids (original size, crop corner, target size) and the pooled projection
        projection_class_embeddings_input_dim=6 * time_embed_dim + TEXT_WIDTH,
        norm_num_groups=32,
    )
    # SDXL's own training and inference schedule (its scheduler/scheduler_config.json).
    scheduler = EulerDiscreteScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        timestep_spacing="leading",
    )
    return {
        "unet": unet,
        "vae": tiny_model.tiny_vae(),
        "text_encoder": CLIPTextModel(_clip_config(tokenizer)),
        "text_encoder_2": CLIPTextModelWithProjection(_clip_config(tokenizer)),
        "tokenizer": tokenizer,
        "tokenizer_2": _clip_tokenizer(),
        "scheduler": scheduler,
    }


def t5_tokenizer() -> Any:
    """A T5TokenizerFast over the scene captions' words (word level, `</s>` appended as T5's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    words = sorted({w for caption in tiny_model.CAPTIONS for w in caption.lower().split()})
    if transformers_5():
        # 5.x loads tokenizer_3 into T5's Unigram model, whatever model the file holds: the same
        # words as Unigram pieces (Metaspace's "▁" prefix), the same size.
        from transformers import T5Tokenizer

        pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *((f"\u2581{w}", -1.0) for w in words)]
        return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=tiny_model.TOKENIZER_MAX_LENGTH)
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(
        tokenizer_object=backend,
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_ids=0,
        model_max_length=tiny_model.TOKENIZER_MAX_LENGTH,
    )


def build_tiny_sd3_components(seed: int = 0, with_t5: bool = True) -> dict[str, Any]:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    tokenizer = _clip_tokenizer()
    transformer = SD3Transformer2DModel(
        sample_size=tiny_model.IMAGE_SIZE // tiny_model.VAE_SCALE,
        patch_size=1,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=T5_WIDTH,
        pooled_projection_dim=2 * TEXT_WIDTH,  # both CLIP projections side by side
        out_channels=4,
        pos_embed_max_size=POS_EMBED_MAX_SIZE,
    )
    components: dict[str, Any] = {
        "transformer": transformer,
        # SD3's VAE shifts its latents before scaling; a non-zero shift keeps that path honest.
        "vae": tiny_model.tiny_vae(shift_factor=0.0609, scaling_factor=1.5035),
        "text_encoder": CLIPTextModelWithProjection(_clip_config(tokenizer)),
        "text_encoder_2": CLIPTextModelWithProjection(_clip_config(tokenizer)),
        "tokenizer": tokenizer,
        "tokenizer_2": _clip_tokenizer(),
        "text_encoder_3": None,
        "tokenizer_3": None,
        "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
    }
    if with_t5:
        t5_tok = t5_tokenizer()
        components["tokenizer_3"] = t5_tok
        components["text_encoder_3"] = T5EncoderModel(
            T5Config(
                vocab_size=len(t5_tok.get_vocab()),
                d_model=T5_WIDTH,
                d_kv=8,
                d_ff=37,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                pad_token_id=0,
                eos_token_id=1,
                decoder_start_token_id=0,
            )
        )
    return components


def build_tiny_first(family: str, out_dir: str | Path, seed: int = 0, vae_steps: int = 0, with_t5: bool = True) -> Path:
    """The tiny SDXL or SD 3 pipeline saved to `out_dir` (builders/tiny.py builds any family's)."""
    from diffusers import StableDiffusion3Pipeline, StableDiffusionXLPipeline

    pipe: Any
    if family == "sdxl":
        components = build_tiny_sdxl_components(seed)
        if vae_steps:
            tiny_model.fit_vae(components["vae"], vae_steps, seed)
        pipe = StableDiffusionXLPipeline(**components)
    elif family == "sd3":
        components = build_tiny_sd3_components(seed, with_t5=with_t5)
        if vae_steps:
            tiny_model.fit_vae(components["vae"], vae_steps, seed)
        pipe = StableDiffusion3Pipeline(**components)
    else:
        raise ValueError(f"family={family!r} is not one of sd, sdxl, sd3")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    return out
