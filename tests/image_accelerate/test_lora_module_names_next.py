"""The LoRA target names Validate run accepts (sdflow_common.lora_module_names, lora_modules) are those of the real
transformers of the accelerate image's families, built at full size on the meta device (nothing allocated): SD 3.5
Large and Medium, FLUX.2 [klein] 9B and 4B, Qwen-Image; and peft, as the image calls it, takes a target exactly
when Validate run does."""

from __future__ import annotations

from typing import Any

import pytest

from sdflow_common import lora_modules
from sdflow_image.builders import random_families_next as rf
from tests.lora_probes import peft_problem, split_module_names

pytestmark = pytest.mark.image

# (family, variant as model_family.BaseModelIndex.variant, class, transformer/config.json)
MODELS = {
    "sd35-large": ("sd35", "", "SD3Transformer2DModel", rf.SD35_LARGE_TRANSFORMER),
    "sd35-medium": ("sd35", "medium", "SD3Transformer2DModel", rf.SD35_MEDIUM_TRANSFORMER),
    "flux2-klein-9b": ("flux2", "", "Flux2Transformer2DModel", rf.KLEIN_9B_TRANSFORMER),
    "flux2-klein-4b": ("flux2", "4b", "Flux2Transformer2DModel", rf.KLEIN_4B_TRANSFORMER),
    "qwenimage": ("qwenimage", "", "QwenImageTransformer2DModel", rf.QWENIMAGE_TRANSFORMER),
}
# Targets whose peft outcome the test compares with Validate run's: one module of a kind peft adapts, a ModuleList
# (`to_out` of a double block; FLUX.2's single blocks name a Linear so), containers, an index, a misspelling.
PROBES = {
    "sd35": ["context_embedder", "to_out", "attn", "0", "attn2.to_q", "to_qq"],
    "flux2": ["x_embedder", "to_out", "single_transformer_blocks.0.attn.to_out", "attn", "0", "to_qq"],
    "qwenimage": ["img_in", "to_out", "img_mod.1", "img_mod", "0", "to_qq"],
}


def supported() -> tuple[type, ...]:
    """The classes peft 0.21 adapts (its "only the following modules are supported" list)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    nn = torch.nn
    return (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention, Conv1D)


@pytest.fixture(scope="module", params=list(MODELS))
def denoiser(request: pytest.FixtureRequest) -> tuple[str, str, Any]:
    import diffusers
    import torch

    family, variant, class_name, config = MODELS[request.param]
    with torch.device("meta"):
        return family, variant, getattr(diffusers, class_name)(**config)


def test_lora_module_names_of_family_equal_the_full_size_model_on_meta(denoiser: tuple[str, str, Any]) -> None:
    family, variant, model = denoiser
    adaptable, other = split_module_names(model, supported())
    held = lora_modules.module_names(family, variant)
    assert held is not None
    # On a mismatch (a diffusers upgrade), paste these into lora_module_names:
    assert held.adaptable == adaptable, lora_modules.compress(adaptable)
    assert held.other == other, lora_modules.compress(other)


def test_peft_takes_a_target_exactly_when_validate_run_accepts_it(denoiser: tuple[str, str, Any]) -> None:
    """The image's add_adapter is peft's inject_adapter_in_model with LoraConfig(target_modules=[...])."""
    family, variant, model = denoiser
    held = lora_modules.module_names(family, variant)
    assert held is not None
    for target in PROBES[family]:
        refused = peft_problem(model, target)
        assert (refused is None) == (held.problem(target) is None), (target, refused, held.problem(target))
