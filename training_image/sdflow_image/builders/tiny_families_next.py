"""Tiny SD 3.5, FLUX.2 [klein] and Qwen-Image pipelines built in code, for the second stack's tests
(diffusers 0.42.1: none of these classes exist in the first stack's 0.29). As tiny_families does
for SDXL and SD 3: the real diffusers and transformers classes with small configs (after diffusers'
own pipeline tests for them), random weights, saved in the diffusers layout. Nothing is downloaded.

The Qwen tokenizers (FLUX.2's Qwen3 and Qwen-Image's Qwen2.5-VL read the same vocabulary family) are
a byte-level BPE learned here with `tokenizers` from the scene captions and the chat/prompt
templates the pipelines wrap a prompt in, as a transformers `Qwen2Tokenizer` with `<|im_start|>` and
`<|im_end|>` as special tokens and a chat template of Qwen3's shape (`enable_thinking=False` adds an
empty think block). Every template word is one token, so Qwen-Image's system turn is 34 tokens here
as with Qwen's own vocabulary, and the pipeline's fixed `prompt_template_encode_start_idx` drops
exactly it (`build_qwen_tokenizer` checks).

`build_tiny_next(family, out_dir)` builds one; tiny_families.build_tiny passes these families here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sdflow_image.builders import tiny_families, tiny_model
from sdflow_image.families.base import second_stack

QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen3's chat template, reduced to what a one-turn prompt uses (no tools, no earlier thinking).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
QWEN_TEXT_WIDTH = 16
FLUX2_TEXT_LAYERS = 27  # Flux2KleinPipeline reads hidden states 9, 18 and 27: the encoder needs 27 layers
QWEN_VAE_SCALE = 4  # both tiny VAEs downsample 32 px images to 8 latents, as tiny_model's does


def build_qwen_tokenizer() -> Any:
    """A Qwen2Tokenizer over the captions and templates (see the module docstring)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    new_transformers = second_stack("transformers")

    from sdflow_image.families.qwenimage import PROMPT_TEMPLATE, TEMPLATE_START

    corpus = [*tiny_model.CAPTIONS, PROMPT_TEMPLATE.format(""), "user assistant system\n<think>\n\n</think>\n\n"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator(corpus, trainer)
    model = json.loads(bpe.to_str())["model"]
    tokenizer = new_transformers.Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(pair) for pair in model["merges"]])
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL[1:])})
    tokenizer.chat_template = CHAT_TEMPLATE
    system_turn = tokenizer(PROMPT_TEMPLATE.format(""))["input_ids"][: TEMPLATE_START + 1]
    if tokenizer.convert_ids_to_tokens(system_turn[TEMPLATE_START]) != "<|im_end|>":
        raise ValueError(f"the tiny Qwen tokenizer splits Qwen-Image's system turn other than in {TEMPLATE_START}")
    return tokenizer


def _special_ids(tokenizer: Any) -> dict[str, int]:
    """The Qwen encoders' special token ids in the tiny vocabulary (their configs' defaults are
    Qwen's own ids, outside it)."""
    end, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    return {"bos_token_id": end, "eos_token_id": im_end, "pad_token_id": tokenizer.pad_token_id}


def build_sd35_components(seed: int = 0, with_t5: bool = True) -> dict[str, Any]:
    """SD 3's tiny components with an SD 3.5 transformer: qk_norm, and Medium's dual attention in
    its first block; without T5 (`text_encoder_3: [null, null]`) when `with_t5` is False."""
    import torch
    from diffusers import SD3Transformer2DModel

    components = tiny_families.build_tiny_sd3_components(seed, with_t5=with_t5)
    torch.manual_seed(seed)
    components["transformer"] = SD3Transformer2DModel(
        sample_size=tiny_model.IMAGE_SIZE // tiny_model.VAE_SCALE,
        patch_size=1,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=tiny_families.T5_WIDTH,
        pooled_projection_dim=2 * tiny_families.TEXT_WIDTH,
        out_channels=4,
        pos_embed_max_size=tiny_families.POS_EMBED_MAX_SIZE,
        qk_norm="rms_norm",
        dual_attention_layers=(0,),
    )
    return components


def _flow_scheduler() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    # Both pipelines shift their inference schedule by the image's size (they pass `mu`), which the
    # scheduler takes only with dynamic shifting on, as the published schedulers have it.
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)


def build_flux2_components(seed: int = 0) -> dict[str, Any]:
    import torch

    new_diffusers = second_stack("diffusers")
    new_transformers = second_stack("transformers")

    torch.manual_seed(seed)
    tokenizer = build_qwen_tokenizer()
    latent_channels = 4
    vae = new_diffusers.AutoencoderKLFlux2(
        sample_size=tiny_model.IMAGE_SIZE,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 32),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=8,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    with torch.no_grad():  # batch-norm statistics other than (0, 1), so that normalising shows
        vae.bn.running_mean.normal_(0.0, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    text_encoder = new_transformers.Qwen3ForCausalLM(
        new_transformers.Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=QWEN_TEXT_WIDTH,
            intermediate_size=QWEN_TEXT_WIDTH,
            num_hidden_layers=FLUX2_TEXT_LAYERS,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=1024,
            **_special_ids(tokenizer),
        )
    )
    transformer = new_diffusers.Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * latent_channels,  # the latents patchified 2x2
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=3 * QWEN_TEXT_WIDTH,  # three hidden layers side by side
        timestep_guidance_channels=256,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=False,
    )
    return {
        "scheduler": _flow_scheduler(),
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer": transformer,
    }


def build_qwenimage_components(seed: int = 0) -> dict[str, Any]:
    import torch

    new_diffusers = second_stack("diffusers")
    new_transformers = second_stack("transformers")

    torch.manual_seed(seed)
    tokenizer = build_qwen_tokenizer()
    z_dim = 4
    generator = torch.Generator().manual_seed(seed)
    vae = new_diffusers.AutoencoderKLQwenImage(
        base_dim=z_dim * 6,
        z_dim=z_dim,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        # A mean and std other than (0, 1), so that normalising shows.
        latents_mean=[round(float(v), 4) for v in torch.randn(z_dim, generator=generator) * 0.5],
        latents_std=[round(float(v), 4) for v in torch.rand(z_dim, generator=generator) + 0.5],
    )
    text_encoder = new_transformers.Qwen2_5_VLForConditionalGeneration(
        new_transformers.Qwen2_5_VLConfig(
            text_config={
                "hidden_size": QWEN_TEXT_WIDTH,
                "intermediate_size": QWEN_TEXT_WIDTH,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
                "rope_theta": 1000000.0,
                "vocab_size": len(tokenizer),
                **_special_ids(tokenizer),
            },
            vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                           "out_hidden_size": QWEN_TEXT_WIDTH},
            vocab_size=len(tokenizer),
            **_special_ids(tokenizer),
        )
    ).eval()  # fmt: skip
    transformer = new_diffusers.QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * z_dim,
        out_channels=z_dim,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=3,
        joint_attention_dim=QWEN_TEXT_WIDTH,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )
    return {
        "transformer": transformer,
        "vae": vae,
        "scheduler": _flow_scheduler(),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
    }


def build_tiny_next(family: str, out_dir: str | Path, seed: int = 0, with_t5: bool = True) -> Path:
    """The tiny pipeline of `family` (sd35 | flux2 | qwenimage) saved to `out_dir`; SD 3.5 without
    T5 when `with_t5` is False (the other families have none)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import diffusers

    builders = {
        "sd35": (build_sd35_components, "StableDiffusion3Pipeline"),
        "flux2": (build_flux2_components, "Flux2KleinPipeline"),
        "qwenimage": (build_qwenimage_components, "QwenImagePipeline"),
    }
    if family not in builders:
        raise ValueError(f"family={family!r} is not one of {', '.join(builders)}")
    build, pipeline = builders[family]
    components = build_sd35_components(seed, with_t5) if family == "sd35" else build(seed)
    pipe = getattr(diffusers, pipeline)(**components)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    return out
