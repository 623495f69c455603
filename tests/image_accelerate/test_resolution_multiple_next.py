"""The resolution multiple Validate run asks of each family (sdflow_common.model_checks.RESOLUTION_MULTIPLE) is the
real models' (the VAE's downsampling times the 2x2 latent patch the transformer takes), and a training step off that
multiple fails: the accelerate image's families."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sdflow_common import model_checks
from sdflow_image import families
from sdflow_image.builders import random_families, random_families_next
from tests.family_steps import one_step_loss

pytestmark = pytest.mark.image

# FLUX.2 [klein]'s transformer takes 1x1 patches of latents its pipeline first patchifies 2x2 (Flux2KleinPipeline.
# _patchify_latents, as the family's encode does); SD 3.5's and Qwen-Image's take patch_size 2 themselves.
PATCHIFIED = {"flux2": 2}


def vae_factor(vae: Any) -> int:
    """The pipelines' vae_scale_factor: 2 ** len(temperal_downsample) (Qwen-Image), else 2 ** (len(
    block_out_channels) - 1)."""
    config = vae.config
    if "temperal_downsample" in config:
        return int(2 ** len(config["temperal_downsample"]))
    return int(2 ** (len(config["block_out_channels"]) - 1))


def multiple(family: str, vae: Any, transformer_config: Any) -> int:
    return vae_factor(vae) * int(transformer_config.get("patch_size") or 1) * PATCHIFIED.get(family, 1)


def test_resolution_multiple_of_family_is_the_full_size_models() -> None:
    import diffusers
    import torch

    with torch.device("meta"):
        vaes = {
            "sd35": diffusers.AutoencoderKL(**random_families.SD3_VAE_CONFIG),
            "flux2": diffusers.AutoencoderKLFlux2(),
            "qwenimage": diffusers.AutoencoderKLQwenImage(),
        }
    transformers = {
        "sd35": random_families_next.SD35_LARGE_TRANSFORMER,
        "flux2": random_families_next.KLEIN_9B_TRANSFORMER,
        "qwenimage": random_families_next.QWENIMAGE_TRANSFORMER,
    }
    found = {family: multiple(family, vaes[family], transformers[family]) for family in vaes}
    assert found == {family: model_checks.RESOLUTION_MULTIPLE[family] for family in found}


@pytest.mark.parametrize("family", ["sd35", "flux2", "qwenimage"])
def test_training_step_off_the_multiple_fails(family: str, bases: Callable[[str], Path]) -> None:
    """On the tiny models (a VAE of fewer levels; SD 3.5's transformer rebuilt with the real patch size 2): a step on
    an odd number of latents fails, one on the multiple trains."""
    import torch

    parts = families.get(family).load_parts(str(bases(family)))
    if family == "sd35":
        parts.transformer = type(parts.transformer).from_config({**parts.transformer.config, "patch_size": 2})
    factor = vae_factor(parts.vae)
    needed = multiple(family, parts.vae, parts.transformer.config)
    assert needed == 2 * factor
    assert torch.isfinite(one_step_loss(family, parts, 3 * needed))
    with pytest.raises(RuntimeError, match=r"size|shape"):
        one_step_loss(family, parts, 3 * needed + factor)  # a multiple of the VAE's factor: an odd number of latents


@pytest.mark.parametrize("family", ["sd35", "flux2", "qwenimage"])
def test_training_image_resolution_multiple_equals_validate_runs_next(family: str) -> None:
    assert families.get(family).resolution_multiple == model_checks.RESOLUTION_MULTIPLE[family]
