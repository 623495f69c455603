"""bench/gpu_acceptance.py where no GPU is: its refusal, its flags, its SD 1.5-sized model, its report,
and the whole harness on the tiny model: two gloo processes under torchrun, stopped and resumed."""

from __future__ import annotations

import importlib.util
import json
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
        (["--steps", "3"], "--steps"),
        (["--batch-size", "four"], "--batch-size"),
        (["--plugins", "gemini,zero3"], "--plugins"),
        (["--precisions", "fp8"], "--precisions"),
        (["--data", "nfs"], "--data"),
        (["--family", "sd2"], "--family"),
        (["--method", "dora"], "--method"),
        (["--method", "lora", "--plugins", "low_level_zero"], "--plugins"),
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
    assert (args.steps, args.batch_size, args.data) == (12, 4, "s3")
    assert bench.parse_args(["--plugins", "gemini, torch_ddp,gemini"]).plugins == ["gemini", "torch_ddp"]
    assert bench.parse_args(["--family", "sdxl"]).plugins == ["low_level_zero", "gemini"]  # SDXL full: sharded
    assert bench.parse_args(["--family", "sd3", "--method", "lora"]).plugins == ["torch_ddp"]


def test_random_sd15_components_have_sd15_parameter_counts() -> None:
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from sdflow_image.builders import random_sd15

    with torch.device("meta"):  # shapes only: no 4.3 GB of random weights on the CPU
        parts: list[Any] = [
            UNet2DConditionModel(**random_sd15.UNET_CONFIG),
            AutoencoderKL(**random_sd15.VAE_CONFIG),
            CLIPTextModel(CLIPTextConfig(**random_sd15.TEXT_CONFIG)),
        ]
    counts = [sum(p.numel() for p in part.parameters()) for part in parts]
    assert counts == [random_sd15.UNET_PARAMETERS, random_sd15.VAE_PARAMETERS, random_sd15.TEXT_PARAMETERS]


def test_weight_difference_is_zero_for_a_copy_and_relative_l2_for_a_change(bench: ModuleType, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    a = {"w": torch.ones(4, 4), "b": torch.zeros(4)}
    for name, tensors in (("a", a), ("same", dict(a)), ("moved", {"w": torch.ones(4, 4) * 1.01, "b": torch.zeros(4)})):
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "diffusion_pytorch_model.safetensors"))
    assert bench.weight_difference(tmp_path / "a", tmp_path / "same") == 0.0
    assert bench.weight_difference(tmp_path / "a", tmp_path / "moved") == pytest.approx(0.01)


def test_report_failed_row_shows_why_and_the_kernel_time(bench: ModuleType) -> None:
    good = bench.Row("low_level_zero", "bf16", 1, 4, 6, True, samples_per_s_per_gpu=18.07, peak_gpu_gib=20.01,
                     checkpoint_s=16.4, stop_s=34.9, stopped_at=4, loss_diff=0.0, weight_diff=0.0)  # fmt: skip
    bad = bench.Row("gemini", "fp16", 1, 4, 6, False, checks=["saved UNet differs by 1.68e-03"])
    text = bench.report([good, bad], 95.2, None)
    lines = text.splitlines()
    assert lines[0] == "Colossal-AI Adam kernels load: 95.2 s"
    assert lines[3].split()[:8] == ["sd", "full", "low_level_zero", "bf16", "1", "4", "6", "on"]
    assert lines[3].endswith("ok")
    assert lines[4].endswith("FAILED: saved UNet differs by 1.68e-03")
    assert "FAILED: nvcc not found" in bench.report([good], float("nan"), "nvcc not found")


@pytest.mark.longest
def test_gpu_acceptance_tiny_two_processes_stop_with_dataloader_workers_and_resume_exactly(tmp_path: Path) -> None:
    """The harness end to end on CPU: torchrun over two gloo processes, each with DataLoader workers,
    shards on a local S3; SIGTERM to the launcher mid-run must leave a complete checkpoint and exit
    143, and the resumed run must log the uninterrupted run's losses and save its weights exactly."""
    result = tmp_path / "acceptance.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--tiny", "--nproc", "2", "--plugins", "torch_ddp", "--precisions", "bf16",
         "--steps", "4", "--data", "s3", "--work-dir", str(tmp_path / "work"), "--json", str(result)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = json.loads(result.read_text())["rows"]
    assert (row["plugin"], row["precision"], row["gpus"], row["ema"]) == ("torch_ddp", "bf16", 2, True)
    assert row["stopped_at"] >= 3
    assert (row["loss_diff"], row["weight_diff"]) == (0.0, 0.0)
    assert row["samples_per_s_per_gpu"] > 0
    assert not list((tmp_path / "work").glob("*/*/checkpoints"))  # bulky outputs go once compared


def test_gpu_acceptance_tiny_sd3_lora_row_trains_without_t5_and_saves_the_adapter_it_compares(
    bench: ModuleType, tmp_path: Path
) -> None:
    """The new rows' harness path, in process (the three torchrun launches of the test above take
    minutes per row on CPU): the family's base as the row builds it, the row's hyperparameters,
    and the file its weight check compares. SD 3 LoRA is the row that differs most: no T5
    (sd3_t5=false), an adapter instead of a denoiser, torch_ddp alone."""
    from family_fixtures import train_in_process

    args = bench.parse_args(["--tiny", "--family", "sd3", "--method", "lora", "--precisions", "bf16"])
    assert (args.plugins, bench.uses_ema("sd3", "lora", "torch_ddp")) == (["torch_ddp"], False)
    base, resolution = bench.build_base(tmp_path / "base", "sd3", True)
    assert not (base / "text_encoder_3").exists()
    shards = bench.write_shards(tmp_path / "dataset", resolution, shards=2, per_shard=4)
    hp = bench.hyperparameters(args, "torch_ddp", "bf16", base, str(shards), resolution)
    out = tmp_path / "model"
    train_in_process({**hp, "max_train_steps": "2", "checkpointing_steps": "1", "dataloader_num_workers": "0",
                      "output_dir": str(out), "checkpoints_dir": str(tmp_path / "checkpoints")})  # fmt: skip
    adapter = out / bench.saved_weights("sd3", "lora")
    assert adapter.is_file()
    assert not (out / "transformer").exists()
    assert json.loads((out / "sdflow_model.json").read_text())["left_out"] == ["text_encoder_3", "tokenizer_3"]
    assert bench.weight_difference(adapter, adapter) == 0.0


@pytest.mark.parametrize("family", ["sdxl", "sd3"])
def test_random_families_components_have_published_parameter_counts(family: str) -> None:
    import torch

    from sdflow_image.builders import random_families

    builders = {"sdxl": random_families.build_sdxl_components, "sd3": random_families.build_sd3_components}
    with torch.device("meta"):  # shapes only: no 11-14 GB of random weights on the CPU
        components = builders[family]()
    random_families.check_parameters(family, components)  # raises naming any that differ
    denoiser = components["unet" if family == "sdxl" else "transformer"]
    assert random_families.count(denoiser) == {"sdxl": 2_567_463_684, "sd3": 2_028_328_000}[family]
