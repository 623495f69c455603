"""The memory estimate: its rules, its fit to the GPU acceptance's measured peaks, and its advice."""

from __future__ import annotations

import pytest

from sdflow_common import memory_estimate
from sdflow_common.memory_estimate import Setup, estimate, gpu_of, remedies

# README "GPU acceptance": SD 1.5, one H100, 512 px, batch 4, bf16, no gradient checkpointing.
MEASURED_LOW_LEVEL_ZERO_EMA_GIB = 20.01
MEASURED_GEMINI_GIB = 15.85


def sd15(**changes: object) -> Setup:
    values: dict[str, object] = {
        "family": "sd",
        "method": "full",
        "plugin": "low_level_zero",
        "precision": "bf16",
        "batch": 4,
        "resolution": 512,
    }
    return Setup(**(values | changes))  # type: ignore[arg-type]


def test_estimate_sd15_low_level_zero_with_ema_is_within_5_percent_of_measured() -> None:
    total = estimate(sd15(use_ema=True)).total_gib
    assert total == pytest.approx(MEASURED_LOW_LEVEL_ZERO_EMA_GIB, rel=0.05)


def test_estimate_sd15_gemini_is_within_5_percent_of_measured() -> None:
    assert estimate(sd15(plugin="gemini")).total_gib == pytest.approx(MEASURED_GEMINI_GIB, rel=0.05)


def test_estimate_sharding_plugins_shrink_states_with_more_gpus_and_ddp_does_not() -> None:
    for plugin in ("low_level_zero", "gemini"):
        assert estimate(sd15(plugin=plugin, gpus=8)).states_gib < estimate(sd15(plugin=plugin)).states_gib
    assert estimate(sd15(plugin="torch_ddp", gpus=8)).states_gib == estimate(sd15(plugin="torch_ddp")).states_gib


def test_estimate_activations_scale_with_batch_and_pixels_and_shrink_with_checkpointing() -> None:
    base = estimate(sd15()).activations_gib
    assert estimate(sd15(batch=8)).activations_gib == pytest.approx(2 * base)
    assert estimate(sd15(resolution=1024)).activations_gib == pytest.approx(4 * base)
    assert estimate(sd15(gradient_checkpointing=True)).activations_gib < base / 2


def test_estimate_lora_trains_megabytes_and_holds_the_base_frozen() -> None:
    lora = estimate(sd15(method="lora"))
    assert lora.states_gib < 0.05
    assert lora.frozen_gib > estimate(sd15()).frozen_gib
    assert lora.total_gib < estimate(sd15()).total_gib


def test_estimate_sdxl_full_unsharded_does_not_fit_24gb_and_lora_does() -> None:
    """diffusers' SDXL README: a full fine-tune needs sharding on 24 GB cards; LoRA fits one."""
    a10g = gpu_of("ml.g5.xlarge")
    assert a10g is not None
    full = Setup("sdxl", "full", "low_level_zero", "bf16", 1, 1024, gradient_checkpointing=True)
    lora = Setup("sdxl", "lora", "torch_ddp", "bf16", 1, 1024, gradient_checkpointing=True)
    assert not memory_estimate.fits(full, a10g)
    assert memory_estimate.fits(lora, a10g)


def test_remedies_of_too_large_batch_name_the_fields_to_change() -> None:
    a10g = gpu_of("ml.g5.xlarge")
    assert a10g is not None
    setup = sd15(batch=32, plugin="torch_ddp")
    found = " | ".join(remedies(setup, a10g, instance_count=1))
    assert "training.method lora" in found
    assert "training.instance_type" in found


def test_gpu_of_cpu_instance_type_is_none() -> None:
    assert gpu_of("ml.m5.xlarge") is None
    g5 = gpu_of("ml.g5.12xlarge")
    assert g5 is not None
    assert g5.count == 4


def test_estimate_sd3_without_t5_holds_less_frozen() -> None:
    with_t5 = Setup("sd3", "lora", "torch_ddp", "bf16", 1, 1024)
    without = Setup("sd3", "lora", "torch_ddp", "bf16", 1, 1024, with_t5=False)
    saved = estimate(with_t5).frozen_gib - estimate(without).frozen_gib
    assert saved == pytest.approx(memory_estimate.SD3_T5 * 2 / memory_estimate.GIB)
