"""The process group, the training steps, SIGTERM and resuming.

One Booster for every plugin (diffusers' text-to-image loop, Colossal-AI's Booster API). A step
is `gradient_accumulation_steps` micro-batches; one all-reduce per step carries the loss and any
rank's stop request, so every rank stops after the same step and saves the same checkpoint.
A checkpoint holds the boosted UNet and optimizer, the schedule, the EMA, the trainer's state
and each rank's data position (`data_state_rank<r>.json`), so a resumed run continues the data
stream exactly where it stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import signal
import socket
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdflow_image import families
from sdflow_image.families.base import Encoded, detect_family
from sdflow_image.training import accumulation, checkpoints, lora, model, precision_state
from sdflow_image.training.checkpoints import CheckpointError
from sdflow_image.training.encode_cache import EncodeCache

log = logging.getLogger("sdflow.train")


class TrainingStopped(Exception):
    """SIGTERM arrived; a checkpoint at `step` was saved."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped by SIGTERM at step {step}; checkpoint saved")
        self.step = step


@dataclass
class TrainState:
    step: int = 0
    samples_seen: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)
    resumed_from_step: int | None = None


@dataclass
class Timing:
    train_s: float = 0.0
    first_step_s: float = 0.0
    checkpoint_s: float = 0.0
    steps: list[float] = field(default_factory=list)


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


def _on_cpu(state: Any) -> Any:
    """`state` (nested dicts, lists and tuples) with every tensor copied to the CPU."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {key: _on_cpu(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_on_cpu(value) for value in state)
    return state


def step_seed(seed: int, rank: int, step: int) -> int:
    """The random seed of one rank's step: distinct for every (seed, rank, step), within 63 bits."""
    return ((seed * 100_003 + rank) * 1_000_003 + step) % 2**63


def barrier() -> None:
    import torch.distributed as dist

    if dist.get_world_size() > 1:
        dist.barrier()


class Trainer:
    """The boosted denoiser (UNet or transformer, whole or its LoRA adapter) and everything that
    trains it, for one rank. What differs by model family goes through `self.family`."""

    def __init__(self, args: argparse.Namespace, device: Any) -> None:
        import torch.distributed as dist

        self.args, self.device = args, device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        base = args.pretrained_model_name_or_path
        self.family = families.get(getattr(args, "model_family", None) or detect_family(base))
        self.lora = getattr(args, "training_method", "full") == "lora"
        self.parts = self.family.load_parts(base, self.family.left_out(args))
        model.prepare_parts(
            self.parts,
            mixed_precision=args.mixed_precision,
            gradient_checkpointing=args.gradient_checkpointing,
            device=device,
            vae_fp32=self.family.vae_fp32,
        )
        self.text_adapters = lora.TextEncoderAdapters({})
        if self.lora:
            self.text_adapters = lora.TextEncoderAdapters(lora.add_adapters(self.parts, args, self.family))
        denoiser = self.parts.denoiser
        self.ema: Any = model.make_ema(denoiser, args.ema_decay, device) if args.use_ema and self.rank == 0 else None
        self.boosted = model.boost(args, denoiser, self.text_adapters.parameters())
        if self.rank == 0:
            print(f"model: family={self.family.name} {lora.describe(denoiser, self.lora)}", flush=True)
        self.encode_cache = EncodeCache(int(args.cache_latents_max_gb * 1e9)) if args.cache_latents else None
        self.state = TrainState()
        self.data_state: dict[str, Any] | None = None
        self.loader: Any = None

    @property
    def samples_per_step(self) -> int:
        return self.args.train_batch_size * self.args.gradient_accumulation_steps * self.world_size

    # --- checkpoints ---------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """Collective: a complete checkpoint of this step (see training.checkpoints)."""
        import torch.distributed as dist

        data_states: list[Any] = [None] * self.world_size
        dist.all_gather_object(data_states, self.loader.state_dict())
        path = checkpoints.save(
            self.args.checkpoints_dir,
            self.state.step,
            lambda folder: self._write(folder, data_states),
            local_rank=self.local_rank,
            limit=self.args.checkpoints_total_limit,
            s3_uri=self.args.checkpoint_s3_uri,
            rank=self.rank,
        )
        if self.rank == 0:
            print(f"saved checkpoint {path}", flush=True)
        return path

    def _write(self, folder: Path, data_states: list[Any]) -> None:
        import torch

        b = self.boosted
        if self.lora:  # the adapter alone: the frozen base is the base model, on every host already
            if self.rank == 0:
                lora.save_trainable(self.parts.denoiser, folder / lora.ADAPTER_FILE)
                self.text_adapters.save(folder)
        else:
            b.booster.save_model(b.model, str(folder / self.family.denoiser_name), shard=True, use_safetensors=True)
        if self.args.plugin == "torch_ddp":
            # Replicated state gains nothing from sharding, and colossalai 0.5.0's sharded
            # optimizer load calls an accelerator synchronize that the CPU accelerator lacks.
            b.booster.save_optimizer(b.optimizer, str(folder / checkpoints.OPTIMIZER_FILE), shard=False)
        else:
            b.booster.save_optimizer(b.optimizer, str(folder / "optimizer"), shard=True)
        if self.rank == 0 or self.args.plugin != "torch_ddp":  # torch_ddp's state is replicated
            precision_state.save(folder, self.args.plugin, b.optimizer, b.model.parameters(), self._state_rank)
        if self.rank != 0:
            return
        b.booster.save_lr_scheduler(b.lr_scheduler, str(folder / "lr_scheduler.pt"))
        if self.ema is not None:
            torch.save(self.ema.state_dict(), folder / "ema.pt")
        for rank, data_state in enumerate(data_states):
            (folder / checkpoints.data_state_file(rank)).write_text(json.dumps(data_state))
        trainer_state = {
            "step": self.state.step,
            "samples_seen": self.state.samples_seen,
            "losses": self.state.losses,
            "plugin": self.args.plugin,
            "world_size": self.world_size,
            "training_method": "lora" if self.lora else "full",
        }
        (folder / checkpoints.TRAINER_STATE).write_text(json.dumps(trainer_state))

    def _load(self, path: Path) -> None:
        b = self.boosted
        lora.check_method(path, checkpoints.read_json(path / checkpoints.TRAINER_STATE), self.lora)
        if self.lora:
            lora.load_trainable(self.parts.denoiser, path / lora.ADAPTER_FILE)
            self.text_adapters.load(path)
        else:
            b.booster.load_model(b.model, str(path / self.family.denoiser_name))
        optimizer_file = path / checkpoints.OPTIMIZER_FILE
        b.booster.load_optimizer(b.optimizer, str(optimizer_file if optimizer_file.is_file() else path / "optimizer"))
        b.booster.load_lr_scheduler(b.lr_scheduler, str(path / "lr_scheduler.pt"))
        precision_state.load(path, self.args.plugin, b.optimizer, b.model.parameters(), self._state_rank)

    @property
    def _state_rank(self) -> int:
        """Whose loss scaler and masters files this rank reads and writes: its own under the ZeRO
        plugins (each holds a shard), rank 0's under torch_ddp (replicated)."""
        return 0 if self.args.plugin == "torch_ddp" else self.rank

    def _load_from_rank0(self, path: Path) -> None:
        """Hosts with their own checkpoint folders (torch_ddp: only rank 0 writes one): the state
        is replicated, so rank 0 loads it and sends it to the others."""
        import torch.distributed as dist

        b = self.boosted
        if self.rank == 0:
            self._load(path)
        for tensor in list(b.model.parameters()) + list(b.model.buffers()):
            dist.broadcast(tensor.data, src=0)
        self.text_adapters.broadcast()
        # On the CPU: pickled CUDA tensors unpickle onto the device they left, cuda:0 of every
        # host; load_state_dict moves the state to each rank's parameters itself.
        scaler = precision_state.loss_scaler(b.optimizer)
        payload: list[Any] = [None, None, None]
        if self.rank == 0:
            scaling = precision_state.scaler_state(scaler) if scaler is not None else None
            payload = [_on_cpu(b.optimizer.state_dict()), b.lr_scheduler.state_dict(), scaling]
        dist.broadcast_object_list(payload, src=0)
        if self.rank != 0:
            b.optimizer.load_state_dict(payload[0])
            b.lr_scheduler.load_state_dict(payload[1])
            if scaler is not None and payload[2] is not None:
                precision_state.restore_scaler(scaler, payload[2])

    def resume(self) -> None:
        """Continue from the newest complete checkpoint rank 0 sees, if any (collective)."""
        import torch.distributed as dist

        found = checkpoints.list_checkpoints(self.args.checkpoints_dir)
        steps: list[int] = [0] * self.world_size
        dist.all_gather_object(steps, found[-1][0] if found else -1)
        if steps[0] < 0:
            return
        path = Path(self.args.checkpoints_dir) / checkpoints.checkpoint_name(steps[0])
        holders: list[bool] = [False] * self.world_size
        dist.all_gather_object(holders, checkpoints.is_complete(path))
        if all(holders):
            self._load(path)
        elif self.args.plugin == "torch_ddp":
            self._load_from_rank0(path)
        else:
            lacking = [r for r, ok in enumerate(holders) if not ok]
            raise CheckpointError(
                f"checkpoint {path.name} is missing or incomplete on rank(s) {lacking}: plugin={self.args.plugin} "
                "shards its state, so every host needs the whole checkpoint (SageMaker's sync gives each host all)"
            )
        self._resume_states(path)

    def _resume_states(self, path: Path) -> None:
        """Trainer state, EMA and each rank's data position: read by rank 0, sent to all."""
        import torch.distributed as dist

        payload: list[Any] = [None, None]
        if self.rank == 0:
            data_states = []
            for rank in range(self.world_size):
                data_file = path / checkpoints.data_state_file(rank)
                if not data_file.is_file():
                    raise CheckpointError(
                        f"{path.name} has no data position for rank {rank} ({data_file.name}): it was saved by "
                        f"another number of processes; resume with the same instance count, or start afresh"
                    )
                data_states.append(checkpoints.read_json(data_file))
            payload = [checkpoints.read_json(path / checkpoints.TRAINER_STATE), data_states]
            if self.ema is not None:
                self._resume_ema(path / "ema.pt")
        dist.broadcast_object_list(payload, src=0)
        saved, data_states = payload
        self.state.step = int(saved["step"])
        self.state.samples_seen = int(saved["samples_seen"])
        self.state.losses = [(int(s), float(v)) for s, v in saved["losses"]]
        self.state.resumed_from_step = self.state.step
        self.data_state = data_states[self.rank]
        if self.rank == 0:
            print(f"resumed from checkpoint {path} at step {self.state.step}", flush=True)

    def _resume_ema(self, ema_file: Path) -> None:
        if not ema_file.is_file():
            log.warning("checkpoint %s has no EMA state; EMA restarts from the resumed weights", ema_file.parent)
        model.restore_ema(self.ema, ema_file, self.parts.denoiser.parameters(), self.device)

    # --- steps ---------------------------------------------------------------------------

    def open_data(self) -> None:
        from sdflow_image import data

        self.loader = data.make_dataloader(
            self.args,
            self.parts.tokenizer,
            rank=self.rank,
            world_size=self.world_size,
            state=self.data_state,
            tokenize=self.family.caption_ids(self.parts),
        )
        if self.rank == 0:
            index = self.loader.index
            print(
                f"training: plugin={self.args.plugin} world_size={self.world_size} device={self.device} "
                f"shards={len(index.shards)} samples={index.total_samples} start_step={self.state.step} "
                f"max_train_steps={self.args.max_train_steps}",
                flush=True,
            )

    def _step(self, batches: Iterator[dict[str, Any]], generator: Any) -> Any:
        """One optimizer step over the accumulated micro-batches; returns this rank's mean loss."""
        import torch

        args, b = self.args, self.boosted
        total = torch.zeros((), device=self.device)
        no_sync_ok = accumulation.skips_sync(args.plugin, args.gradient_accumulation_steps, self.world_size)
        for micro in range(args.gradient_accumulation_steps):
            batch = next(batches)
            if micro == 0:
                # Dropout (lora_dropout) draws from torch's global generator: seeded per step as
                # well, after the step's first batch, since a run's first batch starts the
                # DataLoader, which draws its base seed from that generator.
                torch.manual_seed(step_seed(args.seed, self.rank, self.state.step))
            encoded = self._encode(batch, generator)
            last = micro == args.gradient_accumulation_steps - 1
            with accumulation.no_sync(b.booster, b.model, b.optimizer, skip=no_sync_ok and not last):
                loss = self.family.compute_loss(
                    b.model,
                    self.parts,
                    encoded,
                    generator,
                    noise_offset=args.noise_offset,
                    autocast=b.autocast_dtype,
                    snr_gamma=args.snr_gamma,
                )
                b.booster.backward(loss / args.gradient_accumulation_steps, b.optimizer)
            total += loss.detach() / args.gradient_accumulation_steps
        self.text_adapters.sync_gradients(self.world_size)
        if model.loop_clips_gradients(args.plugin, args.max_grad_norm):
            b.optimizer.clip_grad_by_norm(args.max_grad_norm)
        b.optimizer.step()
        b.lr_scheduler.step()
        b.optimizer.zero_grad()
        if self.ema is not None:
            self.ema.step(self.parts.denoiser.parameters())
        return total

    def _encode(self, batch: dict[str, Any], generator: Any) -> Encoded:
        """The batch through the frozen parts: from the latent cache (SD only) or the family."""
        share = self.args.proportion_empty_prompts
        if self.encode_cache is not None:
            return Encoded(*self.encode_cache.encode(batch, self.parts, self.device, generator, share))
        return self.family.encode_batch(batch, self.parts, self.device, generator, share)

    def _reduce(self, total: Any, stop: StopFlag) -> tuple[float, bool]:
        """One collective per step: the mean loss over ranks and whether any rank was asked to stop."""
        import torch
        import torch.distributed as dist

        stats = torch.stack([total.float(), torch.tensor(float(stop.requested), device=self.device)])
        if self.world_size > 1:
            dist.all_reduce(stats)
        return float(stats[0]) / self.world_size, float(stats[1]) > 0

    def train(self, stop: StopFlag) -> Timing:
        """Steps up to max_train_steps; TrainingStopped after a checkpoint when asked to stop."""
        import torch

        args, state = self.args, self.state
        generator = torch.Generator(device=self.device)
        timing, start_step = Timing(), state.step
        batches = iter(self.loader)
        while state.step < args.max_train_steps:
            t_step = time.perf_counter()
            # Each step's noise, timesteps and empty prompts are drawn from (seed, rank, step) alone,
            # so a run resumed at step k draws what the uninterrupted run drew at step k + 1.
            generator.manual_seed(step_seed(args.seed, self.rank, state.step))
            loss, stop_now = self._reduce(self._step(batches, generator), stop)
            state.step += 1
            state.samples_seen += self.samples_per_step
            state.losses.append((state.step, loss))
            elapsed = time.perf_counter() - t_step
            timing.train_s += elapsed
            timing.steps.append(elapsed)
            if state.step == start_step + 1:
                timing.first_step_s = elapsed
            if self.rank == 0:
                print(f"step={state.step} loss={loss:.6f}", flush=True)
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {state.step}; lower learning_rate")
            # A stop on the last step just finishes: saving the model takes no longer than a checkpoint.
            stop_now = stop_now and state.step < args.max_train_steps
            if stop_now or (state.step % args.checkpointing_steps == 0 and state.step < args.max_train_steps):
                t_ckpt = time.perf_counter()
                self.save_checkpoint()
                timing.checkpoint_s += time.perf_counter() - t_ckpt
            if stop_now:
                raise TrainingStopped(state.step)
        return timing

    def summary(self, timing: Timing) -> dict[str, Any]:
        args, state, per_step = self.args, self.state, self.samples_per_step
        steps_run = len(timing.steps)
        samples_run = steps_run * per_step
        return {
            "final_loss": state.losses[-1][1] if state.losses else None,
            "steps": state.step,
            "samples_seen": state.samples_seen,
            "samples_per_second": samples_run / timing.train_s if timing.train_s else None,
            "steady_samples_per_second": (
                (samples_run - per_step) / (timing.train_s - timing.first_step_s) if steps_run > 1 else None
            ),
            # The median step is robust to other load on the machine; bench/bench_train.py uses it.
            "median_samples_per_second": (
                per_step / statistics.median(timing.steps[1:] or timing.steps) if timing.steps else None
            ),
            "train_time_s": timing.train_s,
            "checkpoint_time_s": timing.checkpoint_s,
            "plugin": args.plugin,
            "world_size": self.world_size,
            "mixed_precision": args.mixed_precision,
            "resumed_from_step": state.resumed_from_step,
            "steps_this_run": steps_run,
            "train_batch_size": args.train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "learning_rate": args.learning_rate,
            "resolution": args.resolution,
            "use_ema": args.use_ema,
            "device": str(self.device),
            "peak_gpu_memory_gib": self._peak_gpu_memory_gib(),
            "latent_cache": self._cache_summary(),
        }

    def _cache_summary(self) -> dict[str, Any] | None:
        cache = self.encode_cache
        if cache is None:
            return None
        return {"samples": len(cache), "gb": round(cache.bytes / 1e9, 3), "hits": cache.hits, "misses": cache.misses}

    def _peak_gpu_memory_gib(self) -> float | None:
        """Collective: the largest `max_memory_allocated` of any rank, in GiB (None on CPU)."""
        import torch
        import torch.distributed as dist

        if self.device.type != "cuda":
            return None
        peak = torch.tensor([torch.cuda.max_memory_allocated(self.device) / 2**30], device=self.device)
        if self.world_size > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return float(peak.item())

    def release(self) -> None:
        """Drop the boosted model, optimizer, EMA, frozen parts and data readers, and give their
        device memory back, so rendering the samples cannot run out of memory on a finished job."""
        import torch

        self.boosted = None  # type: ignore[assignment]
        self.ema = None
        self.parts = None  # type: ignore[assignment]
        self.loader = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
