"""The accelerate backend on CPU: accelerate's DDP in one process and in two, torch's FSDP2 in two
(gloo), each through the image's real entrypoints (`bin/train` in one process; the launcher's
torchrun command, sdflow_image.training.elastic_run, for two processes on one host), with tiny models
built in code. The two-process runs are the costly part (each process imports torch 2.15 and
diffusers 0.42): one run per behaviour, several checks on each.

SD 3's tiny model trains without T5 (`sd3_t5=false`), the smaller run: the backend is what these
tests check; SD 3 with T5 on this stack runs in tests/e2e/test_accelerate_local.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import train_runs as runs
from train_runs import HP, SD3_HP, STEPS

from sdflow_image.backends import rules
from sdflow_image.training import train

# --- one process: accelerate's DDP plugin (no wrapper at world size 1), full fine-tune of SD ---


def test_train_accelerate_ddp_sd_full_ema_one_process_resumes_exactly_and_exports_pipeline_diffusers_loads(
    tmp_path: Path, bases: Callable[[str], Path], dataset: Path
) -> None:
    import torch
    from diffusers import StableDiffusionPipeline

    base = bases("sd")
    hp = {**HP, "plugin": "ddp", "max_train_steps": "3", "checkpointing_steps": "2", "use_ema": "true"}
    opt_ml = runs.job(tmp_path, "sd", hp, base, dataset)
    code, out = runs.run(opt_ml, 1)
    assert code == 0, out[-4000:]
    losses = runs.losses(out)
    assert sorted(losses) == [1, 2, 3]
    summary = runs.summary(opt_ml)
    assert (summary["backend"], summary["plugin"], summary["world_size"]) == ("accelerate", "ddp", 1)
    # The step-2 checkpoint (weights, optimizer, schedule, EMA) resumed: step 3 as the run trained it.
    assert runs.resumed_copy(tmp_path, opt_ml, hp, base, dataset, 1) == pytest.approx({3: losses[3]}, rel=1e-5)
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
    whole = runs.job(tmp, "whole", hp, base, dataset)
    whole_code, whole_out = runs.run(whole, 2)
    stopped = runs.job(tmp, "stopped", hp, base, dataset)
    # SIGTERM after step 1's line: the ranks stop after step 1 or 2 (whenever the signal lands).
    stop_code, stop_out = runs.run(stopped, 2, stop_at=1)
    resume_code, resume_out = runs.run(stopped, 2)
    return {"base": base, "whole": whole, "stopped": stopped, "codes": (whole_code, stop_code, resume_code),
            "outs": (whole_out, stop_out, resume_out)}  # fmt: skip


def test_train_fsdp2_two_processes_sigterm_then_resume_repeats_uninterrupted_losses(fsdp2_runs: dict) -> None:
    whole_out, stop_out, resume_out = fsdp2_runs["outs"]
    assert fsdp2_runs["codes"] == (0, train.EXIT_STOPPED, 0), "\n".join(o[-3000:] for o in fsdp2_runs["outs"])
    whole, stopped, resumed = runs.losses(whole_out), runs.losses(stop_out), runs.losses(resume_out)
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
    marker = json.loads((folder / "COMPLETE.host-0.json").read_text())  # one host: its marker lists every rank's
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
    summary = runs.summary(fsdp2_runs["whole"])
    assert (summary["backend"], summary["plugin"], summary["world_size"]) == ("accelerate", "fsdp2", 2)


# --- two processes, accelerate's DDP: LoRA --------------------------------------------------


def test_train_ddp_lora_two_processes_resumes_exactly_and_writes_adapter_the_pipeline_loads(
    tmp_path: Path, bases: Callable[[str], Path], dataset: Path
) -> None:
    from diffusers import StableDiffusion3Pipeline

    hp = {**SD3_HP, "training_method": "lora", "lora_rank": "4", "max_train_steps": "3", "checkpointing_steps": "2"}
    opt_ml = runs.job(tmp_path, "lora", hp, bases("sd3"), dataset)
    code, out = runs.run(opt_ml, 2)
    assert code == 0, out[-4000:]
    # Rank 0 alone writes the replicated state (adapter, optimizer, schedule); both ranks resume it.
    resumed = runs.resumed_copy(tmp_path, opt_ml, hp, bases("sd3"), dataset, 2)
    assert resumed == pytest.approx({3: runs.losses(out)[3]}, rel=1e-5)
    summary = runs.summary(opt_ml)
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
