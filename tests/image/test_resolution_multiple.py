"""The resolution multiple Validate run asks of each family (sdflow_common.model_checks.RESOLUTION_MULTIPLE) is the
real models' (the VAE's downsampling times the transformer's latent patch; a UNet takes any latent size), and a
training step off that multiple fails where the multiple says it does: the colossalai image's families."""

from __future__ import annotations

from typing import Any

import pytest

from sdflow_common import model_checks
from sdflow_image import families
from sdflow_image.builders import random_families, random_sd15
from tests.family_steps import one_step_loss

pytestmark = pytest.mark.image


def vae_factor(config: Any) -> int:
    """diffusers' pipelines' vae_scale_factor: 2 ** (len(block_out_channels) - 1)."""
    return int(2 ** (len(config["block_out_channels"]) - 1))


def multiple(vae_config: Any, denoiser_config: Any) -> int:
    """The pixel multiple a training step needs: the VAE's factor times the denoiser's latent patch (a UNet has
    none: its upsamplers take the skip connections' sizes)."""
    return vae_factor(vae_config) * int(denoiser_config.get("patch_size") or 1)


@pytest.mark.parametrize(
    ("family", "vae", "denoiser"),
    [
        ("sd", random_sd15.VAE_CONFIG, random_sd15.UNET_CONFIG),
        ("sdxl", random_families.SDXL_VAE_CONFIG, random_families.SDXL_UNET_CONFIG),
        ("sd3", random_families.SD3_VAE_CONFIG, random_families.SD3_TRANSFORMER_CONFIG),
    ],
)
def test_resolution_multiple_of_family_is_the_full_size_models(family: str, vae: Any, denoiser: Any) -> None:
    assert model_checks.RESOLUTION_MULTIPLE[family] == multiple(vae, denoiser)


def _parts(family: str, base: Any) -> Any:
    """The tiny model's parts; a transformer rebuilt with the real models' patch size 2 (the tiny one takes 1x1
    patches), its other settings kept."""
    fam = families.get(family)
    parts = fam.load_parts(str(base))
    if "patch_size" in parts.denoiser.config:
        parts.transformer = type(parts.denoiser).from_config({**parts.denoiser.config, "patch_size": 2})
    return parts


def _loss(family: str, parts: Any, size: int) -> Any:
    """One training step's loss on two `size`-pixel images, SDXL's size conditioning included."""
    return one_step_loss(family, parts, size, original_size=[[size, size]] * 2, crop_top_left=[[0, 0]] * 2)


@pytest.mark.parametrize("family", ["sd", "sdxl", "sd3"])
def test_training_step_off_the_multiple_fails_only_where_the_family_needs_a_patch(
    family: str, family_base: Any
) -> None:
    """On the tiny models (whose VAE has fewer levels, so a smaller factor): a step on an odd number of latents
    trains a UNet and fails a transformer of 2x2 patches; a step on the multiple trains either."""
    import torch

    parts = _parts(family, family_base(family))
    factor = vae_factor(parts.vae.config)
    needed = multiple(parts.vae.config, parts.denoiser.config)
    assert needed == factor * (2 if family == "sd3" else 1)
    assert torch.isfinite(_loss(family, parts, 3 * needed))
    off = 3 * needed + factor  # a multiple of the VAE's factor: an odd number of latents
    if family == "sd3":
        with pytest.raises(RuntimeError, match="size"):
            _loss(family, parts, off)
    else:
        assert torch.isfinite(_loss(family, parts, off))


@pytest.mark.parametrize("family", ["sd", "sdxl", "sd3"])
def test_training_image_resolution_multiple_equals_validate_runs(family: str) -> None:
    assert families.get(family).resolution_multiple == model_checks.RESOLUTION_MULTIPLE[family]


def test_training_job_resolution_off_family_multiple_refused_naming_nearest() -> None:
    """A job started directly (not through Validate run) at 40 px on a transformer family is refused before it
    loads anything, as Validate run refuses it, instead of failing at its first step."""
    from sdflow_image.training import train

    args = train.parse_args(["--resolution", "40"], hyperparameters={})
    args.model_family = "sd3"
    with pytest.raises(train.HyperparameterError, match=r"resolution=40 must be a multiple of 16 .* use 32 or 48"):
        train.check_family(args)
    args.model_family = "sdxl"
    train.check_family(args)  # 40 is on SDXL's multiple, 8
