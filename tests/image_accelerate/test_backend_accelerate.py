"""The accelerate backend on CPU: accelerate's DDP in one process and in two, torch's FSDP2 in two
(gloo), each through the image's real entrypoints (`bin/train` in one process; the launcher's
torchrun command, sdflow_image.elastic_run, for two processes on one host), with tiny models
built in code. The two-process runs are the costly part (each process imports torch 2.15 and
diffusers 0.42): one run per behaviour, several checks on each.

SD 3's tiny model trains without T5 (`sd3_t5=false`): its word-level T5 tokenizer does not load
as a T5TokenizerFast on transformers 5 (the families' own tests cover the families).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from train_fixtures import write_dataset_channel, write_job_config

from sdflow_image import launcher, tiny_families, tiny_model, train
from sdflow_image.backends import rules
from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]
BIN_TRAIN = REPO / "training_image" / "bin" / "train"
STEP_LINE = re.compile(r"^step=(\d+) loss=([0-9.eE+-]+)$", re.MULTILINE)
TIMEOUT = 240
STEPS = 4

HP = {
    "backend": "accelerate",
    "resolution": "32",
    "train_batch_size": "2",
    "learning_rate": "1e-3",
    "max_train_steps": str(STEPS),
    "checkpointing_steps": "100",
    "seed": "0",
    "validation_prompts": '["a red square on a blue background"]',
    "validation_inference_steps": "1",
    "dataloader_num_workers": "0",
    "interleave_shards": "2",
    "proportion_empty_prompts": "0.25",
}
SD3_HP = {**HP, "sd3_t5": "false"}


@pytest.fixture(scope="session")
def bases(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def base(family: str) -> Path:
        if family not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{family}") / "model"
            built[family] = (
                tiny_model.build_tiny_pipeline(folder) if family == "sd" else tiny_families.build_tiny(family, folder)
            )
        return built[family]

    return base


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset_channel(tmp_path_factory.mktemp("dataset"), shards=2, samples_per_shard=4, image_size=32)


def _env(opt_ml: Path) -> dict[str, str]:
    # Two processes on two cores: one thread each keeps them from thrashing.
    return {**os.environ, "SDFLOW_OPT_ML": str(opt_ml), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1"}  # fmt: skip


def _job(tmp: Path, name: str, hp: dict[str, str], base: Path, dataset: Path) -> Path:
    return write_job_config(tmp / name, hp, dataset_dir=dataset, base_model_dir=base)


def _start(opt_ml: Path, nproc: int) -> subprocess.Popen[str]:
    """`bin/train` for one process; for two, the launcher's torchrun command on this one host
    (the launcher itself starts one process per GPU, so one on a CPU host)."""
    if nproc == 1:
        command = [sys.executable, str(BIN_TRAIN)]
    else:
        topology = {"stop_grace_s": 60.0, "nnodes": 1, "node_rank": 0, "nproc_per_node": nproc,
                    "master_addr": "127.0.0.1", "master_port": free_port()}  # fmt: skip
        command = launcher.torchrun_command(topology, [])
    env = {**launcher.child_environment({}), **_env(opt_ml)}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _run(opt_ml: Path, nproc: int, stop_at: int | None = None) -> tuple[int, str]:
    """Exit status and output; with `stop_at`, SIGTERM once that step's line is printed."""
    proc = _start(opt_ml, nproc)
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + TIMEOUT
    if stop_at is not None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(f"step={stop_at} "):
                proc.send_signal(signal.SIGTERM)
                break
            assert time.monotonic() < deadline, "".join(lines[-40:])
    rest, _ = proc.communicate(timeout=TIMEOUT)
    return proc.returncode, "".join(lines) + rest


def _losses(out: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in STEP_LINE.finditer(out)}


def _summary(opt_ml: Path) -> dict[str, Any]:
    return json.loads((opt_ml / "model" / "training_summary.json").read_text())


def _resumed_copy(tmp: Path, done: Path, hp: dict[str, str], base: Path, dataset: Path, nproc: int) -> dict[int, float]:
    """A new attempt of a finished job, given the checkpoints it left (SageMaker's restart
    downloads them): it resumes from the newest and trains to the end; returns its step losses."""
    again = _job(tmp, f"{done.name}-again", hp, base, dataset)
    shutil.copytree(done / "checkpoints", again / "checkpoints")
    code, out = _run(again, nproc)
    assert code == 0, out[-4000:]
    assert "resumed from checkpoint" in out
    return _losses(out)


# --- one process: accelerate's DDP plugin (no wrapper at world size 1), full fine-tune of SD ---


def test_train_accelerate_ddp_sd_full_ema_one_process_resumes_exactly_and_exports_pipeline_diffusers_loads(
    tmp_path: Path, bases: Callable[[str], Path], dataset: Path
) -> None:
    import torch
    from diffusers import StableDiffusionPipeline

    base = bases("sd")
    hp = {**HP, "plugin": "ddp", "max_train_steps": "3", "checkpointing_steps": "2", "use_ema": "true"}
    opt_ml = _job(tmp_path, "sd", hp, base, dataset)
    code, out = _run(opt_ml, 1)
    assert code == 0, out[-4000:]
    losses = _losses(out)
    assert sorted(losses) == [1, 2, 3]
    summary = _summary(opt_ml)
    assert (summary["backend"], summary["plugin"], summary["world_size"]) == ("accelerate", "ddp", 1)
    # The step-2 checkpoint (weights, optimizer, schedule, EMA) resumed: step 3 as the run trained it.
    assert _resumed_copy(tmp_path, opt_ml, hp, base, dataset, 1) == pytest.approx({3: losses[3]}, rel=1e-5)
    pipe = StableDiffusionPipeline.from_pretrained(opt_ml / "model", local_files_only=True)
    trained = pipe.unet.state_dict()
    start = StableDiffusionPipeline.from_pretrained(base, local_files_only=True).unet.state_dict()
    assert any(not torch.equal(trained[k], start[k]) for k in start), "the exported UNet is the trained one"


# --- two processes, FSDP2 over gloo: stopped by SIGTERM, resumed, against an uninterrupted run ---


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory: pytest.TempPathFactory, bases: Callable[[str], Path], dataset: Path) -> dict:
    tmp, base = tmp_path_factory.mktemp("fsdp2"), bases("sd3")
    hp = {**SD3_HP, "plugin": "fsdp2", "mixed_precision": "bf16", "gradient_accumulation_steps": "2",
          "gradient_checkpointing": "true"}  # fmt: skip
    whole = _job(tmp, "whole", hp, base, dataset)
    whole_code, whole_out = _run(whole, 2)
    stopped = _job(tmp, "stopped", hp, base, dataset)
    # SIGTERM after step 1's line: the ranks stop after step 1 or 2 (whenever the signal lands).
    stop_code, stop_out = _run(stopped, 2, stop_at=1)
    resume_code, resume_out = _run(stopped, 2)
    return {"base": base, "whole": whole, "stopped": stopped, "codes": (whole_code, stop_code, resume_code),
            "outs": (whole_out, stop_out, resume_out)}  # fmt: skip


def test_train_fsdp2_two_processes_sigterm_then_resume_repeats_uninterrupted_losses(fsdp2_runs: dict) -> None:
    whole_out, stop_out, resume_out = fsdp2_runs["outs"]
    assert fsdp2_runs["codes"] == (0, train.EXIT_STOPPED, 0), "\n".join(o[-3000:] for o in fsdp2_runs["outs"])
    whole, stopped, resumed = _losses(whole_out), _losses(stop_out), _losses(resume_out)
    assert sorted(whole) == list(range(1, STEPS + 1))
    k = max(stopped)
    assert sorted(stopped) == list(range(1, k + 1))
    assert sorted(resumed) == list(range(k + 1, STEPS + 1))
    assert f"resumed from checkpoint {fsdp2_runs['stopped'] / 'checkpoints'}" in resume_out
    # Same draws, same data, fp32 masters and Adam state restored from the DCP shards: the same
    # losses, to float precision.
    assert {**stopped, **resumed} == pytest.approx(whole, rel=1e-5, abs=1e-7)


def test_train_fsdp2_checkpoint_is_dcp_with_a_shard_per_rank_and_the_completeness_marker(fsdp2_runs: dict) -> None:
    [(_, folder)] = train.list_checkpoints(fsdp2_runs["stopped"] / "checkpoints")  # the stop's
    marker = json.loads((folder / "COMPLETE.json").read_text())
    files = set(marker["files"])
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= files
    assert {"trainer_state.json", "lr_scheduler.pt", "data_state_rank0.json", "data_state_rank1.json"} <= files
    state = json.loads((folder / "trainer_state.json").read_text())
    assert (state["backend"], state["plugin"], state["world_size"]) == ("accelerate", "fsdp2", 2)


def test_train_fsdp2_exported_transformer_is_whole_and_loads_with_sd3_pipeline(fsdp2_runs: dict) -> None:
    import torch
    from diffusers import StableDiffusion3Pipeline

    out = fsdp2_runs["whole"] / "model"
    info = json.loads((out / "sdflow_model.json").read_text())
    assert (info["family"], info["method"], info["dtype"]) == ("sd3", "full", "bfloat16")
    pipe = StableDiffusion3Pipeline.from_pretrained(out, local_files_only=True, text_encoder_3=None, tokenizer_3=None)
    base = StableDiffusion3Pipeline.from_pretrained(
        fsdp2_runs["base"], local_files_only=True, text_encoder_3=None, tokenizer_3=None
    )
    trained, start = pipe.transformer.state_dict(), base.transformer.state_dict()
    assert set(trained) == set(start), "the full state dict, not a shard, under the model's own names"
    assert all(trained[k].shape == start[k].shape for k in start)
    assert any(not torch.equal(trained[k].float(), start[k].float()) for k in start)
    summary = _summary(fsdp2_runs["whole"])
    assert (summary["backend"], summary["plugin"], summary["world_size"]) == ("accelerate", "fsdp2", 2)


# --- two processes, accelerate's DDP: LoRA --------------------------------------------------


def test_train_ddp_lora_two_processes_resumes_exactly_and_writes_adapter_the_pipeline_loads(
    tmp_path: Path, bases: Callable[[str], Path], dataset: Path
) -> None:
    from diffusers import StableDiffusion3Pipeline

    hp = {**SD3_HP, "training_method": "lora", "lora_rank": "4", "max_train_steps": "3", "checkpointing_steps": "2"}
    opt_ml = _job(tmp_path, "lora", hp, bases("sd3"), dataset)
    code, out = _run(opt_ml, 2)
    assert code == 0, out[-4000:]
    # Rank 0 alone writes the replicated state (adapter, optimizer, schedule); both ranks resume it.
    resumed = _resumed_copy(tmp_path, opt_ml, hp, bases("sd3"), dataset, 2)
    assert resumed == pytest.approx({3: _losses(out)[3]}, rel=1e-5)
    summary = _summary(opt_ml)
    assert (summary["backend"], summary["plugin"], summary["world_size"]) == ("accelerate", "ddp", 2)
    model = opt_ml / "model"
    assert not (model / "model_index.json").exists(), "the adapter alone"
    pipe = StableDiffusion3Pipeline.from_pretrained(
        bases("sd3"), local_files_only=True, text_encoder_3=None, tokenizer_3=None
    )
    pipe.load_lora_weights(str(model), weight_name="pytorch_lora_weights.safetensors")
    assert any("lora" in name for name, _ in pipe.transformer.named_parameters())


# --- the rules (no torch) -----------------------------------------------------------------------


def test_rules_default_backend_and_plugin_by_family_and_method() -> None:
    assert [rules.default_backend(f) for f in ("sd", "sdxl", "sd3", "sd35", "flux2", "qwenimage")] == [
        "colossalai", "colossalai", "colossalai", "accelerate", "accelerate", "accelerate"
    ]  # fmt: skip
    assert rules.default_plugin("accelerate", "full") == "fsdp2"
    assert rules.default_plugin("accelerate", "lora") == "ddp"
    assert rules.default_plugin("colossalai", "lora") == "torch_ddp"


@pytest.mark.parametrize(
    ("family", "backend", "plugin", "method", "precision", "says"),
    [
        ("flux2", "colossalai", "torch_ddp", "full", "bf16", "diffusers 0.29.0"),
        ("sd3", "accelerate", "gemini", "full", "bf16", "plugin=gemini belongs to backend=colossalai"),
        ("sd", "colossalai", "fsdp2", "full", "no", "plugin=fsdp2 belongs to backend=accelerate"),
        ("sd35", "accelerate", "fsdp2", "lora", "bf16", "sharding saves nothing"),
        ("sd35", "accelerate", "ddp", "full", "fp16", "mixed_precision=fp16"),
    ],
)
def test_rules_refusal_impossible_pair_says_why(
    family: str, backend: str, plugin: str, method: str, precision: str, says: str
) -> None:
    reason = rules.refusal(family, backend, plugin, method, precision)
    assert reason is not None
    assert says in reason


def test_parse_args_backend_defaults_by_family_and_check_refuses_ema_under_fsdp2(
    bases: Callable[[str], Path], dataset: Path
) -> None:
    base = str(bases("sd3"))
    args = train.parse_args(["--pretrained_model_name_or_path", base, "--dataset_dir", str(dataset)], {})
    assert (args.backend, args.plugin) == ("colossalai", "torch_ddp")
    args = train.parse_args(["--pretrained_model_name_or_path", base, "--backend", "accelerate"], {"use_ema": "true"})
    assert args.plugin == "fsdp2"
    args.model_family = "sd3"
    with pytest.raises(train.PluginError, match="use_ema=true is not supported with plugin=fsdp2"):
        train.check_plugin(args, cuda=False)


def test_shard_units_are_the_outermost_blocks_never_nested(bases: Callable[[str], Path]) -> None:
    from diffusers import SD3Transformer2DModel, UNet2DConditionModel

    from sdflow_image.backends.accelerate import shard_units

    transformer = SD3Transformer2DModel.from_pretrained(bases("sd3"), subfolder="transformer")
    assert shard_units(transformer) == list(transformer.transformer_blocks)
    unet = UNet2DConditionModel.from_pretrained(bases("sd"), subfolder="unet")
    units = shard_units(unet)
    assert units[: len(unet.down_blocks)] == list(unet.down_blocks)
    assert set(unet.up_blocks) <= set(units)
    inner = {id(m) for unit in units for m in unit.modules() if m is not unit}
    assert not any(id(unit) in inner for unit in units), "a unit inside another would be sharded twice"
