"""SDXL base 1.0 and SD 3 medium-sized pipelines with random weights, built offline, for the GPU
acceptance's SDXL and SD 3 rows (random_sd15 builds SD 1.5's).

The configs are those of stabilityai/stable-diffusion-xl-base-1.0 and
stabilityai/stable-diffusion-3-medium-diffusers (each component's config.json, the keys that
shape the model), so memory, throughput and checkpoint sizes are the real models'. The parameter
counts are checked when the pipeline is built (and on the meta device in the tests): SDXL's UNet
2,567,463,684, SD3 medium's transformer 2,028,328,000. SD 3 is built without T5-XXL (4.76 B of its
~7 B parameters): its rows train with sd3_t5=false, as a run that leaves T5 out does, so a row
fits one GPU's memory and the lent machine's 64 GB disk. Tokenizers are tiny_model's BPE learned
from the scene captions, padded to CLIP's 77 tokens.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from sdflow_image.builders import random_sd15, tiny_model

RESOLUTION = 1024  # both models' native size

# stable-diffusion-xl-base-1.0 unet/config.json
SDXL_UNET_CONFIG: dict[str, Any] = {
    "sample_size": 128,
    "in_channels": 4,
    "out_channels": 4,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    "block_out_channels": (320, 640, 1280),
    "layers_per_block": 2,
    "transformer_layers_per_block": (1, 2, 10),
    "attention_head_dim": (5, 10, 20),
    "cross_attention_dim": 2048,
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "act_fn": "silu",
}
SDXL_UNET_PARAMETERS = 2_567_463_684
# vae/config.json: SD 1.5's VAE with SDXL's scaling factor.
SDXL_VAE_CONFIG: dict[str, Any] = {**random_sd15.VAE_CONFIG, "sample_size": 1024, "scaling_factor": 0.13025}
VAE_PARAMETERS = random_sd15.VAE_PARAMETERS
# text_encoder/config.json (CLIP ViT-L/14) is SD 1.5's; text_encoder_2 is OpenCLIP ViT-bigG/14's.
CLIP_L_CONFIG = random_sd15.TEXT_CONFIG
CLIP_G_CONFIG: dict[str, Any] = {
    "vocab_size": 49408,
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 20,
    "max_position_embeddings": 77,
    "hidden_act": "gelu",
    "projection_dim": 1280,
}
CLIP_L_PARAMETERS = random_sd15.TEXT_PARAMETERS  # CLIPTextModel (SDXL's first encoder)
CLIP_L_PROJECTED_PARAMETERS = CLIP_L_PARAMETERS + 768 * 768  # CLIPTextModelWithProjection (SD3's)
CLIP_G_PARAMETERS = 694_659_840  # CLIPTextModelWithProjection

# stable-diffusion-3-medium-diffusers transformer/config.json
SD3_TRANSFORMER_CONFIG: dict[str, Any] = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "num_layers": 24,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "out_channels": 16,
    "pos_embed_max_size": 192,
}
SD3_TRANSFORMER_PARAMETERS = 2_028_328_000
# vae/config.json: 16 latent channels, no quant convs, a shift before the scale.
SD3_VAE_CONFIG: dict[str, Any] = {
    **random_sd15.VAE_CONFIG,
    "latent_channels": 16,
    "sample_size": 1024,
    "scaling_factor": 1.5305,
    "shift_factor": 0.0609,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
SD3_VAE_PARAMETERS = 83_819_683


def count(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def _tokenizer() -> Any:
    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory(prefix="sdflow-random-bpe-") as tok_dir:
        vocab_file, merges_file, vocab_size = tiny_model.write_clip_bpe(tok_dir)
        tokenizer = CLIPTokenizer(
            vocab_file=str(vocab_file), merges_file=str(merges_file), model_max_length=random_sd15.TOKENIZER_MAX_LENGTH
        )
    if vocab_size > CLIP_L_CONFIG["vocab_size"]:
        raise ValueError(f"the BPE vocabulary ({vocab_size}) outgrew CLIP's embedding ({CLIP_L_CONFIG['vocab_size']})")
    return tokenizer


def _clip(cls: Any, config: dict[str, Any], tokenizer: Any) -> Any:
    from transformers import CLIPTextConfig

    ids = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return cls(CLIPTextConfig(**config, **ids))


def _on_cpu(cls: Any, **config: Any) -> Any:
    """A scheduler built on the CPU: its tables go through numpy, which a meta tensor cannot (the
    tests build the components under torch.device("meta") to count parameters without 14 GB)."""
    import torch

    with torch.device("cpu"):
        return cls(**config)


def build_sdxl_components(seed: int = 0) -> dict[str, Any]:
    import torch
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    tokenizer = _tokenizer()
    return {
        "unet": UNet2DConditionModel(**SDXL_UNET_CONFIG),
        "vae": AutoencoderKL(**SDXL_VAE_CONFIG),
        "text_encoder": _clip(CLIPTextModel, CLIP_L_CONFIG, tokenizer),
        "text_encoder_2": _clip(CLIPTextModelWithProjection, CLIP_G_CONFIG, tokenizer),
        "tokenizer": tokenizer,
        "tokenizer_2": _tokenizer(),
        "scheduler": _on_cpu(  # scheduler/scheduler_config.json
            EulerDiscreteScheduler,
            num_train_timesteps=1000,
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            steps_offset=1,
            timestep_spacing="leading",
        ),
    }


def build_sd3_components(seed: int = 0) -> dict[str, Any]:
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection

    torch.manual_seed(seed)
    tokenizer = _tokenizer()
    return {
        "transformer": SD3Transformer2DModel(**SD3_TRANSFORMER_CONFIG),
        "vae": AutoencoderKL(**SD3_VAE_CONFIG),
        "text_encoder": _clip(CLIPTextModelWithProjection, CLIP_L_CONFIG, tokenizer),
        "text_encoder_2": _clip(CLIPTextModelWithProjection, CLIP_G_CONFIG, tokenizer),
        "tokenizer": tokenizer,
        "tokenizer_2": _tokenizer(),
        "text_encoder_3": None,  # T5-XXL left out: see the module's docstring
        "tokenizer_3": None,
        "scheduler": _on_cpu(FlowMatchEulerDiscreteScheduler, num_train_timesteps=1000, shift=3.0),
    }


# family -> {component: published parameter count}
EXPECTED_PARAMETERS: dict[str, dict[str, int]] = {
    "sdxl": {"unet": SDXL_UNET_PARAMETERS, "vae": VAE_PARAMETERS, "text_encoder": CLIP_L_PARAMETERS,
             "text_encoder_2": CLIP_G_PARAMETERS},
    "sd3": {"transformer": SD3_TRANSFORMER_PARAMETERS, "vae": SD3_VAE_PARAMETERS,
            "text_encoder": CLIP_L_PROJECTED_PARAMETERS, "text_encoder_2": CLIP_G_PARAMETERS},
}  # fmt: skip


def check_parameters(family: str, components: dict[str, Any]) -> None:
    """ValueError naming each component whose size is not the published model's: a row on a
    model of the wrong size would measure the wrong thing."""
    wrong = [
        f"{name} has {count(components[name]):,} parameters, the published model {want:,}"
        for name, want in EXPECTED_PARAMETERS[family].items()
        if count(components[name]) != want
    ]
    if wrong:
        raise ValueError(f"random {family}: " + "; ".join(wrong))


def build_pipeline(family: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Build, check and save (diffusers layout, safetensors) the random `family` (sdxl | sd3)
    pipeline: ~13.9 GB for SDXL, ~11.7 GB for SD 3 without T5 (fp32)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from diffusers import StableDiffusion3Pipeline, StableDiffusionXLPipeline

    pipe: Any
    if family == "sdxl":
        components = build_sdxl_components(seed)
        check_parameters(family, components)
        pipe = StableDiffusionXLPipeline(**components)
    elif family == "sd3":
        components = build_sd3_components(seed)
        check_parameters(family, components)
        pipe = StableDiffusion3Pipeline(**components)
    else:
        raise ValueError(f"family={family!r}: random full-size builders exist for sdxl and sd3 (sd: random_sd15)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    return out
