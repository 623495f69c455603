"""SD 3.5 (Large, Medium), FLUX.2 [klein] (4B, 9B) and Qwen-Image at full size with random weights,
built offline, for the GPU acceptance's rows of the second stack (random_families builds SDXL's and
SD 3's, on the first).

The configs are the published models' (each component's config.json, the keys that shape the
model), written here: stabilityai/stable-diffusion-3.5-large and -medium, black-forest-labs/
FLUX.2-klein-4B and -9B (Qwen3-4B and Qwen3-8B as text encoders), Qwen/Qwen-Image (Qwen2.5-VL-7B-
Instruct as text encoder). `build_components(variant, device="meta")` builds them without memory to
count parameters (`PARAMETERS` holds the counts, checked in the tests); `build_pipeline` builds one
on a device (a GPU builds a 20 B model in seconds where a CPU takes minutes), checks the counts and
saves it in bf16. Tokenizers are the tiny models' (a vocabulary learned from the scene captions,
inside each encoder's embedding): the rows measure memory, throughput and checkpoint sizes, not text.

Sizes saved in bf16 (2 bytes a parameter): FLUX.2 klein 4B 16.0 GB, 9B 34.7 GB, Qwen-Image 57.7 GB,
SD 3.5 Large 17.9 GB and Medium 6.3 GB without T5-XXL (`with_t5=False`, as random_families' SD 3;
T5 adds 9.5 GB). Qwen-Image with its text encoder is most of the lent machine's 64 GB disk.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sdflow_image.builders import random_families, random_sd15, tiny_families
from sdflow_image.families.base import second_stack

# --- SD 3.5 (transformer/config.json; VAE and text encoders are SD 3's) -----------------------------
_SD35_COMMON: dict[str, Any] = {
    "sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "attention_head_dim": 64,
    "joint_attention_dim": 4096, "pooled_projection_dim": 2048, "qk_norm": "rms_norm",
}  # fmt: skip
SD35_LARGE_TRANSFORMER: dict[str, Any] = {
    **_SD35_COMMON, "num_layers": 38, "num_attention_heads": 38, "caption_projection_dim": 2432,
    "pos_embed_max_size": 192,
}  # fmt: skip
SD35_MEDIUM_TRANSFORMER: dict[str, Any] = {
    **_SD35_COMMON, "num_layers": 24, "num_attention_heads": 24, "caption_projection_dim": 1536,
    "pos_embed_max_size": 384, "dual_attention_layers": tuple(range(13)),
}  # fmt: skip
# text_encoder_3/config.json (T5 v1.1 XXL's encoder)
T5_XXL: dict[str, Any] = {
    "vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
    "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "feed_forward_proj": "gated-gelu",
    "dense_act_fn": "gelu_new", "is_gated_act": True, "layer_norm_epsilon": 1e-6, "tie_word_embeddings": False,
}  # fmt: skip

# --- FLUX.2 [klein] (transformer/config.json, text_encoder/config.json; the VAE is diffusers'
# AutoencoderKLFlux2 defaults, which are FLUX.2's) ------------------------------------------------------
_KLEIN_COMMON: dict[str, Any] = {
    "patch_size": 1, "in_channels": 128, "attention_head_dim": 128, "timestep_guidance_channels": 256,
    "mlp_ratio": 3.0, "axes_dims_rope": (32, 32, 32, 32), "rope_theta": 2000, "eps": 1e-6, "guidance_embeds": False,
}  # fmt: skip
KLEIN_4B_TRANSFORMER = {**_KLEIN_COMMON, "num_layers": 5, "num_single_layers": 20, "num_attention_heads": 24,
                        "joint_attention_dim": 3 * 2560}  # fmt: skip
KLEIN_9B_TRANSFORMER = {**_KLEIN_COMMON, "num_layers": 8, "num_single_layers": 24, "num_attention_heads": 32,
                        "joint_attention_dim": 3 * 4096}  # fmt: skip
_QWEN3_COMMON: dict[str, Any] = {
    "vocab_size": 151936, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
}  # fmt: skip
QWEN3_4B = {**_QWEN3_COMMON, "hidden_size": 2560, "intermediate_size": 9728, "tie_word_embeddings": True}
QWEN3_8B = {**_QWEN3_COMMON, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False}

# --- Qwen-Image (transformer/config.json; the VAE is diffusers' AutoencoderKLQwenImage defaults,
# which are Qwen-Image's; text_encoder/config.json is Qwen2.5-VL-7B-Instruct's) ------------------------
QWENIMAGE_TRANSFORMER: dict[str, Any] = {
    "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False, "axes_dims_rope": (16, 56, 56),
}  # fmt: skip
QWEN25_VL_7B: dict[str, Any] = {
    "text_config": {
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_scaling": {"type": "mrope", "rope_type": "default", "mrope_section": [16, 24, 24]},
    },
    "vision_config": {
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31], "in_chans": 3, "hidden_act": "silu", "tokens_per_second": 2,
    },
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}  # fmt: skip

VARIANTS = ("sd35-large", "sd35-medium", "flux2-klein-4b", "flux2-klein-9b", "qwenimage")
FAMILY_OF = {"sd35-large": "sd35", "sd35-medium": "sd35", "flux2-klein-4b": "flux2", "flux2-klein-9b": "flux2",
             "qwenimage": "qwenimage"}  # fmt: skip

# variant -> {component: parameter count}, measured on the meta device from the configs above (the
# tests check they still build so); they match the published sizes: SD 3.5 Large 8.1 B, klein 4B
# and 9B transformers 3.9 B and 9.1 B with Qwen3-4B and -8B, Qwen-Image 20.4 B with Qwen2.5-VL-7B.
_SD35_TEXT = {"vae": 83_819_683, "text_encoder": 123_650_304, "text_encoder_2": 694_659_840,
              "text_encoder_3": 4_762_310_656}  # fmt: skip
PARAMETERS: dict[str, dict[str, int]] = {
    "sd35-large": {"transformer": 8_056_627_520, **_SD35_TEXT},
    "sd35-medium": {"transformer": 2_243_171_520, **_SD35_TEXT},
    "flux2-klein-4b": {"transformer": 3_875_544_576, "vae": 84_046_115, "text_encoder": 4_022_468_096},
    "flux2-klein-9b": {"transformer": 9_078_581_248, "vae": 84_046_115, "text_encoder": 8_190_735_360},
    "qwenimage": {"transformer": 20_430_401_088, "vae": 126_892_531, "text_encoder": 8_292_166_656},
}


def count(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def _clip_tokenizer() -> Any:
    """tiny_families' CLIP BPE at CLIP's 77 tokens (built the way transformers 5 reads it)."""
    tokenizer = tiny_families._clip_tokenizer()
    tokenizer.model_max_length = random_sd15.TOKENIZER_MAX_LENGTH
    return tokenizer


def _sd35(transformer_config: dict[str, Any], with_t5: bool) -> dict[str, Any]:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tokenizer = _clip_tokenizer()
    components = {
        "transformer": SD3Transformer2DModel(**transformer_config),
        "vae": AutoencoderKL(**random_families.SD3_VAE_CONFIG),
        "text_encoder": random_families._clip(CLIPTextModelWithProjection, random_families.CLIP_L_CONFIG, tokenizer),
        "text_encoder_2": random_families._clip(CLIPTextModelWithProjection, random_families.CLIP_G_CONFIG, tokenizer),
        "tokenizer": tokenizer,
        "tokenizer_2": _clip_tokenizer(),
        "text_encoder_3": None,
        "tokenizer_3": None,
        "scheduler": random_families._on_cpu(FlowMatchEulerDiscreteScheduler, num_train_timesteps=1000, shift=3.0),
    }
    if with_t5:
        t5_tokenizer = tiny_families.t5_tokenizer()
        t5_tokenizer.model_max_length = random_sd15.TOKENIZER_MAX_LENGTH
        components["tokenizer_3"] = t5_tokenizer
        components["text_encoder_3"] = T5EncoderModel(T5Config(**T5_XXL))
    return components


def _flow_scheduler(**config: Any) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return random_families._on_cpu(FlowMatchEulerDiscreteScheduler, **config)


def _flux2(transformer_config: dict[str, Any], text_config: dict[str, Any]) -> dict[str, Any]:
    new_diffusers = second_stack("diffusers")
    new_transformers = second_stack("transformers")

    from sdflow_image.builders.tiny_families_next import build_qwen_tokenizer

    return {
        "transformer": new_diffusers.Flux2Transformer2DModel(**transformer_config),
        "vae": new_diffusers.AutoencoderKLFlux2(),
        "text_encoder": new_transformers.Qwen3ForCausalLM(new_transformers.Qwen3Config(**text_config)),
        "tokenizer": build_qwen_tokenizer(),
        # FLUX.2's scheduler_config.json: dynamic shifting, the pipeline passing `mu` per size.
        "scheduler": _flow_scheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True),
    }


# Qwen/Qwen-Image scheduler/scheduler_config.json
QWENIMAGE_SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 0.9,
    "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02, "time_shift_type": "exponential",
}  # fmt: skip


def _qwenimage() -> dict[str, Any]:
    new_diffusers = second_stack("diffusers")
    new_transformers = second_stack("transformers")

    from sdflow_image.builders.tiny_families_next import build_qwen_tokenizer

    return {
        "transformer": new_diffusers.QwenImageTransformer2DModel(**QWENIMAGE_TRANSFORMER),
        "vae": new_diffusers.AutoencoderKLQwenImage(),
        "text_encoder": new_transformers.Qwen2_5_VLForConditionalGeneration(
            new_transformers.Qwen2_5_VLConfig(**QWEN25_VL_7B)
        ),
        "tokenizer": build_qwen_tokenizer(),
        "scheduler": _flow_scheduler(**QWENIMAGE_SCHEDULER),
    }


def build_components(variant: str, device: str = "meta", dtype: Any = None, with_t5: bool = True) -> dict[str, Any]:
    """The pipeline's components of `variant` (VARIANTS), built on `device` in `dtype` (default the
    torch default); "meta" allocates nothing, to count parameters."""
    import torch

    builders = {
        "sd35-large": lambda: _sd35(SD35_LARGE_TRANSFORMER, with_t5),
        "sd35-medium": lambda: _sd35(SD35_MEDIUM_TRANSFORMER, with_t5),
        "flux2-klein-4b": lambda: _flux2(KLEIN_4B_TRANSFORMER, QWEN3_4B),
        "flux2-klein-9b": lambda: _flux2(KLEIN_9B_TRANSFORMER, QWEN3_8B),
        "qwenimage": _qwenimage,
    }
    if variant not in builders:
        raise ValueError(f"variant={variant!r} is not one of {', '.join(VARIANTS)}")
    previous = torch.get_default_dtype()
    try:
        if dtype is not None:
            torch.set_default_dtype(dtype)
        with torch.device(device):
            return builders[variant]()
    finally:
        torch.set_default_dtype(previous)


def component_counts(components: dict[str, Any]) -> dict[str, int]:
    """{component: parameters} of the models among `components` (tokenizers and scheduler left out)."""
    return {name: count(module) for name, module in components.items() if hasattr(module, "parameters")}


def check_parameters(variant: str, components: dict[str, Any]) -> None:
    """ValueError naming each component whose size is not the published model's."""
    counts = component_counts(components)
    wrong = [
        f"{name} has {counts.get(name, 0):,} parameters, the published model {want:,}"
        for name, want in PARAMETERS[variant].items()
        if name in components and components[name] is not None and counts.get(name) != want
    ]
    if wrong:
        raise ValueError(f"random {variant}: " + "; ".join(wrong))


def build_pipeline(variant: str, out_dir: str | Path, device: str = "cpu", seed: int = 0, with_t5: bool = True) -> Path:
    """Build (on `device`: "cuda" is fast), check and save `variant`'s pipeline in bf16 to `out_dir`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import diffusers
    import torch

    torch.manual_seed(seed)
    components = build_components(variant, device=device, dtype=torch.bfloat16, with_t5=with_t5)
    check_parameters(variant, components)
    pipeline = {"sd35": "StableDiffusion3Pipeline", "flux2": "Flux2KleinPipeline", "qwenimage": "QwenImagePipeline"}
    pipe = getattr(diffusers, pipeline[FAMILY_OF[variant]])(**components)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    return out
