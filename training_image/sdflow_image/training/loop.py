"""The training steps, SIGTERM and resuming, for every backend (sdflow_image.backends).

diffusers' text-to-image loop over a backend's wrapped denoiser (`Trainer.backend`). A step
is `gradient_accumulation_steps` micro-batches; one all-reduce per step carries the loss and any
rank's stop request, so every rank stops after the same step and saves the same checkpoint.
A checkpoint holds the backend's model, optimizer and schedule (or the LoRA adapter), the EMA, the trainer's state
and each rank's data position (`data_state_rank<r>.json`), so a resumed run continues the data
stream exactly where it stopped. On SIGTERM the ranks finish the step, then save only when the
checkpoint can be written and uploaded within SageMaker's stop window (training.stop_save);
otherwise the next attempt resumes from the last periodic checkpoint.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdflow_image import families
from sdflow_image.backends.base import Backend
from sdflow_image.families.base import Encoded, detect_family
from sdflow_image.training import checkpoints, lora, model, stop_save
from sdflow_image.training.checkpoints import CheckpointError
from sdflow_image.training.embedding_cache import EmbeddingCache
from sdflow_image.training.encode_cache import EncodeCache

log = logging.getLogger("sdflow.train")


class TrainingStopped(Exception):
    """SIGTERM arrived; training stopped after `step`, with a checkpoint of it when `saved`."""

    def __init__(self, step: int, saved: bool = True) -> None:
        done = "checkpoint saved" if saved else "no checkpoint saved (it would not reach S3 in time)"
        super().__init__(f"stopped by SIGTERM at step {step}; {done}")
        self.step = step
        self.saved = saved


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
        self.at: float | None = None  # time.monotonic() of the first signal: the stop window starts there
        self._previous: Any = None

    def _handle(self, signum: int, _frame: Any) -> None:
        self.requested = True
        if self.at is None:
            self.at = time.monotonic()
        print(f"received signal {signum}: stopping after this step", file=sys.stderr, flush=True)

    def since_s(self) -> float:
        return time.monotonic() - self.at if self.at is not None else 0.0

    def __enter__(self) -> StopFlag:
        import threading

        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def step_seed(seed: int, rank: int, step: int) -> int:
    """The random seed of one rank's step: distinct for every (seed, rank, step), within 63 bits."""
    return ((seed * 100_003 + rank) * 1_000_003 + step) % 2**63


def barrier() -> None:
    import torch.distributed as dist

    if dist.get_world_size() > 1:
        dist.barrier()


class Trainer:
    """The wrapped denoiser (UNet or transformer, whole or its LoRA adapter) and everything that
    trains it, for one rank. What differs by model family goes through `self.family`, what
    differs by backend through `self.backend`."""

    def __init__(self, args: argparse.Namespace, device: Any, backend: Backend) -> None:
        import torch.distributed as dist

        self.args, self.device, self.backend = args, device, backend
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        base = args.pretrained_model_name_or_path
        self.family = families.get(getattr(args, "model_family", None) or detect_family(base))
        self.lora = getattr(args, "training_method", "full") == "lora"
        dtypes = model.part_dtypes(args.mixed_precision, lora=self.lora, vae_fp32=self.family.vae_fp32)
        self.parts = self.family.load_parts(base, self.family.left_out(args), dtypes)
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
        # Counted before the backend wraps (FSDP2 shards) them: what a checkpoint holds per parameter.
        trainable = [p for p in denoiser.parameters() if p.requires_grad] + self.text_adapters.parameters()
        self.trainable_parameters = sum(p.numel() for p in trainable)
        # The most bytes one host wrote of the last checkpoint saved or resumed from, and the
        # seconds the last save of this job took (stop_save).
        self.last_part_bytes: int | None = None
        self.last_save_s: float | None = None
        self.ema: Any = model.make_ema(denoiser, args.ema_decay, device) if args.use_ema and self.rank == 0 else None
        backend.wrap(denoiser, self.text_adapters.parameters(), name=self.family.denoiser_name, device=device)
        if self.rank == 0:
            print(f"model: family={self.family.name} {lora.describe(denoiser, self.lora)}", flush=True)
        cache_bytes = int(args.cache_latents_max_gb * 1e9)
        self.encode_cache: EncodeCache | EmbeddingCache | None = None
        if args.cache_latents:  # SD's own cache, or the one of the families with other text encoders
            sd = self.family.name == "sd"
            self.encode_cache = EncodeCache(cache_bytes) if sd else EmbeddingCache(self.family, cache_bytes)
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

        started = time.perf_counter()
        data_states: list[Any] = [None] * self.world_size
        dist.all_gather_object(data_states, self.loader.state_dict())
        saved = checkpoints.save(
            self.args.checkpoints_dir,
            self.state.step,
            lambda folder: self._write(folder, data_states),
            local_rank=self.local_rank,
            limit=self.args.checkpoints_total_limit,
            s3_uri=self.args.checkpoint_s3_uri,
            rank=self.rank,
        )
        self.last_part_bytes, self.last_save_s = saved.largest_part_bytes, time.perf_counter() - started
        if self.rank == 0:
            print(f"saved checkpoint {saved.path}", flush=True)
        return saved.path

    def saves_on_stop(self, stop: StopFlag) -> bool:
        """Collective: whether this stop leaves a checkpoint (training.stop_save), timed from the
        stop signal the earliest rank received; rank 0 decides for all (a save is collective)."""
        import torch
        import torch.distributed as dist

        since = torch.tensor([stop.since_s(), 0.0], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(since, op=dist.ReduceOp.MAX)
        if self.rank == 0:
            measured = self.last_part_bytes is not None
            part = self.last_part_bytes if self.last_part_bytes is not None else self._estimated_part_bytes()
            decision = stop_save.decide(
                part,
                float(since[0]),
                stop_save.stop_window_s(),
                measured=measured,
                write_s=self.last_save_s,
                uploaded=bool(self.args.checkpoint_s3_uri),
            )
            print(decision.reason, file=sys.stdout if decision.save else sys.stderr, flush=True)
            since[1] = float(decision.save)
        if self.world_size > 1:
            dist.broadcast(since, src=0)
        return bool(since[1] > 0)

    def _estimated_part_bytes(self) -> int:
        hosts = self.world_size // int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        sharded, ema = not self.backend.replicated, bool(self.args.use_ema)
        return stop_save.estimate_part_bytes(self.trainable_parameters, hosts, sharded=sharded, ema=ema)

    def _write(self, folder: Path, data_states: list[Any]) -> None:
        import torch

        if self.lora and self.rank == 0:  # the adapter alone: the frozen base is the base model, on every host already
            lora.save_trainable(self.parts.denoiser, folder / lora.ADAPTER_FILE)
            self.text_adapters.save(folder)
        self.backend.save(folder, model=not self.lora, rank=self.rank)
        if self.rank != 0:
            return
        if self.ema is not None:
            torch.save(self.ema.state_dict(), folder / "ema.pt")
        for rank, data_state in enumerate(data_states):
            (folder / checkpoints.data_state_file(rank)).write_text(json.dumps(data_state))
        trainer_state = {
            "step": self.state.step,
            "samples_seen": self.state.samples_seen,
            "losses": self.state.losses,
            "backend": self.backend.name,
            "plugin": self.args.plugin,
            "world_size": self.world_size,
            "training_method": "lora" if self.lora else "full",
        }
        (folder / checkpoints.TRAINER_STATE).write_text(json.dumps(trainer_state))

    def _load(self, path: Path) -> None:
        saved = checkpoints.read_json(path / checkpoints.TRAINER_STATE)
        lora.check_method(path, saved, self.lora)
        if saved.get("backend", "colossalai") != self.backend.name:  # checkpoints before backends: colossalai's
            raise CheckpointError(
                f"{path.name} was saved by backend={saved.get('backend', 'colossalai')}, this run is "
                f"backend={self.backend.name}: their files differ; resume with the same backend, or start afresh"
            )
        if self.lora:
            lora.load_trainable(self.parts.denoiser, path / lora.ADAPTER_FILE)
            self.text_adapters.load(path)
        self.backend.load(path, model=not self.lora, rank=self.rank)

    def _load_from_rank0(self, path: Path) -> None:
        """Hosts with their own checkpoint folders (replicated state: only rank 0 writes one):
        rank 0 loads it and sends it to the others."""
        if self.rank == 0:
            self._load(path)
        self.backend.broadcast_from_rank0(self.rank)
        self.text_adapters.broadcast()

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
        elif self.backend.replicated:
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

        payload: list[Any] = [None, None, None]
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
            trainer_state = checkpoints.read_json(path / checkpoints.TRAINER_STATE)
            payload = [trainer_state, data_states, checkpoints.part_bytes(path)]
            if self.ema is not None:
                self._resume_ema(path / "ema.pt")
        dist.broadcast_object_list(payload, src=0)
        saved, data_states, self.last_part_bytes = payload
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
        from sdflow_image.training import data

        self.loader = data.make_dataloader(
            self.args,
            self.parts.tokenizer,
            rank=self.rank,
            world_size=self.world_size,
            state=self.data_state,
            tokenize=self.family.caption_ids(self.parts),
            resolution_multiple=self.family.resolution_multiple,
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

        args, backend = self.args, self.backend
        total = torch.zeros((), device=self.device)
        no_sync_ok = backend.skips_sync(args.gradient_accumulation_steps, self.world_size)
        for micro in range(args.gradient_accumulation_steps):
            batch = next(batches)
            if micro == 0:
                # Dropout (lora_dropout) draws from torch's global generator: seeded per step as
                # well, after the step's first batch, since a run's first batch starts the
                # DataLoader, which draws its base seed from that generator.
                torch.manual_seed(step_seed(args.seed, self.rank, self.state.step))
            encoded = self._encode(batch, generator)
            last = micro == args.gradient_accumulation_steps - 1
            with backend.no_sync(skip=no_sync_ok and not last):
                loss = self.family.compute_loss(
                    backend.model,
                    self.parts,
                    encoded,
                    generator,
                    noise_offset=args.noise_offset,
                    autocast=backend.autocast_dtype,
                    snr_gamma=args.snr_gamma,
                )
                backend.backward(loss / args.gradient_accumulation_steps)
            total += loss.detach() / args.gradient_accumulation_steps
        self.text_adapters.sync_gradients(self.world_size)
        backend.step()
        if self.ema is not None:
            self.ema.step(self.parts.denoiser.parameters())
        return total

    def _encode(self, batch: dict[str, Any], generator: Any) -> Encoded:
        """The batch through the frozen parts: from the latent cache (cache_latents) or the family."""
        share = self.args.proportion_empty_prompts
        if isinstance(self.encode_cache, EmbeddingCache):
            return self.encode_cache.encode(batch, self.parts, self.device, generator, share)
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
        """Steps up to max_train_steps; TrainingStopped when asked to stop (after a checkpoint when
        one fits in the stop window: saves_on_stop)."""
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
            periodic = state.step % args.checkpointing_steps == 0 and state.step < args.max_train_steps
            save = self.saves_on_stop(stop) if stop_now else periodic
            if save:
                t_ckpt = time.perf_counter()
                self.save_checkpoint()
                timing.checkpoint_s += time.perf_counter() - t_ckpt
            if stop_now:
                raise TrainingStopped(state.step, saved=save)
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
            "backend": self.backend.name,
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
        """Drop the wrapped model, optimizer, EMA, frozen parts and data readers, and give their
        device memory back, so rendering the samples cannot run out of memory on a finished job."""
        import torch

        self.backend.release()
        self.ema = None
        self.parts = None  # type: ignore[assignment]
        self.loader = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
