"""Stable Diffusion text-to-image fine-tuning, in the shape of diffusers'
examples/text_to_image/train_text_to_image.py, distributed with one Colossal-AI Booster.

The UNet is trained on the noise-prediction loss; the VAE and the text encoder are frozen.
The plugin (torch_ddp | low_level_zero | gemini) is a hyperparameter; on CPU only torch_ddp
runs. Data streams from the webdataset shards listed in the dataset channel's index.json.

Flags come from `$SDFLOW_OPT_ML/input/config/hyperparameters.json` (strings, as SageMaker
writes them; each key is a flag's name) and the command line, which wins.

Exit status (`cli`): 0 done; 1 failed (the reason is in `$SDFLOW_OPT_ML/output/failure`);
143 stopped by SIGTERM after saving a checkpoint. A stop is not a failure, so it writes no
failure file: SageMaker reports a stopped job itself, and the next run of the same job
(spot restart, retry) resumes from that checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdflow_image import contract

log = logging.getLogger("sdflow.train")

PLUGINS = ("torch_ddp", "low_level_zero", "gemini")
MIXED_PRECISIONS = ("no", "fp16", "bf16")
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
EXIT_STOPPED = 128 + signal.SIGTERM
CHECKPOINT_PREFIX = "checkpoint-"
OPTIMIZER_FILE = "optimizer.bin"
DEFAULT_VALIDATION_PROMPTS = [
    "a photograph of an astronaut riding a horse",
    "a red square on a blue background",
]


class TrainConfigError(ValueError):
    """A flag or hyperparameter is wrong; the message names it and says what is allowed."""


class HyperparameterError(TrainConfigError):
    """A value in hyperparameters.json does not parse or is out of range."""


class ChannelError(TrainConfigError):
    """An input channel (dataset, base_model) is missing or incomplete."""


class PluginError(TrainConfigError):
    """The chosen plugin cannot run here or with these settings."""


class CheckpointError(RuntimeError):
    """A checkpoint to resume from cannot be used."""


class TrainingStopped(Exception):
    """SIGTERM arrived; a checkpoint at `step` was saved."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped by SIGTERM at step {step}; checkpoint saved")
        self.step = step


# ---------------------------------------------------------------------------------------
# Flags and hyperparameters
# ---------------------------------------------------------------------------------------


def _number(kind: type, minimum: float | None = None, exclusive: bool = False) -> Callable[[str], Any]:
    noun = "an integer" if kind is int else "a number"

    def convert(text: str) -> Any:
        try:
            value = kind(str(text).strip())
        except ValueError:
            raise ValueError(f"is not {noun}") from None
        if kind is float and not math.isfinite(value):
            raise ValueError("is not a finite number")
        if minimum is not None and (value <= minimum if exclusive else value < minimum):
            raise ValueError(f"must be {'>' if exclusive else '>='} {minimum:g}")
        return value

    convert.__name__ = kind.__name__
    return convert


def _bool(text: str) -> bool:
    value = str(text).strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise ValueError("is not true or false")


def _prompt_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError('is not a JSON list of strings (e.g. ["a cat", "a dog"])') from None
    if not isinstance(value, list) or not all(isinstance(p, str) and p.strip() for p in value):
        raise ValueError('is not a JSON list of non-empty strings (e.g. ["a cat", "a dog"])')
    return value


def _choice(options: tuple[str, ...]) -> Callable[[str], str]:
    def convert(text: str) -> str:
        value = str(text).strip()
        if value not in options:
            raise ValueError(f"is not one of {', '.join(options)}")
        return value

    convert.__name__ = "choice"
    return convert


class _Parser(argparse.ArgumentParser):
    """Raises instead of exiting, so a bad flag reaches the failure file like any error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise TrainConfigError(message)


def _argparse_type(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def wrapped(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} {exc}") from None

    wrapped.__name__ = convert.__name__
    return wrapped


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sdflow-train",
        description="Fine-tune a Stable Diffusion UNet on webdataset shards with a Colossal-AI Booster.",
    )
    add = parser.add_argument
    pos_int, nonneg_int = _number(int, 1), _number(int, 0)
    pos_float, nonneg_float = _number(float, 0, exclusive=True), _number(float, 0)
    options: list[tuple[str, Callable[[str], Any], Any, str]] = [
        (
            "pretrained_model_name_or_path",
            str,
            None,
            "base model folder (diffusers layout); default: the base_model channel",
        ),
        ("dataset_dir", str, None, "dataset channel folder holding index.json; default: the dataset channel"),
        (
            "dataset_index",
            str,
            "index.json",
            "index.json's path below dataset_dir (the pipeline's manifest channel: <run>/dataset/index.json)",
        ),
        ("output_dir", str, None, "where the fine-tuned pipeline goes; default: $SDFLOW_OPT_ML/model"),
        ("checkpoints_dir", str, None, "periodic checkpoints; default: $SDFLOW_OPT_ML/checkpoints"),
        (
            "plugin",
            _choice(PLUGINS),
            "torch_ddp",
            "Colossal-AI Booster plugin (low_level_zero, gemini need CUDA)",
        ),
        ("mixed_precision", _choice(MIXED_PRECISIONS), "no", "no | fp16 (CUDA) | bf16"),
        ("resolution", pos_int, 512, "training image size in pixels (square; multiple of 8)"),
        ("train_batch_size", pos_int, 4, "batch size per process"),
        ("gradient_accumulation_steps", pos_int, 1, "micro-batches per optimizer step"),
        ("gradient_checkpointing", _bool, False, "recompute UNet activations in backward to save memory"),
        ("learning_rate", pos_float, 1e-5, "AdamW learning rate"),
        ("lr_scheduler", _choice(LR_SCHEDULERS), "constant", "learning-rate schedule"),
        ("lr_warmup_steps", nonneg_int, 0, "warmup steps of the schedule"),
        ("adam_beta1", _number(float, 0), 0.9, "AdamW beta1"),
        ("adam_beta2", _number(float, 0), 0.999, "AdamW beta2"),
        ("adam_weight_decay", nonneg_float, 1e-2, "AdamW weight decay"),
        ("adam_epsilon", pos_float, 1e-8, "AdamW epsilon"),
        ("max_grad_norm", nonneg_float, 1.0, "gradient clipping norm (0 disables)"),
        ("max_train_steps", pos_int, 1000, "optimizer steps to train for (total, across resumes)"),
        ("checkpointing_steps", pos_int, 500, "save a resumable checkpoint every N optimizer steps"),
        ("checkpoints_total_limit", pos_int, 2, "keep only the newest N checkpoints"),
        ("use_ema", _bool, False, "keep an exponential moving average of the UNet and save that"),
        ("ema_decay", _number(float, 0), 0.9999, "EMA decay"),
        ("seed", nonneg_int, 0, "random seed"),
        ("noise_offset", nonneg_float, 0.0, "noise offset (0 disables)"),
        (
            "validation_prompts",
            _prompt_list,
            DEFAULT_VALIDATION_PROMPTS,
            "JSON list of prompts for samples.png",
        ),
        ("validation_inference_steps", pos_int, 25, "denoising steps for samples.png"),
        ("dataloader_num_workers", nonneg_int, 2, "DataLoader worker processes per training process"),
        ("shuffle_buffer", nonneg_int, 1000, "samples held in the streaming shuffle buffer (0/1 disables)"),
        ("center_crop", _bool, True, "center crop (true) or random crop (false) after resizing"),
        ("random_flip", _bool, False, "random horizontal flips"),
    ]
    for name, convert, default, help_text in options:
        kind = convert if convert is str else _argparse_type(convert)
        add(f"--{name}", type=kind, default=default, help=f"{help_text} (default: {default})")
    parser.set_defaults(_converters={name: convert for name, convert, _, _ in options})
    return parser


def hyperparameter_defaults(parser: argparse.ArgumentParser, hyperparameters: dict[str, str]) -> dict[str, Any]:
    """Typed values of hyperparameters.json, or HyperparameterError naming the key and value."""
    converters: dict[str, Callable[[str], Any]] = parser.get_default("_converters")
    typed: dict[str, Any] = {}
    for key, raw in hyperparameters.items():
        if key.startswith("sagemaker_"):
            continue  # SageMaker's own keys (framework containers add some)
        if key not in converters:
            raise HyperparameterError(f"unknown hyperparameter {key!r}; known: {', '.join(sorted(converters))}")
        convert = converters[key]
        if convert is str:
            typed[key] = raw
            continue
        try:
            typed[key] = convert(raw)
        except ValueError as exc:
            raise HyperparameterError(f"hyperparameter {key}={raw!r} {exc}") from None
    return typed


def parse_args(argv: list[str] | None = None, hyperparameters: dict[str, str] | None = None) -> argparse.Namespace:
    """Hyperparameters (default: hyperparameters.json) then `argv` (default: sys.argv[1:]) on top."""
    parser = build_parser()
    hp = contract.read_hyperparameters() if hyperparameters is None else hyperparameters
    parser.set_defaults(**hyperparameter_defaults(parser, hp))
    args = parser.parse_args(argv)
    del args._converters
    if args.resolution % 8:
        raise HyperparameterError(f"resolution={args.resolution} must be a multiple of 8 (e.g. 512)")
    if args.adam_beta1 >= 1 or args.adam_beta2 >= 1:
        raise HyperparameterError("adam_beta1 and adam_beta2 must be < 1")
    if args.ema_decay >= 1:
        raise HyperparameterError(f"ema_decay={args.ema_decay} must be < 1")
    args.pretrained_model_name_or_path = args.pretrained_model_name_or_path or str(contract.channel_dir("base_model"))
    args.dataset_dir = args.dataset_dir or str(contract.channel_dir("dataset"))
    args.output_dir = args.output_dir or str(contract.model_dir())
    args.checkpoints_dir = args.checkpoints_dir or str(contract.checkpoints_dir())
    return args


# ---------------------------------------------------------------------------------------
# Early checks (before the slow imports and the process group)
# ---------------------------------------------------------------------------------------


def check_inputs(args: argparse.Namespace, cuda: bool) -> None:
    from sdflow_image.data import DatasetIndexError, load_index

    base = Path(args.pretrained_model_name_or_path)
    if not base.is_dir():
        raise ChannelError(f"base model {base} does not exist: the training job needs a 'base_model' channel")
    missing = [
        p
        for p in ("model_index.json", "unet", "vae", "text_encoder", "tokenizer", "scheduler")
        if not (base / p).exists()
    ]
    if missing:
        raise ChannelError(
            f"base model {base} is not a diffusers StableDiffusionPipeline folder: missing {', '.join(missing)}"
        )
    try:
        load_index(args.dataset_dir, args.dataset_index)
    except DatasetIndexError as exc:
        raise ChannelError(str(exc)) from None
    if args.plugin in ("low_level_zero", "gemini") and not cuda:
        raise PluginError(f"plugin={args.plugin} needs CUDA GPUs; on CPU use plugin=torch_ddp")
    if args.mixed_precision == "fp16" and not cuda:
        raise PluginError("mixed_precision=fp16 needs a CUDA GPU; on CPU use bf16 or no")
    if args.plugin == "gemini" and args.mixed_precision == "no":
        raise PluginError("plugin=gemini trains in fp16 or bf16: set mixed_precision to fp16 or bf16")
    if args.plugin == "gemini" and args.use_ema:
        raise PluginError(
            "use_ema=true is not supported with plugin=gemini (its parameters live in sharded chunks); "
            "use low_level_zero or torch_ddp"
        )


# ---------------------------------------------------------------------------------------
# Process group
# ---------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def distributed(seed: int, cuda: bool) -> Iterator[None]:
    """One process group for the run: torchrun's, or a world of one set up here for in-process runs."""
    import colossalai
    import torch.distributed as dist

    added: list[str] = []
    if "RANK" not in os.environ:
        single = {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
        }
        for key, value in single.items():
            if key not in os.environ:
                os.environ[key] = value
                added.append(key)
    try:
        colossalai.launch_from_torch(backend="nccl" if cuda else "gloo", seed=seed, verbose=False)
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for key in added:
            os.environ.pop(key, None)


# ---------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------


@dataclass
class TrainState:
    step: int = 0
    samples_seen: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)
    resumed_from_step: int | None = None


class StopFlag:
    """Set by SIGTERM; the loop notices after the current optimizer step."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def _handle(self, signum: int, _frame: Any) -> None:
        self.requested = True
        print(f"received signal {signum}: saving a checkpoint after this step", file=sys.stderr, flush=True)

    def __enter__(self) -> StopFlag:
        import threading

        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def _rank_zero() -> bool:
    import torch.distributed as dist

    return dist.get_rank() == 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.get_world_size() > 1:
        dist.barrier()


def make_booster(args: argparse.Namespace) -> tuple[Any, Any]:
    """The Booster for `args.plugin`, and the autocast dtype the loop applies itself (or None)."""
    import torch
    from colossalai.booster import Booster

    if args.plugin == "torch_ddp":
        from colossalai.booster.plugin import TorchDDPPlugin

        # Booster's fp16 is torch AMP with a grad scaler; its bf16 is a stub in 0.5.0, so
        # bf16 is plain autocast in the loop (bf16 needs no scaler).
        booster = Booster(plugin=TorchDDPPlugin(), mixed_precision="fp16" if args.mixed_precision == "fp16" else None)
        return booster, (torch.bfloat16 if args.mixed_precision == "bf16" else None)
    precision = "fp32" if args.mixed_precision == "no" else args.mixed_precision
    if args.plugin == "low_level_zero":
        from colossalai.booster.plugin import LowLevelZeroPlugin

        plugin = LowLevelZeroPlugin(stage=2, precision=precision, max_norm=args.max_grad_norm)
    else:
        from colossalai.booster.plugin import GeminiPlugin

        plugin = GeminiPlugin(
            precision=precision,
            placement_policy="static",
            max_norm=args.max_grad_norm,
            enable_gradient_accumulation=args.gradient_accumulation_steps > 1,
        )
    return Booster(plugin=plugin), None


def _checkpoint_step(path: Path) -> int | None:
    if not path.name.startswith(CHECKPOINT_PREFIX) or not (path / "trainer_state.json").is_file():
        return None
    try:
        return int(path.name[len(CHECKPOINT_PREFIX) :])
    except ValueError:
        return None


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first (a partial one has no trainer_state.json)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if (step := _checkpoint_step(p)) is not None]
    return sorted(found)


@dataclass
class Trainer:
    args: argparse.Namespace
    booster: Any
    model: Any
    optimizer: Any
    lr_scheduler: Any
    ema: Any
    raw_unet: Any
    rank: int
    local_rank: int
    world_size: int
    state: TrainState = field(default_factory=TrainState)

    @property
    def samples_per_step(self) -> int:
        return self.args.train_batch_size * self.args.gradient_accumulation_steps * self.world_size

    def save_checkpoint(self) -> Path:
        """Collective. Written to a hidden folder, renamed when complete: a kill mid-save leaves no
        half checkpoint for the next run to trip over."""
        import torch

        root = Path(self.args.checkpoints_dir)
        step = self.state.step
        final = root / f"{CHECKPOINT_PREFIX}{step:08d}"
        partial = root / f".{CHECKPOINT_PREFIX}{step:08d}.partial"
        if self.local_rank == 0 and partial.exists():
            shutil.rmtree(partial)
        _barrier()
        partial.mkdir(parents=True, exist_ok=True)
        self.booster.save_model(self.model, str(partial / "unet"), shard=True, use_safetensors=True)
        if self.args.plugin == "torch_ddp":
            # Replicated state gains nothing from sharding, and colossalai 0.5.0's sharded
            # optimizer load calls an accelerator synchronize that the CPU accelerator lacks.
            self.booster.save_optimizer(self.optimizer, str(partial / OPTIMIZER_FILE), shard=False)
        else:
            self.booster.save_optimizer(self.optimizer, str(partial / "optimizer"), shard=True)
        if self.rank == 0:
            self.booster.save_lr_scheduler(self.lr_scheduler, str(partial / "lr_scheduler.pt"))
            if self.ema is not None:
                torch.save(self.ema.state_dict(), partial / "ema.pt")
            trainer_state = {
                "step": step,
                "samples_seen": self.state.samples_seen,
                "losses": self.state.losses,
                "plugin": self.args.plugin,
                "world_size": self.world_size,
            }
            (partial / "trainer_state.json").write_text(json.dumps(trainer_state))
        _barrier()
        if self.local_rank == 0 and partial.exists():
            with contextlib.suppress(FileNotFoundError):  # a shared folder: another host renamed it
                if not any(partial.iterdir()):
                    partial.rmdir()  # a host that wrote nothing (replicated plugins: rank 0 writes)
                else:
                    if final.exists():
                        shutil.rmtree(final)
                    os.replace(partial, final)
            for _old_step, old in list_checkpoints(root)[: -self.args.checkpoints_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        if self.rank == 0:
            print(f"saved checkpoint {final}", flush=True)
        return final

    def _load(self, path: Path) -> None:
        self.booster.load_model(self.model, str(path / "unet"))
        optimizer_file = path / OPTIMIZER_FILE
        optimizer_path = optimizer_file if optimizer_file.is_file() else path / "optimizer"
        self.booster.load_optimizer(self.optimizer, str(optimizer_path))
        self.booster.load_lr_scheduler(self.lr_scheduler, str(path / "lr_scheduler.pt"))

    def resume(self) -> None:
        """Continue from the newest checkpoint rank 0 sees, if any (collective)."""
        import torch
        import torch.distributed as dist

        found = list_checkpoints(self.args.checkpoints_dir)
        mine = found[-1][0] if found else -1
        steps: list[int] = [0] * self.world_size
        dist.all_gather_object(steps, mine)
        target = steps[0]
        if target < 0:
            return
        path = Path(self.args.checkpoints_dir) / f"{CHECKPOINT_PREFIX}{target:08d}"
        holders: list[bool] = [False] * self.world_size
        dist.all_gather_object(holders, path.is_dir())
        if all(holders):
            self._load(path)
        elif self.args.plugin == "torch_ddp":
            # Hosts with their own checkpoint folders (only rank 0 writes one): data-parallel
            # state is replicated, so rank 0 loads it and sends it to the others.
            if self.rank == 0:
                self._load(path)
            for tensor in list(self.model.parameters()) + list(self.model.buffers()):
                dist.broadcast(tensor.data, src=0)
            payload = [self.optimizer.state_dict(), self.lr_scheduler.state_dict()] if self.rank == 0 else [None, None]
            dist.broadcast_object_list(payload, src=0)
            if self.rank != 0:
                self.optimizer.load_state_dict(payload[0])
                self.lr_scheduler.load_state_dict(payload[1])
        else:
            lacking = [r for r, ok in enumerate(holders) if not ok]
            raise CheckpointError(
                f"checkpoint {path.name} is missing on rank(s) {lacking}: plugin={self.args.plugin} shards "
                "its state, so every host needs the whole checkpoints folder (SageMaker's sync does this)"
            )
        payload_state: list[Any] = [None]
        if self.rank == 0:
            payload_state = [json.loads((path / "trainer_state.json").read_text())]
            if self.ema is not None:
                ema_file = path / "ema.pt"
                if ema_file.is_file():
                    self.ema.load_state_dict(torch.load(ema_file, map_location="cpu", weights_only=False))
                else:
                    log.warning("checkpoint %s has no EMA state; EMA restarts from the resumed weights", path)
                    self.ema.shadow_params = [p.detach().clone() for p in self.raw_unet.parameters()]
        dist.broadcast_object_list(payload_state, src=0)
        saved = payload_state[0]
        self.state.step = int(saved["step"])
        self.state.samples_seen = int(saved["samples_seen"])
        self.state.losses = [(int(s), float(v)) for s, v in saved["losses"]]
        self.state.resumed_from_step = self.state.step
        if self.rank == 0:
            print(f"resumed from checkpoint {path} at step {self.state.step}", flush=True)


def _encode_batch(batch: dict[str, Any], vae: Any, text_encoder: Any, device: Any, generator: Any) -> tuple[Any, Any]:
    import torch

    with torch.no_grad():
        pixels = batch["pixel_values"].to(device, dtype=vae.dtype, non_blocking=True)
        latents = vae.encode(pixels).latent_dist.sample(generator=generator) * vae.config.scaling_factor
        hidden = text_encoder(batch["input_ids"].to(device, non_blocking=True), return_dict=False)[0]
    return latents, hidden


def compute_loss(
    model: Any,
    noise_scheduler: Any,
    latents: Any,
    encoder_hidden_states: Any,
    generator: Any,
    noise_offset: float = 0.0,
    autocast_dtype: Any = None,
) -> Any:
    """The epsilon (or v) prediction MSE of diffusers' text-to-image example."""
    import torch
    import torch.nn.functional as F

    device = latents.device
    noise = torch.randn(latents.shape, generator=generator, device=device, dtype=latents.dtype)
    if noise_offset:
        noise += noise_offset * torch.randn(
            (latents.shape[0], latents.shape[1], 1, 1),
            generator=generator,
            device=device,
            dtype=latents.dtype,
        )
    timesteps = torch.randint(
        0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],), generator=generator, device=device
    ).long()
    noisy = noise_scheduler.add_noise(latents, noise, timesteps)
    prediction_type = noise_scheduler.config.prediction_type
    if prediction_type == "epsilon":
        target = noise
    elif prediction_type == "v_prediction":
        target = noise_scheduler.get_velocity(latents, noise, timesteps)
    else:
        raise ValueError(f"unsupported prediction_type {prediction_type!r} in the base model's scheduler")
    dtype = next(model.parameters()).dtype
    ctx = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with ctx:
        pred = model(noisy.to(dtype), timesteps, encoder_hidden_states.to(dtype), return_dict=False)[0]
    return F.mse_loss(pred.float(), target.float(), reduction="mean")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Train, save the pipeline and the summary; returns the summary. Raises on failure,
    TrainingStopped on SIGTERM (after a checkpoint)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    cuda = torch.cuda.is_available()
    check_inputs(args, cuda)
    with StopFlag() as stop, distributed(args.seed, cuda):
        return _train(args, stop, cuda)


def _train(args: argparse.Namespace, stop: StopFlag, cuda: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from diffusers.optimization import get_scheduler
    from transformers import CLIPTextModel, CLIPTokenizer

    from sdflow_image.data import EmptyStreamError, make_dataloader

    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    base = args.pretrained_model_name_or_path
    tokenizer = CLIPTokenizer.from_pretrained(base, subfolder="tokenizer", local_files_only=True)
    text_encoder = CLIPTextModel.from_pretrained(base, subfolder="text_encoder", local_files_only=True)
    vae = AutoencoderKL.from_pretrained(base, subfolder="vae", local_files_only=True)
    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet", local_files_only=True)
    noise_scheduler = DDPMScheduler.from_pretrained(base, subfolder="scheduler", local_files_only=True)

    # Frozen parts run in the training precision on GPU (as diffusers' example does); on
    # CPU they stay fp32, which is what CPU kernels are fast at.
    frozen_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.mixed_precision, torch.float32)
    frozen_dtype = frozen_dtype if cuda else torch.float32
    frozen: Any
    for frozen in (vae, text_encoder):
        frozen.requires_grad_(False)
        frozen.eval()
        frozen.to(device, dtype=frozen_dtype)
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    unet.train()

    ema = None
    if args.use_ema and rank == 0:
        from diffusers.training_utils import EMAModel

        ema = EMAModel(
            unet.parameters(), decay=args.ema_decay, model_cls=UNet2DConditionModel, model_config=unet.config
        )
        ema.to(device)

    optimizer = torch.optim.AdamW(
        unet.parameters(),
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.adam_weight_decay,
        eps=args.adam_epsilon,
    )
    lr_scheduler = get_scheduler(
        args.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=args.lr_warmup_steps,
        num_training_steps=args.max_train_steps,
    )
    booster, autocast_dtype = make_booster(args)
    model, optimizer, _, _, lr_scheduler = booster.boost(unet, optimizer, lr_scheduler=lr_scheduler)

    trainer = Trainer(args, booster, model, optimizer, lr_scheduler, ema, unet, rank, local_rank, world_size)
    trainer.resume()
    state = trainer.state

    loader, index = make_dataloader(
        args.dataset_dir,
        tokenizer,
        resolution=args.resolution,
        batch_size=args.train_batch_size,
        rank=rank,
        world_size=world_size,
        num_workers=args.dataloader_num_workers,
        shuffle_buffer=args.shuffle_buffer,
        # A resumed run reshuffles differently rather than replaying the same first samples.
        seed=args.seed + 7919 * state.step,
        center_crop=args.center_crop,
        random_flip=args.random_flip,
        index_path=args.dataset_index,
    )
    generator = torch.Generator(device=device).manual_seed(args.seed * 100_003 + rank * 1_009 + state.step)
    if rank == 0:
        print(
            f"training: plugin={args.plugin} world_size={world_size} device={device} "
            f"shards={len(index.shards)} samples={index.total_samples} start_step={state.step} "
            f"max_train_steps={args.max_train_steps}",
            flush=True,
        )

    batches = iter(loader)
    use_no_sync = args.plugin == "torch_ddp" and world_size > 1
    start_step, train_time, first_step_time, checkpoint_time = state.step, 0.0, 0.0, 0.0
    step_times: list[float] = []
    last_saved = state.step if state.resumed_from_step is not None else -1
    stopped = False
    try:
        while state.step < args.max_train_steps:
            t_step = time.perf_counter()
            total = torch.zeros((), device=device)
            for micro in range(args.gradient_accumulation_steps):
                try:
                    batch = next(batches)
                except StopIteration:
                    raise EmptyStreamError(
                        f"rank {rank} got no full batch of {args.train_batch_size} from its share of "
                        f"{len(index.shards)} shard(s): fewer usable samples than ranks x workers x batch"
                    ) from None
                latents, hidden = _encode_batch(batch, vae, text_encoder, device, generator)
                sync_off = use_no_sync and micro < args.gradient_accumulation_steps - 1
                with booster.no_sync(model, optimizer) if sync_off else contextlib.nullcontext():
                    loss = compute_loss(
                        model, noise_scheduler, latents, hidden, generator, args.noise_offset, autocast_dtype
                    )
                    booster.backward(loss / args.gradient_accumulation_steps, optimizer)
                total += loss.detach() / args.gradient_accumulation_steps
            if args.plugin == "torch_ddp" and args.max_grad_norm > 0:
                optimizer.clip_grad_by_norm(args.max_grad_norm)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            if ema is not None:
                ema.step(unet.parameters())
            state.step += 1
            state.samples_seen += trainer.samples_per_step
            # One collective per step carries both the loss and any rank's stop request.
            stats = torch.stack([total.float(), torch.tensor(float(stop.requested), device=device)])
            if world_size > 1:
                dist.all_reduce(stats)
            loss_value = float(stats[0]) / world_size
            stop_now = float(stats[1]) > 0
            state.losses.append((state.step, loss_value))
            elapsed = time.perf_counter() - t_step
            train_time += elapsed
            step_times.append(elapsed)
            if state.step == start_step + 1:
                first_step_time = elapsed
            if rank == 0:
                print(f"step={state.step} loss={loss_value:.6f}", flush=True)
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"loss is {loss_value} at step {state.step}; lower learning_rate")
            due = state.step % args.checkpointing_steps == 0 and state.step < args.max_train_steps
            # A stop on the last step just finishes: saving the model takes no longer than a checkpoint.
            stop_now = stop_now and state.step < args.max_train_steps
            if due or stop_now:
                t_ckpt = time.perf_counter()
                trainer.save_checkpoint()
                last_saved = state.step
                checkpoint_time += time.perf_counter() - t_ckpt
            if stop_now:
                stopped = True
                break
    finally:
        del batches, loader
    if stopped:
        if last_saved != state.step:
            trainer.save_checkpoint()
        raise TrainingStopped(state.step)

    steps_run = state.step - start_step
    samples_run = steps_run * trainer.samples_per_step
    summary: dict[str, Any] = {
        "final_loss": state.losses[-1][1] if state.losses else None,
        "steps": state.step,
        "samples_seen": state.samples_seen,
        "samples_per_second": samples_run / train_time if train_time else None,
        "steady_samples_per_second": (
            (samples_run - trainer.samples_per_step) / (train_time - first_step_time) if steps_run > 1 else None
        ),
        # The median step is robust to other load on the machine; bench/bench_train.py uses it.
        "median_samples_per_second": (
            trainer.samples_per_step / statistics.median(step_times[1:] or step_times) if step_times else None
        ),
        "train_time_s": train_time,
        "checkpoint_time_s": checkpoint_time,
        "plugin": args.plugin,
        "world_size": world_size,
        "mixed_precision": args.mixed_precision,
        "resumed_from_step": state.resumed_from_step,
        "steps_this_run": steps_run,
        "train_batch_size": args.train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "learning_rate": args.learning_rate,
        "resolution": args.resolution,
        "use_ema": args.use_ema,
        "device": str(device),
    }
    save_outputs(args, booster, model, ema, state, summary, device)
    return summary


def save_outputs(
    args: argparse.Namespace,
    booster: Any,
    model: Any,
    ema: Any,
    state: TrainState,
    summary: dict[str, Any],
    device: Any,
) -> None:
    """The fine-tuned pipeline, summary JSON, loss curve and samples (collective; rank 0 writes)."""
    import torch
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from safetensors.torch import load_file

    out = Path(args.output_dir)
    rank0 = _rank_zero()
    # Staged next to the model folder (the job's big volume, and not the synced checkpoints
    # folder); save_model gathers sharded weights (gemini) onto rank 0, which reads them back.
    staging = Path(args.output_dir).resolve().parent
    staging.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".sdflow-unet-", dir=staging) as tmp:
        weights = Path(tmp) / "unet.safetensors"
        booster.save_model(model, str(weights), shard=False, use_safetensors=True)
        _barrier()
        if not rank0:
            return
        unet = UNet2DConditionModel.from_pretrained(
            args.pretrained_model_name_or_path,
            subfolder="unet",
            local_files_only=True,
            torch_dtype=torch.float32,
        )
        unet.load_state_dict({k: v.float() for k, v in load_file(str(weights)).items()})
    if ema is not None:
        ema.copy_to(unet.parameters())
    pipe = StableDiffusionPipeline.from_pretrained(args.pretrained_model_name_or_path, unet=unet, local_files_only=True)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    write_loss_plot(state.losses, out / "loss.png")
    write_samples(pipe, args, device, out / "samples.png")
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2))
    print(f"saved model to {out}", flush=True)


def write_loss_plot(losses: list[tuple[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    if losses:
        steps, values = zip(*losses, strict=True)
        ax.plot(steps, values, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_samples(pipe: Any, args: argparse.Namespace, device: Any, path: Path) -> None:
    """One image per validation prompt, in a grid."""
    import torch
    from PIL import Image

    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    images = []
    for prompt in args.validation_prompts:
        with torch.no_grad():
            result = pipe(
                prompt,
                num_inference_steps=args.validation_inference_steps,
                height=args.resolution,
                width=args.resolution,
                generator=generator,
            )
        images.append(result.images[0])
    columns = min(4, len(images))
    rows = math.ceil(len(images) / columns)
    width, height = images[0].size
    grid = Image.new("RGB", (columns * width, rows * height), "white")
    for i, image in enumerate(images):
        grid.paste(image, ((i % columns) * width, (i // columns) * height))
    grid.save(path)


def cli(argv: list[str] | None = None) -> int:
    """Entry point: the exit status per the module docstring."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        summary = main(parse_args(argv))
    except TrainingStopped as stopped:
        print(str(stopped), file=sys.stderr, flush=True)
        return EXIT_STOPPED
    except Exception as exc:
        return contract.fail(exc)
    if summary:
        print(json.dumps({"final_loss": summary["final_loss"], "steps": summary["steps"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
