"""The LoRA target names Validate run accepts (sdflow_common.lora_module_names, lora_modules) are those of the real
denoisers of the colossalai image's families, built at full size on the meta device (nothing allocated): SD 1.5's
and SD 2.1's UNet, SDXL base 1.0's, SD 3 Medium's transformer; and peft, as the image calls it, takes a target
exactly when Validate run does."""

from __future__ import annotations

from typing import Any

import pytest

from sdflow_common import lora_modules
from sdflow_image.builders import random_families, random_sd15
from tests.lora_probes import peft_problem, split_module_names

pytestmark = pytest.mark.image

# stabilityai/stable-diffusion-2-1 unet/config.json where it differs from SD 1.5's (one family, "sd").
SD21_UNET_CONFIG = {
    **random_sd15.UNET_CONFIG,
    "sample_size": 96,
    "attention_head_dim": (5, 10, 20, 20),
    "cross_attention_dim": 1024,
    "use_linear_projection": True,
}
MODELS = {
    "sd15": ("sd", "UNet2DConditionModel", random_sd15.UNET_CONFIG),
    "sd21": ("sd", "UNet2DConditionModel", SD21_UNET_CONFIG),
    "sdxl": ("sdxl", "UNet2DConditionModel", random_families.SDXL_UNET_CONFIG),
    "sd3": ("sd3", "SD3Transformer2DModel", random_families.SD3_TRANSFORMER_CONFIG),
}
# Targets whose peft outcome the test compares with Validate run's: one module of a kind peft adapts, containers,
# a ModuleList (`to_out`), an index, a norm, a misspelling.
PROBES = {
    "sd": ["conv_in", "to_out", "attn1", "0", "norm1", "to_qq"],
    "sdxl": ["add_embedding.linear_1", "to_out", "attn2", "1", "norm", "time_embedding"],
    "sd3": ["context_embedder", "to_out", "attn", "0", "norm_out", "to_qq"],
}


def supported() -> tuple[type, ...]:
    """The classes peft 0.13 adapts (peft.tuners.lora.layer.dispatch_default: "only the following modules are
    supported: torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv2d, transformers.pytorch_utils.Conv1D")."""
    import torch
    from transformers.pytorch_utils import Conv1D

    return (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv2d, Conv1D)


@pytest.fixture(scope="module", params=list(MODELS))
def denoiser(request: pytest.FixtureRequest) -> tuple[str, Any]:
    import diffusers
    import torch

    family, class_name, config = MODELS[request.param]
    with torch.device("meta"):
        return family, getattr(diffusers, class_name)(**config)


def test_lora_module_names_of_family_equal_the_full_size_model_on_meta(denoiser: tuple[str, Any]) -> None:
    family, model = denoiser
    adaptable, other = split_module_names(model, supported())
    held = lora_modules.module_names(family)
    assert held is not None
    # On a mismatch (a diffusers upgrade), paste these into lora_module_names:
    assert held.adaptable == adaptable, lora_modules.compress(adaptable)
    assert held.other == other, lora_modules.compress(other)


def test_peft_takes_a_target_exactly_when_validate_run_accepts_it(denoiser: tuple[str, Any]) -> None:
    """The image's add_adapter is peft's inject_adapter_in_model with LoraConfig(target_modules=[...])."""
    family, model = denoiser
    held = lora_modules.module_names(family)
    assert held is not None
    for target in PROBES[family]:
        refused = peft_problem(model, target)
        assert (refused is None) == (held.problem(target) is None), (target, refused, held.problem(target))


@pytest.mark.parametrize(
    ("class_name", "config"),
    [("CLIPTextModel", random_families.CLIP_L_CONFIG), ("CLIPTextModelWithProjection", random_families.CLIP_G_CONFIG)],
)
def test_text_encoder_lora_targets_each_name_linear_layers_of_the_full_size_clip(class_name: str, config: Any) -> None:
    """The text encoders' adapters (training.lora.text_encoder) take the image's fixed targets, never
    training.lora.target_modules, so Validate run has nothing of the user's to check there: each fixed target
    names Linear layers of SDXL's CLIP ViT-L and OpenCLIP ViT-bigG, and only those."""
    import torch
    import transformers

    from sdflow_image import families

    with torch.device("meta"):
        encoder = getattr(transformers, class_name)(transformers.CLIPTextConfig(**config))
    adaptable, other = lora_modules.split_names(
        (n, isinstance(m, supported())) for n, m in encoder.named_modules() if n
    )
    names = lora_modules.ModuleNames(adaptable, other)
    for family in ("sd", "sdxl"):
        for target in families.get(family).text_encoder_lora_targets:
            assert names.problem(target) is None, (family, target, names.problem(target))
