"""The training backend interface: what the Trainer (training/loop.py) asks of whatever
distributes the denoiser, and the code both implementations share.

A backend owns, for one rank: the process group; the wrapped denoiser, its optimizer and its
learning-rate schedule (`wrap`); a micro-batch's backward and the no-sync context of gradient
accumulation; a step (clipping where the wrapper leaves it to the loop, optimizer, schedule);
its part of a checkpoint (model, optimizer, schedule and any precision state the optimizer
keeps outside its state_dict); and the whole denoiser's weights for the exported model.

Everything else is the Trainer's, written once for both: the data path and its exact resume,
the checkpoint folder with its completeness marker, LoRA adapters, EMA, SIGTERM, outputs,
metrics and the model card.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import os
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def torchrun_environment() -> Iterator[None]:
    """torchrun's variables, or those of a world of one for a run in this process (the launcher
    trains in-process on one host with one device), removed again afterwards."""
    added: list[str] = []
    if "RANK" not in os.environ:
        single = {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }
        for key, value in single.items():
            if key not in os.environ:
                os.environ[key] = value
                added.append(key)
    try:
        yield
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        for key in added:
            os.environ.pop(key, None)


def on_cpu(state: Any) -> Any:
    """`state` (nested dicts, lists and tuples) with every tensor copied to the CPU."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {key: on_cpu(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(on_cpu(value) for value in state)
    return state


def schedule(args: argparse.Namespace, optimizer: Any) -> Any:
    """diffusers' learning-rate schedule of the examples, stepped once per optimizer step."""
    from diffusers.optimization import get_scheduler

    return get_scheduler(
        args.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=args.lr_warmup_steps,
        num_training_steps=args.max_train_steps,
    )


def adam_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2),
        "weight_decay": args.adam_weight_decay,
        "eps": args.adam_epsilon,
    }


def trainable(denoiser: Any, extra_params: Iterable[Any]) -> list[Any]:
    """What the optimizer gets: the denoiser's weights that train (all of them, or its LoRA
    adapter's: then the optimizer state is megabytes) and `extra_params` (text-encoder adapters)."""
    return [p for p in denoiser.parameters() if p.requires_grad] + list(extra_params)


class Backend(abc.ABC):
    """One rank's side of a backend (see the module docstring). `wrap` sets `model` (the
    wrapped denoiser the loss calls), `optimizer`, `lr_scheduler` and `autocast_dtype` (the dtype
    the loss autocasts the forward to, None when the wrapper does it or in fp32)."""

    name = ""
    # Whether every rank holds the whole training state (DDP): then only rank 0 writes it, and a
    # host whose checkpoint folder lacks it gets it from rank 0 (`broadcast_from_rank0`).
    replicated = True

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model: Any = None
        self.optimizer: Any = None
        self.lr_scheduler: Any = None
        self.autocast_dtype: Any = None
        self.denoiser_name = "unet"

    @abc.abstractmethod
    def distributed(self, seed: int, cuda: bool) -> contextlib.AbstractContextManager[None]:
        """The run's process group (torchrun's, or a world of one), with every RNG seeded."""

    def wrap(self, denoiser: Any, extra_params: Iterable[Any], *, name: str, device: Any) -> None:
        """Optimizer, schedule and the wrapped denoiser for `args.plugin`; `name` is the
        pipeline component it is (unet, transformer), its folder in a checkpoint."""
        self.denoiser_name = name
        self._wrap(denoiser, list(extra_params), device)

    @abc.abstractmethod
    def _wrap(self, denoiser: Any, extra_params: list[Any], device: Any) -> None: ...

    @abc.abstractmethod
    def backward(self, loss: Any) -> None: ...

    def no_sync(self, skip: bool) -> contextlib.AbstractContextManager[Any]:
        """A micro-batch before a step's last (`skip`) runs without gradient communication where
        the plugin can; a null context otherwise."""
        return contextlib.nullcontext()

    def skips_sync(self, gradient_accumulation_steps: int, world_size: int) -> bool:
        """Whether `no_sync` skips anything here (the loop passes `skip` only then)."""
        return world_size > 1 and gradient_accumulation_steps > 1

    @abc.abstractmethod
    def step(self) -> None:
        """Clip (where the loop must), step the optimizer and the schedule, zero the gradients."""

    @abc.abstractmethod
    def save(self, folder: Path, *, model: bool, rank: int) -> None:
        """Collective: this rank's part of a checkpoint: the denoiser (unless `model` is False: a
        LoRA run's adapter is the Trainer's), optimizer, schedule, precision state."""

    @abc.abstractmethod
    def load(self, folder: Path, *, model: bool, rank: int) -> None:
        """Collective where the state is sharded: what `save` wrote, back into this run."""

    @abc.abstractmethod
    def export(self, path: Path, rank: int) -> None:
        """Collective: the whole (unsharded) denoiser's weights as one safetensors file at `path`,
        written by rank 0; for the exported pipeline."""

    def broadcast_from_rank0(self, rank: int) -> None:
        """After rank 0 alone loaded a checkpoint of replicated state: the weights, the optimizer
        and the schedule (and a loss scaler) to every rank."""
        import torch.distributed as dist

        from sdflow_image.training import precision_state

        for tensor in list(self.model.parameters()) + list(self.model.buffers()):
            dist.broadcast(tensor.data, src=0)
        # On the CPU: pickled CUDA tensors unpickle onto the device they left, cuda:0 of every
        # host; load_state_dict moves the state to each rank's parameters itself.
        scaler = precision_state.loss_scaler(self.optimizer)
        payload: list[Any] = [None, None, None]
        if rank == 0:
            scaling = precision_state.scaler_state(scaler) if scaler is not None else None
            payload = [on_cpu(self.optimizer.state_dict()), self.lr_scheduler.state_dict(), scaling]
        dist.broadcast_object_list(payload, src=0)
        if rank != 0:
            self.optimizer.load_state_dict(payload[0])
            self.lr_scheduler.load_state_dict(payload[1])
            if scaler is not None and payload[2] is not None:
                precision_state.restore_scaler(scaler, payload[2])

    def release(self) -> None:
        """Drop the wrapped model and optimizer (the Trainer frees the device memory)."""
        self.model = self.optimizer = self.lr_scheduler = None
