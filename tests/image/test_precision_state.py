"""A checkpoint's loss scaler and low_level_zero's fp32 masters, saved and restored (on CPU, through
the attributes each plugin's optimizer keeps them in; bench/gpu_acceptance.py runs the plugins)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sdflow_image.training import precision_state
from sdflow_image.training.checkpoints import CheckpointError

pytestmark = pytest.mark.image


def test_torch_ddp_amp_grad_scaler_scale_survives_save_and_load(tmp_path: Path) -> None:
    before = SimpleNamespace(scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))
    before.scaler.scale(torch.ones(()))  # the scale tensor is made at first use
    before.scaler.update(new_scale=512.0)
    precision_state.save(tmp_path, "torch_ddp", before, [], rank=0)
    after = SimpleNamespace(scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))
    precision_state.load(tmp_path, "torch_ddp", after, [], rank=0)
    assert after.scaler.state_dict()["scale"] == 512.0


@pytest.fixture
def dynamic_scaler(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Colossal-AI's own DynamicGradScaler; its CPU accelerator has no device count or current device, so
    it is given them."""
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator
    from colossalai.amp.naive_amp.grad_scaler import DynamicGradScaler

    monkeypatch.setattr(CpuAccelerator, "get_current_device", lambda self: torch.device("cpu"))
    monkeypatch.setattr(CpuAccelerator, "device_count", lambda self: 1)
    return lambda: DynamicGradScaler(initial_scale=2**16, hysteresis=2)


@pytest.mark.parametrize("mixin", ["mixed_precision_mixin", "mix_precision_mixin"])  # low_level_zero, gemini
def test_zero_plugin_dynamic_scaler_scale_and_counters_survive_save_and_load(
    tmp_path: Path, mixin: str, dynamic_scaler: Any
) -> None:
    before = SimpleNamespace(**{mixin: SimpleNamespace(grad_scaler=dynamic_scaler())})
    scaler = getattr(before, mixin).grad_scaler
    for overflow in (True, True, True, False):  # hysteresis 2: the second overflow halves the scale
        scaler.update(overflow)
    assert scaler.scale.item() < 2**16
    precision_state.save(tmp_path, "gemini", before, [], rank=1)
    assert (tmp_path / "loss_scaler_rank1.pt").is_file()
    after = SimpleNamespace(**{mixin: SimpleNamespace(grad_scaler=dynamic_scaler())})
    precision_state.load(tmp_path, "gemini", after, [], rank=1)
    restored = getattr(after, mixin).grad_scaler
    assert restored.scale.item() == scaler.scale.item()
    assert (restored._growth_step, restored._hysteresis_step) == (scaler._growth_step, scaler._hysteresis_step)


def test_bf16_optimizer_without_scaler_writes_no_scaler_file(tmp_path: Path) -> None:
    precision_state.save(tmp_path, "torch_ddp", torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]), [], rank=0)
    assert list(tmp_path.iterdir()) == []


class ZeroLikeOptimizer:
    """low_level_zero's map from each working (bf16) parameter to this rank's fp32 master shard."""

    def __init__(self, working: list[torch.nn.Parameter], masters: list[torch.Tensor]) -> None:
        self._map = {id(p): m for p, m in zip(working, masters, strict=True)}

    def get_working_to_master_map(self) -> dict[int, torch.Tensor]:
        return self._map


def test_low_level_zero_fp32_masters_restored_exactly_not_from_half_precision_weights(tmp_path: Path) -> None:
    masters = [torch.randn(10) * 1e-3 + 1.0, torch.randn(6)]  # values bf16 cannot hold exactly
    working = [torch.nn.Parameter(m.to(torch.bfloat16)) for m in masters]
    precision_state.save(tmp_path, "low_level_zero", ZeroLikeOptimizer(working, masters), working, rank=0)
    # What Colossal-AI's load leaves: masters copied from the half-precision working weights.
    reloaded = [p.detach().float().clone() for p in working]
    assert not torch.equal(reloaded[0], masters[0])
    precision_state.load(tmp_path, "low_level_zero", ZeroLikeOptimizer(working, reloaded), working, rank=0)
    for restored, saved in zip(reloaded, masters, strict=True):
        assert torch.equal(restored, saved)


def test_low_level_zero_masters_from_another_model_raise_naming_the_mismatch(tmp_path: Path) -> None:
    working = [torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))]
    precision_state.save(tmp_path, "low_level_zero", ZeroLikeOptimizer(working, [torch.ones(4)]), working, rank=0)
    other = [torch.nn.Parameter(torch.ones(5, dtype=torch.bfloat16))]
    with pytest.raises(CheckpointError, match=r"fp32 master weights \(1 shards\) do not match"):
        precision_state.load(tmp_path, "low_level_zero", ZeroLikeOptimizer(other, [torch.ones(5)]), other, rank=0)
