"""Gradient accumulation under each plugin (sdflow_image/training/accumulation.py).

Colossal-AI's LowLevelZeroOptimizer cannot be built without CUDA (test_plugins.py pins where
it stops), so its no_sync and stage-2 paths are driven here on an instance made without its
__init__: the methods run are Colossal-AI 0.5.0's own. What needs a GPU (the collectives
counted, the memory of stage 1) is stated in the module docstring of accumulation.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from train_fixtures import gloo_world_of_one

from sdflow_image.backends import colossalai as booster_backend
from sdflow_image.training import accumulation, launcher

pytestmark = pytest.mark.image


@pytest.fixture(scope="module", autouse=True)
def process_group() -> Iterator[None]:
    with gloo_world_of_one():
        yield


def _bare_zero_optimizer(*, partition_grads: bool) -> Any:
    """A LowLevelZeroOptimizer with only the fields its backward and no_sync read."""
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    optimizer = object.__new__(LowLevelZeroOptimizer)
    optimizer._partition_grads = partition_grads
    optimizer.require_grad_sync = True
    optimizer.mixed_precision_mixin = None
    optimizer._backward_context = None
    optimizer.grad_handles = []  # read by its __del__
    return optimizer


def test_low_level_zero_stage2_backward_under_no_sync_asserts_in_colossalai() -> None:
    optimizer = _bare_zero_optimizer(partition_grads=True)
    loss = torch.ones((), requires_grad=True) * 2
    with optimizer.no_sync(), pytest.raises(AssertionError, match=r"ZeRO2.*no_sync are not compatible"):
        optimizer.backward(loss)


def test_colossalai_no_sync_support_stage1_only_and_never_gemini() -> None:
    from colossalai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin

    assert LowLevelZeroPlugin(stage=1).support_no_sync()
    assert not LowLevelZeroPlugin(stage=2).support_no_sync()
    assert not GeminiPlugin(precision="bf16").support_no_sync()


@pytest.mark.parametrize("mixed_precision", ["no", "bf16", "fp16"])
def test_make_plugin_low_level_zero_accumulating_is_stage1_with_no_sync(mixed_precision: str) -> None:
    plugin = booster_backend.make_plugin(
        "low_level_zero", mixed_precision, max_grad_norm=0.25, gradient_accumulation_steps=4
    )
    assert plugin.stage == 1
    assert plugin.zero_optim_kwargs["partition_grad"] is False
    assert plugin.support_no_sync()
    assert plugin.zero_optim_kwargs["clip_grad_norm"] == 0.25


@pytest.mark.parametrize(
    ("plugin", "steps", "world_size", "skips"),
    [
        ("torch_ddp", 2, 2, True),
        ("low_level_zero", 2, 8, True),
        ("low_level_zero", 1, 8, False),
        ("low_level_zero", 4, 1, False),
        ("gemini", 4, 8, False),
        ("torch_ddp", 1, 2, False),
    ],
)
def test_skips_sync_plugin_steps_world_matches_what_the_plugin_supports(
    plugin: str, steps: int, world_size: int, skips: bool
) -> None:
    assert accumulation.skips_sync(plugin, steps, world_size) is skips


def test_no_sync_low_level_zero_stage1_turns_off_the_optimizers_reduction() -> None:
    booster = booster_backend.make_booster("low_level_zero", "bf16", max_grad_norm=1.0, gradient_accumulation_steps=2)
    optimizer = _bare_zero_optimizer(partition_grads=False)
    with accumulation.no_sync(booster, object(), optimizer, skip=True):
        assert optimizer.require_grad_sync is False
    assert optimizer.require_grad_sync is True
    with accumulation.no_sync(booster, object(), optimizer, skip=False):
        assert optimizer.require_grad_sync is True


def test_no_sync_low_level_zero_stage1_backward_accumulates_without_reducing() -> None:
    booster = booster_backend.make_booster("low_level_zero", "no", max_grad_norm=1.0, gradient_accumulation_steps=2)
    optimizer = _bare_zero_optimizer(partition_grads=False)
    reduced: list[bool] = []
    optimizer._reduce_grad = reduced.append  # the collective: skipped under no_sync
    weight = torch.ones(3, requires_grad=True)
    with accumulation.no_sync(booster, object(), optimizer, skip=True):
        optimizer.backward((weight * 2).sum())
    assert reduced == []
    optimizer._overlap_communication = False
    optimizer.backward((weight * 3).sum())
    assert reduced == [False]  # once, unpartitioned (stage 1), over the summed gradient
    assert torch.equal(weight.grad, torch.full((3,), 5.0))


def test_communication_note_gemini_accumulating_says_each_micro_batch_communicates() -> None:
    note = accumulation.communication_note("gemini", 4, 8)
    assert note is not None
    assert "gemini has no no_sync" in note
    assert "4 times" in note
    assert accumulation.communication_note("gemini", 1, 8) is None
    assert accumulation.communication_note("low_level_zero", 4, 1) is None
    assert "ZeRO stage 1" in (accumulation.communication_note("low_level_zero", 2, 2) or "")


def test_launcher_main_gemini_accumulating_on_two_hosts_logs_the_cost(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sdflow_image.training import kernels

    config = tmp_path / "input" / "config"
    config.mkdir(parents=True)
    (config / "resourceconfig.json").write_text(json.dumps({"current_host": "algo-1", "hosts": ["algo-1", "algo-2"]}))
    (config / "hyperparameters.json").write_text("{}")
    monkeypatch.setenv("SDFLOW_OPT_ML", str(tmp_path))
    monkeypatch.setattr(kernels, "prepare", lambda plugin, cuda: None)
    monkeypatch.setattr(launcher, "run_torchrun", lambda topology, argv: 0)
    argv = ["--plugin", "gemini", "--mixed_precision", "bf16", "--gradient_accumulation_steps", "3"]
    assert launcher.main(argv) == 0
    assert "gradient accumulation: 3 micro-batches a step, and gemini has no no_sync" in capsys.readouterr().out
