"""The `train` job on CPU: tiny model, webdataset shards built in code, the real entrypoint.

Runs go through `bin/train` in a subprocess (as SageMaker would start it) with their own
$SDFLOW_OPT_ML, so the contract files, the launcher and the exit status are exercised.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from train_fixtures import gloo_world_of_one, index_in_channel, write_dataset_channel, write_job_config

from sdflow_image.builders.tiny_model import build_tiny_pipeline
from sdflow_image.training import train as train_module
from tests.helpers import free_port

pytestmark = pytest.mark.image

REPO = Path(__file__).resolve().parents[2]
BIN_TRAIN = REPO / "training_image" / "bin" / "train"
STEP_LINE = re.compile(r"^step=(\d+) loss=([0-9.eE+-]+)$", re.MULTILINE)
RUN_TIMEOUT = 240
# The channel as SageMaker lays out build_index's manifest for a resumed run: this run's index.json
# under `<run>/dataset/`, half of the shards reused from an earlier run's folder.
RUN, EARLIER_RUN = "cats-v2-0123456789", "cats-v1-9876543210"

BASE_HP = {
    "dataset_index": index_in_channel(RUN),
    "plugin": "torch_ddp",
    "mixed_precision": "no",
    "resolution": "64",
    "train_batch_size": "2",
    "gradient_accumulation_steps": "1",
    "gradient_checkpointing": "false",
    "learning_rate": "1e-4",
    "max_train_steps": "2",
    "checkpointing_steps": "100",
    "use_ema": "false",
    "seed": "0",
    "validation_prompts": '["a red square on a blue background"]',
    "validation_inference_steps": "2",
    "dataloader_num_workers": "0",
    "interleave_shards": "2",
}


@pytest.fixture(scope="session")
def tiny_base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny-base") / "model")


@pytest.fixture(scope="session")
def dataset_channel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset_channel(
        tmp_path_factory.mktemp("dataset"), shards=2, samples_per_shard=6, run=RUN, reused_from=EARLIER_RUN
    )


def _env(opt_ml: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(SDFLOW_OPT_ML=str(opt_ml), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **extra)
    # Two busy cores: one thread per process keeps the two-host run from thrashing.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _start(opt_ml: Path, **extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(BIN_TRAIN)],
        env=_env(opt_ml, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _run(opt_ml: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BIN_TRAIN)],
        env=_env(opt_ml, **extra),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )


def _steps(stdout: str) -> list[int]:
    return [int(m.group(1)) for m in STEP_LINE.finditer(stdout)]


# --- an interrupted run, then its resumption (one job, two attempts) ---------------------


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory: pytest.TempPathFactory, tiny_base_model: Path, dataset_channel: Path) -> dict:
    opt_ml = write_job_config(
        tmp_path_factory.mktemp("job") / "opt_ml",
        {**BASE_HP, "max_train_steps": "1000", "checkpointing_steps": "1000", "dataloader_num_workers": "1"},
        dataset_dir=dataset_channel,
        base_model_dir=tiny_base_model,
    )
    proc = _start(opt_ml)
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + RUN_TIMEOUT
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step=2 "):
            proc.send_signal(signal.SIGTERM)
            break
        assert time.monotonic() < deadline, "no step=2 line in time:\n" + "".join(lines[-30:])
    rest, _ = proc.communicate(timeout=RUN_TIMEOUT)
    return {"opt_ml": opt_ml, "returncode": proc.returncode, "stdout": "".join(lines) + rest}


@pytest.mark.slow
def test_train_sigterm_saves_checkpoint_and_exits_stopped(stopped_run: dict) -> None:
    assert stopped_run["returncode"] == train_module.EXIT_STOPPED, stopped_run["stdout"][-3000:]
    checkpoints = train_module.list_checkpoints(stopped_run["opt_ml"] / "checkpoints")
    assert checkpoints, stopped_run["stdout"][-3000:]
    step, path = checkpoints[-1]
    assert step >= 2
    assert step == max(_steps(stopped_run["stdout"]))
    assert json.loads((path / "trainer_state.json").read_text())["step"] == step
    # A stop is not a failure: no failure file, no model.
    assert not (stopped_run["opt_ml"] / "output" / "failure").exists()
    assert not (stopped_run["opt_ml"] / "model" / "model_index.json").exists()


@pytest.fixture(scope="module")
def resumed_run(stopped_run: dict) -> dict:
    opt_ml: Path = stopped_run["opt_ml"]
    stopped_at = train_module.list_checkpoints(opt_ml / "checkpoints")[-1][0]
    hp_file = opt_ml / "input" / "config" / "hyperparameters.json"
    hp = json.loads(hp_file.read_text())
    hp.update(max_train_steps=str(stopped_at + 2), checkpointing_steps="1", use_ema="true")
    hp_file.write_text(json.dumps(hp))
    result = _run(opt_ml)
    return {"opt_ml": opt_ml, "stopped_at": stopped_at, "result": result}


@pytest.mark.slow
def test_train_rerun_after_stop_resumes_from_checkpoint_step(resumed_run: dict) -> None:
    result = resumed_run["result"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    stopped_at = resumed_run["stopped_at"]
    assert f"at step {stopped_at}" in result.stdout
    assert _steps(result.stdout) == [stopped_at + 1, stopped_at + 2]
    summary = json.loads((resumed_run["opt_ml"] / "model" / "training_summary.json").read_text())
    assert summary["resumed_from_step"] == stopped_at
    assert summary["steps"] == stopped_at + 2
    assert summary["samples_seen"] == (stopped_at + 2) * 2  # batch 2, one rank, no accumulation
    # checkpointing_steps=1 made one more checkpoint; only the newest two are kept.
    kept = [s for s, _ in train_module.list_checkpoints(resumed_run["opt_ml"] / "checkpoints")]
    assert kept == [stopped_at, stopped_at + 1]


def _loader_args(opt_ml: Path) -> Any:
    hp = json.loads((opt_ml / "input" / "config" / "hyperparameters.json").read_text())
    data = opt_ml / "input" / "data"
    return train_module.parse_args(
        ["--dataset_dir", str(data / "dataset"), "--pretrained_model_name_or_path", str(data / "base_model")],
        hyperparameters=hp,
    )


@pytest.mark.slow
def test_train_resumed_run_continues_data_stream_where_it_stopped(resumed_run: dict) -> None:
    from transformers import CLIPTokenizer

    from sdflow_image.training.data import make_dataloader

    assert resumed_run["result"].returncode == 0, resumed_run["result"].stdout[-3000:]
    opt_ml, stopped_at = resumed_run["opt_ml"], resumed_run["stopped_at"]
    saved = {
        step: json.loads((path / "data_state_rank0.json").read_text())
        for step, path in train_module.list_checkpoints(opt_ml / "checkpoints")
    }
    args = _loader_args(opt_ml)
    tokenizer = CLIPTokenizer.from_pretrained(args.pretrained_model_name_or_path, subfolder="tokenizer")

    def position_after(batches: int) -> dict:
        loader = make_dataloader(args, tokenizer, rank=0, world_size=1)
        stream = iter(loader)
        for _ in range(batches):
            next(stream)
        return loader.state_dict()

    # One batch per step: the stream after step s+1 of the resumed run is the uninterrupted
    # stream's after s+1 batches (no repeats, no skips), not a fresh stream's after one batch.
    assert saved[stopped_at] == position_after(stopped_at)
    assert saved[stopped_at + 1] == position_after(stopped_at + 1)
    assert saved[stopped_at + 1] != position_after(1)


@pytest.mark.slow
def test_train_checkpoint_is_marked_complete_with_every_file_and_size(resumed_run: dict) -> None:
    _, path = train_module.list_checkpoints(resumed_run["opt_ml"] / "checkpoints")[-1]
    marker = json.loads((path / "COMPLETE.host-0.json").read_text())  # one host: its marker lists all
    on_disk = {p.relative_to(path).as_posix(): p.stat().st_size for p in path.rglob("*") if p.is_file()}
    on_disk.pop("COMPLETE.host-0.json")
    assert marker["files"] == on_disk
    assert {"trainer_state.json", "data_state_rank0.json", "optimizer.bin", "lr_scheduler.pt", "ema.pt"} <= set(on_disk)
    assert not list((resumed_run["opt_ml"] / ".checkpoints-staging").iterdir()), "staging is emptied by the rename"


@pytest.mark.slow
def test_train_single_process_writes_loadable_pipeline_and_summary(resumed_run: dict) -> None:
    import torch
    from diffusers import StableDiffusionPipeline
    from PIL import Image

    assert resumed_run["result"].returncode == 0, resumed_run["result"].stderr[-3000:]
    model_dir: Path = resumed_run["opt_ml"] / "model"
    summary = json.loads((model_dir / "training_summary.json").read_text())
    assert summary["plugin"] == "torch_ddp"
    assert summary["world_size"] == 1
    assert summary["samples_per_second"] > 0
    last_loss = float(STEP_LINE.findall(resumed_run["result"].stdout)[-1][1])
    assert summary["final_loss"] == pytest.approx(last_loss, rel=1e-4)
    assert list(model_dir.glob("unet/*.safetensors")), "the UNet must be saved as safetensors"
    info = json.loads((model_dir / "sdflow_model.json").read_text())
    assert info == {
        "format": 1,  # the contract with the orchestration (issue 21): family, method, base model URI
        "family": "sd",
        "method": "full",
        "base_model_uri": "",
        "resolution": 64,
        "dtype": "float32",
        "steps": summary["steps"],
        "base_model": str(resumed_run["opt_ml"] / "input" / "data" / "base_model"),
    }
    assert not list(model_dir.rglob("*.bin"))
    with Image.open(model_dir / "loss.png") as loss_png:
        assert loss_png.size[0] > 100
    with Image.open(model_dir / "samples.png") as samples_png:
        assert samples_png.size == (64, 64)  # one prompt at the training resolution
    # The same small outputs in the output data dir, which SageMaker ships as output.tar.gz.
    data_dir: Path = resumed_run["opt_ml"] / "output" / "data"
    assert sorted(p.name for p in data_dir.iterdir()) == ["loss.png", "samples.png", "training_summary.json"]
    for name in ("loss.png", "samples.png", "training_summary.json"):
        assert (data_dir / name).read_bytes() == (model_dir / name).read_bytes(), name

    pipe = StableDiffusionPipeline.from_pretrained(model_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    base = StableDiffusionPipeline.from_pretrained(resumed_run["opt_ml"] / "input" / "data" / "base_model")
    trained_w = next(iter(pipe.unet.parameters()))
    base_w = next(iter(base.unet.parameters()))
    assert not torch.equal(trained_w, base_w), "the saved UNet is the base UNet: training changed nothing"
    assert torch.equal(next(iter(pipe.vae.parameters())), next(iter(base.vae.parameters())))
    image = pipe("a red square", num_inference_steps=2, height=64, width=64, output_type="pil").images[0]
    assert image.size == (64, 64)


# --- two hosts emulated on localhost -------------------------------------------------------


@pytest.mark.slow
def test_train_two_hosts_torch_ddp_bf16_accumulating_rank0_writes_half_precision_model(
    tmp_path: Path, tiny_base_model: Path, dataset_channel: Path
) -> None:
    hosts = ["algo-1", "algo-2"]
    hp = {**BASE_HP, "mixed_precision": "bf16", "gradient_accumulation_steps": "2"}
    opt_mls = [
        write_job_config(
            tmp_path / host,
            hp,
            dataset_dir=dataset_channel,
            base_model_dir=tiny_base_model,
            hosts=hosts,
            current_host=host,
        )
        for host in hosts
    ]
    extra = {"SDFLOW_MASTER_ADDR": "127.0.0.1", "SDFLOW_MASTER_PORT": str(free_port())}
    procs = [_start(opt_ml, **extra) for opt_ml in opt_mls]
    outputs = [p.communicate(timeout=RUN_TIMEOUT)[0] for p in procs]
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-4000:]
    assert "--nnodes=2 --node_rank=1" in outputs[1]
    assert _steps(outputs[0]) == [1, 2]
    assert "world_size=2" in outputs[0]
    summary = json.loads((opt_mls[0] / "model" / "training_summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["samples_seen"] == 2 * 2 * 2 * 2  # steps x batch x ranks x accumulation
    assert (opt_mls[0] / "model" / "model_index.json").is_file()
    # Trained in bf16, saved in bf16 (half the bytes), and the metadata says so.
    assert json.loads((opt_mls[0] / "model" / "sdflow_model.json").read_text())["dtype"] == "bfloat16"
    from safetensors.torch import load_file

    unet_weights = load_file(next((opt_mls[0] / "model" / "unet").glob("*.safetensors")))
    assert {str(t.dtype) for t in unet_weights.values()} == {"torch.bfloat16"}
    assert not (opt_mls[1] / "model" / "model_index.json").exists(), "only rank 0 writes the model"
    assert (opt_mls[0] / "output" / "data" / "samples.png").is_file()
    assert not (opt_mls[1] / "output" / "data").exists(), "only rank 0 writes the output data"


# --- failures ---------------------------------------------------------------------------


def test_train_bad_hyperparameter_writes_failure_naming_it(
    tmp_path: Path, tiny_base_model: Path, dataset_channel: Path
) -> None:
    opt_ml = write_job_config(
        tmp_path / "opt_ml",
        {**BASE_HP, "learning_rate": "abc"},
        dataset_dir=dataset_channel,
        base_model_dir=tiny_base_model,
    )
    result = _run(opt_ml)
    assert result.returncode != 0
    failure = (opt_ml / "output" / "failure").read_text()
    assert "learning_rate='abc' is not a number" in failure


def test_train_missing_index_fails_with_channel_error(tmp_path: Path, tiny_base_model: Path) -> None:
    (tmp_path / "dataset").mkdir()
    args = train_module.parse_args(
        ["--dataset_dir", str(tmp_path / "dataset"), "--pretrained_model_name_or_path", str(tiny_base_model)],
        hyperparameters={},
    )
    with pytest.raises(train_module.ChannelError, match=r"index\.json is missing"):
        train_module.check_inputs(args, cuda=False)


@pytest.mark.parametrize(
    ("plugin", "stop"),
    [("gemini", "No usable kernel found for CPUAdamLoader"), ("low_level_zero", "device is required")],
)
def test_train_zero_plugin_on_cpu_fails_with_plugin_error_naming_colossalai_stop(
    tmp_path: Path, tiny_base_model: Path, dataset_channel: Path, plugin: str, stop: str
) -> None:
    args = train_module.parse_args(
        ["--dataset_dir", str(dataset_channel), "--pretrained_model_name_or_path", str(tiny_base_model)],
        hyperparameters={"plugin": plugin, "mixed_precision": "bf16", "dataset_index": index_in_channel(RUN)},
    )
    with pytest.raises(train_module.PluginError, match=f"plugin={plugin} needs CUDA") as caught:
        train_module.check_inputs(args, cuda=False)
    assert stop in str(caught.value)
    train_module.check_inputs(args, cuda=True)  # the same settings pass where CUDA is


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("train_batch_size", "four", "train_batch_size='four' is not an integer"),
        ("train_batch_size", "0", "train_batch_size='0' must be >= 1"),
        ("use_ema", "maybe", "use_ema='maybe' is not true or false"),
        ("plugin", "fsdp", "plugin='fsdp' is not one of torch_ddp, low_level_zero, gemini"),
        ("validation_prompts", "a cat", "validation_prompts='a cat' is not a JSON list"),
        ("learing_rate", "1e-4", "unknown hyperparameter 'learing_rate'"),
    ],
)
def test_parse_args_bad_hyperparameter_raises_naming_it(key: str, value: str, message: str) -> None:
    with pytest.raises(train_module.HyperparameterError) as caught:
        train_module.parse_args([], hyperparameters={key: value})
    assert message in str(caught.value)


def test_parse_args_strings_become_typed_and_cli_wins() -> None:
    args = train_module.parse_args(
        ["--max_train_steps", "7"],
        hyperparameters={"max_train_steps": "3", "learning_rate": "2e-5", "use_ema": "True", "sagemaker_x": "y"},
    )
    assert args.max_train_steps == 7
    assert args.learning_rate == pytest.approx(2e-5)
    assert args.use_ema is True


# --- EMA on Colossal-AI's pinned diffusers 0.29 + transformers 4.51 ----------------------------


def test_make_ema_step_averages_where_diffusers_own_step_raises(tiny_base_model: Path) -> None:
    import torch
    from diffusers import UNet2DConditionModel
    from diffusers.training_utils import EMAModel

    from sdflow_image.training import model

    unet = UNet2DConditionModel.from_pretrained(tiny_base_model, subfolder="unet")
    stock = EMAModel(unet.parameters(), decay=0.9)
    with pytest.raises(AttributeError, match="has no attribute deepspeed"):
        stock.step(unet.parameters())
    ema = model.make_ema(unet, 0.9, torch.device("cpu"))
    ema.step(unet.parameters())  # diffusers' warm-up: the first step's decay is 0
    before = [p.detach().clone() for p in ema.shadow_params]
    with torch.no_grad():
        for param in unet.parameters():
            param.add_(1.0)
    ema.step(unet.parameters())
    decay = ema.cur_decay_value
    assert 0 < decay < 1
    for old, new, param in zip(before, ema.shadow_params, unet.parameters(), strict=True):
        torch.testing.assert_close(new, old - (1 - decay) * (old - param.detach()))


def test_restore_ema_from_checkpoint_moves_average_to_training_device_in_fp32(
    tiny_base_model: Path, tmp_path: Path
) -> None:
    """A checkpoint's EMA is read on the CPU; left there, the next step on a GPU mixes devices.
    The meta device stands in for CUDA: where the average lands is what is checked."""
    import torch
    from diffusers import UNet2DConditionModel

    from sdflow_image.training import model

    unet = UNet2DConditionModel.from_pretrained(tiny_base_model, subfolder="unet")
    saved = model.make_ema(unet, 0.9, torch.device("cpu"))
    torch.save(saved.state_dict(), tmp_path / "ema.pt")
    resumed = model.make_ema(unet, 0.9, torch.device("cpu"))
    model.restore_ema(resumed, tmp_path / "ema.pt", unet.parameters(), torch.device("meta"))
    assert {(p.device.type, p.dtype) for p in resumed.shadow_params} == {("meta", torch.float32)}


def test_restore_ema_without_saved_state_starts_fp32_from_half_precision_weights(
    tiny_base_model: Path, tmp_path: Path
) -> None:
    """The ZeRO plugins' working weights are bf16: an average kept in bf16 cannot take a 0.9999
    decay's small updates, so the restarted average is fp32 copies of them."""
    import torch
    from diffusers import UNet2DConditionModel

    from sdflow_image.training import model

    unet = UNet2DConditionModel.from_pretrained(tiny_base_model, subfolder="unet")
    ema = model.make_ema(unet, 0.9999, torch.device("cpu"))
    unet.to(torch.bfloat16)
    model.restore_ema(ema, tmp_path / "missing.pt", unet.parameters(), torch.device("cpu"))
    assert {p.dtype for p in ema.shadow_params} == {torch.float32}
    for shadow, param in zip(ema.shadow_params, unet.parameters(), strict=True):
        torch.testing.assert_close(shadow, param.detach().float())


def test_build_pipeline_from_base_with_safety_checker_leaves_it_out(tiny_base_model: Path, tmp_path: Path) -> None:
    """SD 1.5's model_index lists a safety checker; the trained pipeline (samples, adherence, the
    saved model) must not carry it, as the server and the base side of the comparison do not."""
    import argparse
    import shutil

    import torch
    from diffusers import StableDiffusionPipeline
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
    from safetensors.torch import save_file
    from transformers import CLIPConfig, CLIPImageProcessor

    from sdflow_image.training import outputs

    small = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 1, "num_attention_heads": 4}
    checker = StableDiffusionSafetyChecker(
        CLIPConfig(text_config=small, vision_config={**small, "image_size": 32, "patch_size": 16}, projection_dim=32)
    )
    base = tmp_path / "base"
    shutil.copytree(tiny_base_model, base)
    pipe = StableDiffusionPipeline.from_pretrained(base, local_files_only=True)
    pipe.register_modules(safety_checker=checker, feature_extractor=CLIPImageProcessor())
    pipe.save_pretrained(base, safe_serialization=True)
    assert json.loads((base / "model_index.json").read_text())["safety_checker"][1] == "StableDiffusionSafetyChecker"
    weights = tmp_path / "unet.safetensors"
    save_file({k: v.contiguous() for k, v in pipe.unet.state_dict().items()}, str(weights))

    args = argparse.Namespace(pretrained_model_name_or_path=str(base), mixed_precision="no")
    trained = outputs.build_pipeline(args, weights, None)
    assert trained.safety_checker is None
    trained.save_pretrained(tmp_path / "out", safe_serialization=True)
    assert json.loads((tmp_path / "out" / "model_index.json").read_text())["safety_checker"] == [None, None]
    assert not (tmp_path / "out" / "safety_checker").exists()
    assert torch.equal(trained.unet.conv_in.weight, pipe.unet.conv_in.weight)


# --- cache_latents: each image and caption encoded once --------------------------------------


@pytest.mark.parametrize(("flip", "crop"), [("true", "true"), ("false", "false")])
def test_parse_args_cache_latents_with_changing_pixels_raises_naming_both(flip: str, crop: str) -> None:
    hp = {"cache_latents": "true", "random_flip": flip, "center_crop": crop}
    with pytest.raises(train_module.HyperparameterError, match=rf"random_flip={flip}, center_crop={crop}"):
        train_module.parse_args([], hyperparameters=hp)


def _cached_run(tmp: Path, base: Path, dataset: Path, cache: str) -> tuple[dict[str, Any], list[float]]:
    hp = {**BASE_HP, "max_train_steps": "14", "proportion_empty_prompts": "0.5", "cache_latents": cache}
    opt_ml = write_job_config(tmp / f"cache-{cache}", hp, dataset_dir=dataset, base_model_dir=base)
    done = _run(opt_ml)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((opt_ml / "model" / "training_summary.json").read_text())
    return summary, [float(m.group(2)) for m in STEP_LINE.finditer(done.stdout)]


def test_train_cache_latents_encodes_each_sample_once_and_trains_as_uncached(
    tmp_path: Path, tiny_base_model: Path, dataset_channel: Path
) -> None:
    """12 samples, batch 2, 14 steps: each encoded in the first epoch only; the step losses are
    those of the same run encoding at every step (same draws, empty prompts included)."""
    cached, cached_losses = _cached_run(tmp_path, tiny_base_model, dataset_channel, "true")
    assert cached["latent_cache"]["samples"] == 12
    assert (cached["latent_cache"]["misses"], cached["latent_cache"]["hits"]) == (12, 16)
    uncached, uncached_losses = _cached_run(tmp_path, tiny_base_model, dataset_channel, "false")
    assert uncached["latent_cache"] is None
    assert len(cached_losses) == len(uncached_losses) == 14
    assert cached_losses == pytest.approx(uncached_losses, rel=1e-5)


# --- early checks of the dataset index (the index itself: tests/image/test_data.py) ----------


def test_check_inputs_reads_index_at_dataset_index_hyperparameter(tiny_base_model: Path, dataset_channel: Path) -> None:
    args = train_module.parse_args(
        ["--dataset_dir", str(dataset_channel), "--pretrained_model_name_or_path", str(tiny_base_model)],
        hyperparameters={"dataset_index": index_in_channel(RUN)},
    )
    assert args.dataset_index == f"{RUN}/dataset/index.json"
    train_module.check_inputs(args, cuda=False)  # raises ChannelError when the index is not found
    default = train_module.parse_args(["--dataset_dir", str(dataset_channel)], hyperparameters={})
    assert default.dataset_index == "index.json"
    with pytest.raises(train_module.ChannelError, match="dataset_index"):
        train_module.check_inputs(
            train_module.parse_args(
                ["--dataset_dir", str(dataset_channel), "--pretrained_model_name_or_path", str(tiny_base_model)],
                hyperparameters={},
            ),
            cuda=False,
        )


def test_copy_report_puts_summary_and_images_in_output_data_dir_with_adherence_grid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sdflow_image import contract
    from sdflow_image.evaluation import adherence
    from sdflow_image.training import outputs

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in ("training_summary.json", "loss.png", "samples.png", adherence.GRID_FILE, "model_index.json"):
        (model_dir / name).write_bytes(name.encode())
    monkeypatch.setenv("SDFLOW_OPT_ML", str(tmp_path))
    data_dir = contract.output_data_dir()
    assert data_dir == tmp_path / "output" / "data"

    outputs.copy_report(model_dir, data_dir, [*outputs.REPORT_FILES, outputs.ADHERENCE_GRID])

    assert outputs.ADHERENCE_GRID == adherence.GRID_FILE
    assert {p.name: p.read_bytes() for p in data_dir.iterdir()} == {
        name: name.encode() for name in ("training_summary.json", "loss.png", "samples.png", "adherence.png")
    }, "the small outputs only, not the model"


def test_outputs_save_stages_unet_inside_the_model_folder_and_removes_it(tmp_path: Path) -> None:
    """/opt/ml/model is on the job's storage volume, /opt/ml beside it need not be (outputs.save)."""
    import argparse
    from types import SimpleNamespace

    from sdflow_image.training import outputs

    model_dir = tmp_path / "model"
    written: list[Path] = []

    def export(path: Path, _rank: int) -> None:
        written.append(Path(path))
        Path(path).write_bytes(b"unet")

    trainer = SimpleNamespace(
        rank=1,  # a rank that only writes its share and returns: no pipeline is built
        device="cpu",
        state=SimpleNamespace(losses=[], step=0),
        backend=SimpleNamespace(export=export),
        ema=None,
        release=lambda: None,
        family=None,
        lora=None,
    )
    with gloo_world_of_one():
        outputs.save(argparse.Namespace(output_dir=str(model_dir)), trainer, {})  # type: ignore[arg-type]
    assert written[0].parent.parent == model_dir.resolve()
    assert written[0].parent.name.startswith(".sdflow-unet-")
    assert list(model_dir.iterdir()) == [], "the staging folder is gone before the model is written"
    assert [p.name for p in tmp_path.iterdir()] == ["model"], "nothing staged beside the model folder"
