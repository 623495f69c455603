"""A Stable Diffusion 1.5-sized pipeline with random weights, built offline, for the GPU acceptance.

Same shapes as runwayml/stable-diffusion-v1-5 (UNet 859,520,964 parameters, VAE 83,653,863,
CLIP ViT-L/14 text encoder 123,060,480), so memory, throughput and checkpoint sizes are those of
the real model; nothing is downloaded. The tokenizer is tiny_model's BPE learned from the scene
captions, padded to SD's 77 tokens: the text encoder's 49,408-row embedding covers its ids.
Saved in the diffusers layout, so `bin/train` loads it through the same `from_pretrained` path
as a real base model.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from sdflow_image.builders import tiny_model

# runwayml/stable-diffusion-v1-5 unet/config.json, the keys that shape the model (the rest are
# UNet2DConditionModel's defaults).
UNET_CONFIG: dict[str, Any] = {
    "sample_size": 64,
    "in_channels": 4,
    "out_channels": 4,
    "center_input_sample": False,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    "block_out_channels": (320, 640, 1280, 1280),
    "layers_per_block": 2,
    "downsample_padding": 1,
    "mid_block_scale_factor": 1,
    "act_fn": "silu",
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "cross_attention_dim": 768,
    "attention_head_dim": 8,
}
UNET_PARAMETERS = 859_520_964
# vae/config.json of the same repository.
VAE_CONFIG: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": 2,
    "act_fn": "silu",
    "latent_channels": 4,
    "norm_num_groups": 32,
    "sample_size": 512,
    "scaling_factor": 0.18215,
}
VAE_PARAMETERS = 83_653_863
# text_encoder/config.json (CLIP ViT-L/14's text tower).
TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "projection_dim": 768,
}
TEXT_PARAMETERS = 123_060_480
TOKENIZER_MAX_LENGTH = 77
RESOLUTION = 512


def build_components(seed: int = 0) -> dict[str, Any]:
    """The pipeline's components at SD 1.5's sizes, randomly initialised from `seed`."""
    import torch
    from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix="sdflow-sd15-bpe-") as tok_dir:
        vocab_file, merges_file, vocab_size = tiny_model.write_clip_bpe(tok_dir)
        tokenizer = CLIPTokenizer(
            vocab_file=str(vocab_file), merges_file=str(merges_file), model_max_length=TOKENIZER_MAX_LENGTH
        )
    if vocab_size > TEXT_CONFIG["vocab_size"]:
        raise ValueError(f"the BPE vocabulary ({vocab_size}) outgrew CLIP's embedding ({TEXT_CONFIG['vocab_size']})")
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            **TEXT_CONFIG,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    scheduler = DPMSolverMultistepScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1
    )
    return {
        "unet": UNet2DConditionModel(**UNET_CONFIG),
        "vae": AutoencoderKL(**VAE_CONFIG),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": scheduler,
    }


def build_pipeline(out_dir: str | Path, seed: int = 0) -> Path:
    """Build and save (diffusers layout, safetensors) the random SD 1.5-sized pipeline: ~4.3 GB."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from diffusers import StableDiffusionPipeline

    pipe: Any = StableDiffusionPipeline(
        **build_components(seed), safety_checker=None, feature_extractor=None, requires_safety_checker=False
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    return out
