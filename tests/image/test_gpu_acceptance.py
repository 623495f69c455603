"""bench/gpu_acceptance.py where no GPU is: its refusal, its flags, its model and its report."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.image

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "gpu_acceptance.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_acceptance", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_acceptance"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_gpu_acceptance_without_cuda_exits_2_with_one_line_saying_so() -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no CUDA device even where the runner has one
    done = subprocess.run(
        [sys.executable, str(BENCH), "--steps", "20", "--batch-size", "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "a CUDA device is needed" in lines[0]
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--steps", "0"], "--steps"),
        (["--batch-size", "four"], "--batch-size"),
        (["--warmup-steps", "-1"], "--warmup-steps"),
        (["--plugins", "gemini,zero3"], "--plugins"),
        (["--precisions", "fp8"], "--precisions"),
    ],
)
def test_parse_args_bad_flag_exits_2_naming_it(
    bench: ModuleType, argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        bench.parse_args(argv)
    assert exited.value.code == 2
    assert f"argument {named}" in capsys.readouterr().err


def test_parse_args_defaults_cover_every_plugin_and_precision(bench: ModuleType) -> None:
    args = bench.parse_args([])
    assert args.plugins == ["torch_ddp", "low_level_zero", "gemini"]
    assert args.precisions == ["fp16", "bf16"]
    assert (args.steps, args.batch_size) == (20, 4)
    assert bench.parse_args(["--plugins", "gemini, torch_ddp,gemini"]).plugins == ["gemini", "torch_ddp"]


def test_sd15_unet_config_builds_sd15_sized_unet(bench: ModuleType) -> None:
    import torch
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):  # shapes only: no 3.4 GB of random weights on the CPU
        unet: Any = UNet2DConditionModel(**bench.SD15_UNET_CONFIG)
    assert sum(p.numel() for p in unet.parameters()) == bench.SD15_UNET_PARAMETERS
    assert unet.config.cross_attention_dim == bench.TEXT_SHAPE[1]
    assert (unet.config.in_channels, unet.config.sample_size) == bench.LATENT_SHAPE[:2]


def _result(bench: ModuleType, plugin: str, precision: str, peak: float, **extra: object) -> object:
    fields: dict[str, object] = {
        "samples_per_s": 10.0,
        "peak_allocated_gib": peak,
        "peak_reserved_gib": peak + 1,
        "final_loss": 1.0,
    }
    fields.update(extra)
    return bench.Result(plugin, precision, 4, 2, 20, start_allocated_gib=0.0, **fields)


def test_report_gemini_fraction_is_its_peak_over_ddp_at_same_precision(bench: ModuleType) -> None:
    results = [
        _result(bench, "torch_ddp", "fp16", 20.0),
        _result(bench, "gemini", "fp16", 12.5),
        _result(bench, "torch_ddp", "bf16", 18.0),
        _result(bench, "gemini", "bf16", 9.0),
    ]
    assert bench.gemini_fractions(results) == {"fp16": 0.625, "bf16": 0.5}
    text = bench.report(results)
    assert "gemini peak memory / torch_ddp peak memory (fp16, batch 4/GPU, 2 GPU): 0.62" in text
    assert "(bf16, batch 4/GPU, 2 GPU): 0.50" in text


def test_report_failed_combination_shows_why_and_gives_no_fraction(bench: ModuleType) -> None:
    results = [
        _result(bench, "torch_ddp", "bf16", 18.0),
        _result(bench, "gemini", "bf16", float("nan"), error="AssertionError: boom"),
        _result(bench, "low_level_zero", "bf16", 14.0, final_loss=float("nan")),
    ]
    assert bench.gemini_fractions(results) == {}
    text = bench.report(results)
    assert "FAILED: AssertionError: boom" in text
    assert "FAILED: loss nan" in text
    assert "gemini peak memory" not in text
