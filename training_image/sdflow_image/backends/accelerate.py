"""The accelerate backend (the second stack: torch 2.15, diffusers 0.42.1, accelerate 1.15),
plugins `ddp` and `fsdp2`, behind `sdflow_image.backends.base.Backend`.

- ddp: `accelerate.Accelerator` as diffusers' LoRA examples use it (prepare, backward, no_sync,
  clip_grad_norm_, autocast of the forward under bf16). Replicated state: rank 0 writes the
  checkpoint (the weights as safetensors, torch's optimizer and schedule state dicts).
  The schedule is not `prepare`d: accelerate's AcceleratedScheduler steps the schedule once per
  process at each optimizer step (the examples scale their step counts by the process count to
  make up for it), which would make the schedule depend on the number of processes.
- fsdp2: torch's own `fully_shard` on each block of the denoiser (each entry of its ModuleLists
  named *blocks*: SD3's, FLUX's and Qwen-Image's transformer_blocks, a UNet's down/up blocks),
  then on the root; `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` under bf16, so
  the sharded parameters stay the fp32 masters; AdamW over the sharded (DTensor) parameters.
  accelerate 1.15's own FSDP path engages only on GPUs (on the CPU it silently trains DDP), so
  these are the calls its fsdp2 path makes, made here: the code the CPU tests run under gloo is
  the code that runs on GPUs. Checkpoints are torch.distributed.checkpoint (DCP) folders, each
  rank writing its own shard (`get_state_dict` / `set_state_dict`); the exported model is gathered
  one weight at a time and streamed into one safetensors file by rank 0 (`stream_safetensors`).
- The root's forward inputs under bf16 are cast by `cast_inputs_except`, not the policy, so the
  timesteps stay fp32; ddp runs find unused parameters (Qwen-Image's last text stream).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sdflow_image.backends.base import Backend, adam_kwargs, schedule, torchrun_environment, trainable
from sdflow_image.training import checkpoints

LR_SCHEDULER_FILE = "lr_scheduler.pt"
DCP_FOLDER = "dcp"  # fsdp2: the DCP checkpoint of the model and optimizer (every rank's shard, .metadata)


def shard_units(module: Any) -> list[Any]:
    """The blocks FSDP2 shards one by one: every entry of the outermost ModuleLists whose name
    says *blocks* (a block's own lists are inside its unit, so units never nest)."""
    import torch

    found: list[Any] = []
    for name, child in module.named_children():
        if isinstance(child, torch.nn.ModuleList) and "blocks" in name:
            found.extend(child)
        else:
            found.extend(shard_units(child))
    return found


# The denoiser's inputs that FSDP2 leaves in fp32 under bf16: SD 3/3.5's timesteps run from 0 to 1000
# and bf16 (8 significant bits) rounds them to steps of 4 above 512 (999 -> 1000), where the SD 3
# pipeline and diffusers' scripts pass them in fp32 to the sinusoidal embedding, which casts only
# its output (CombinedTimestepTextProjEmbeddings). FLUX.2 and Qwen-Image cast theirs to the hidden
# states' dtype inside the transformer, as at inference; a UNet's are integers, never cast.
FP32_INPUTS = ("timestep", "guidance")


def cast_inputs_except(keep: tuple[str, ...], dtype: Any) -> Any:
    """A forward pre-hook (with_kwargs) casting the floating tensors among the arguments to `dtype`,
    as FSDP2's cast_forward_inputs does (torch's _fsdp_state._cast_forward_inputs), but the keyword
    arguments named in `keep`."""
    import torch
    from torch.utils._pytree import tree_map

    def cast(value: Any) -> Any:
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return tree_map(cast, args), {k: v if k in keep else tree_map(cast, v) for k, v in kwargs.items()}

    return hook


class AccelerateBackend(Backend):
    name = "accelerate"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.replicated = args.plugin == "ddp"
        self.fsdp = args.plugin == "fsdp2"
        self.accelerator: Any = None

    @contextlib.contextmanager
    def distributed(self, seed: int, cuda: bool) -> Iterator[None]:
        import torch
        import torch.distributed as dist
        from accelerate.utils import set_seed

        with torchrun_environment():
            if cuda:
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            # The group is made here for both plugins (the Accelerator of ddp takes it as it is).
            dist.init_process_group(backend="nccl" if cuda else "gloo")
            set_seed(seed)  # random, numpy, torch: what colossalai.launch_from_torch seeds
            yield

    def _wrap(self, denoiser: Any, extra_params: list[Any], device: Any) -> None:
        import torch

        args = self.args
        if self.fsdp:
            # No .to(device) first: fully_shard moves each rank's shard (not the whole model) to
            # its mesh's device, the GPU of the rank (the CPU in the tests).
            self._shard(denoiser)
            self.model = denoiser
            self.optimizer = torch.optim.AdamW(trainable(denoiser, extra_params), **adam_kwargs(args))
            self.lr_scheduler = schedule(args, self.optimizer)
            return
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs

        # A LoRA run's frozen base arrives in the training precision (loaded in it: model.part_dtypes)
        # with its adapter in fp32 (lora.add_adapters): it moves as it will train, never in fp32.
        denoiser.to(device)
        optimizer = torch.optim.AdamW(trainable(denoiser, extra_params), **adam_kwargs(args))
        self.lr_scheduler = schedule(args, optimizer)
        # cpu=True on a CPU: without it accelerate 1.15 sees torchrun's LOCAL_RANK, finds no GPU,
        # and settles on DistributedType.NO, so `prepare` wraps nothing and each rank trains alone.
        # find_unused_parameters on every ddp run: which trainable weights no loss reaches depends on
        # the family, the method and the targets (Qwen-Image's last block computes a text stream its
        # output never reads: a full run's `to_add_out` and `txt_mlp` there, and any LoRA target
        # among them), and torch's default (False) then fails at step 2's forward ("Expected to have
        # finished reduction in the prior iteration"). Its cost is one walk of the autograd graph
        # per forward, small beside a diffusion model's step.
        unused = DistributedDataParallelKwargs(find_unused_parameters=True)
        self.accelerator = Accelerator(
            mixed_precision=args.mixed_precision, cpu=device.type == "cpu", kwargs_handlers=[unused]
        )
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if self.accelerator.num_processes != world_size:
            raise RuntimeError(
                f"accelerate sees {self.accelerator.num_processes} process(es) of a world of {world_size} "
                f"({self.accelerator.distributed_type}): it would not average the gradients"
            )
        self.model, self.optimizer = self.accelerator.prepare(denoiser, optimizer)

    def _shard(self, denoiser: Any) -> None:
        import importlib

        import torch

        # Imported by name: the first stack's torch 2.5.1 (whose mypy checks this package too)
        # keeps fully_shard in torch.distributed._composable.fsdp; this backend runs on 2.15 only.
        fsdp: Any = importlib.import_module("torch.distributed.fsdp")
        bf16 = self.args.mixed_precision == "bf16"
        policy = (
            fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if bf16
            else fsdp.MixedPrecisionPolicy()
        )
        for unit in shard_units(denoiser):
            fsdp.fully_shard(unit, mp_policy=policy)
        # The root casts its own inputs (`cast_inputs_except`), keeping the timesteps fp32: the
        # policy's cast_forward_inputs (True by default) would cast every floating input to bf16.
        fsdp.fully_shard(denoiser, mp_policy=dataclasses.replace(policy, cast_forward_inputs=False))
        if bf16:
            denoiser.register_forward_pre_hook(cast_inputs_except(FP32_INPUTS, torch.bfloat16), with_kwargs=True)

    def backward(self, loss: Any) -> None:
        if self.fsdp:
            loss.backward()
        else:
            self.accelerator.backward(loss)

    @contextlib.contextmanager
    def no_sync(self, skip: bool) -> Iterator[None]:
        if not skip:
            yield
        elif self.fsdp:
            # The micro-batches before the last keep their unsharded gradients (no reduce-scatter).
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)
        else:
            with self.accelerator.no_sync(self.model):
                yield

    def step(self) -> None:
        import torch

        max_norm = self.args.max_grad_norm
        if max_norm > 0:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            if self.fsdp:  # DTensor gradients: torch's clip computes the global norm over the shards
                torch.nn.utils.clip_grad_norm_(params, max_norm)
            else:
                self.accelerator.clip_grad_norm_(params, max_norm)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad()

    # --- checkpoints -----------------------------------------------------------------------

    def _weights_file(self, folder: Path) -> Path:
        return folder / f"{self.denoiser_name}.safetensors"

    def save(self, folder: Path, *, model: bool, rank: int) -> None:
        import torch

        if self.fsdp:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder / DCP_FOLDER))
        elif rank == 0:  # ddp: replicated, rank 0's copy is everyone's
            if model:
                from safetensors.torch import save_file

                save_file(_contiguous(self._unwrapped().state_dict()), str(self._weights_file(folder)))
            torch.save(self.optimizer.state_dict(), folder / checkpoints.OPTIMIZER_FILE)
        if rank == 0:
            torch.save(self.lr_scheduler.state_dict(), folder / LR_SCHEDULER_FILE)

    def load(self, folder: Path, *, model: bool, rank: int) -> None:
        import torch

        if self.fsdp:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

            model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
            # A fresh optimizer's state dict names every parameter, but the saved one only those that
            # had a gradient by then (AdamW keeps no state for the rest: Qwen-Image's last block has
            # text-stream weights no loss reaches). Ask for what was saved, and nothing less.
            saved = _saved_optimizer_params(folder / DCP_FOLDER)
            states: dict[str, Any] = optimizer_state["state"]  # type: ignore[assignment]  # "param_groups" is the list
            optimizer_state["state"] = {k: v for k, v in states.items() if k in saved}
            state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
            dcp.load(state, checkpoint_id=str(folder / DCP_FOLDER))  # strict: every weight was there
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                # Not strict only so those stateless parameters stay stateless, as in the run that saved.
                options=StateDictOptions(strict=False),
            )
        else:
            if model:
                from safetensors.torch import load_file

                self._unwrapped().load_state_dict(load_file(str(self._weights_file(folder))))
            saved = torch.load(folder / checkpoints.OPTIMIZER_FILE, map_location="cpu", weights_only=False)
            self.optimizer.load_state_dict(saved)
        self.lr_scheduler.load_state_dict(torch.load(folder / LR_SCHEDULER_FILE, weights_only=False))

    def export(self, path: Path, rank: int) -> None:
        """Collective under fsdp2: one weight at a time, every rank sends its shard of it
        (`DTensor.full_tensor`) and rank 0 appends the whole weight to the file, so rank 0 holds
        one gathered weight at a time, never the whole model (torch's get_model_state_dict with
        full_state_dict gathers them all first: measured 2.1x the model on rank 0 on the CPU).
        ddp: rank 0 writes its replica the same way, one weight on the host at a time."""
        if self.fsdp:
            from torch.distributed.tensor import DTensor

            state = self.model.state_dict()  # sharded parameters as DTensors, buffers whole

            def whole(tensor: Any) -> Any:
                return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

            stream_safetensors(path, state, whole, write=rank == 0)
        elif rank == 0:
            stream_safetensors(path, self._unwrapped().state_dict(), lambda tensor: tensor, write=True)

    def _unwrapped(self) -> Any:
        return self.accelerator.unwrap_model(self.model)

    def release(self) -> None:
        super().release()
        if self.accelerator is not None:
            self.accelerator.free_memory()
        self.accelerator = None


# safetensors' dtype names (the format's "dtype" field).
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}  # fmt: skip


def stream_safetensors(path: Path, state: dict[str, Any], whole: Any, *, write: bool) -> None:
    """`state` as one safetensors file at `path`, each tensor made whole by `whole` (a collective
    under FSDP2: every rank calls it, in the same order) and written before the next is made. The
    format (safetensors' README: an 8-byte little-endian header size, the JSON header of every
    tensor's dtype, shape and byte offsets, padded with spaces to 8 bytes, then the tensors' bytes
    in those offsets' order) needs only shapes and dtypes up front, so the header comes first and
    no tensor waits for another. safetensors' own save_file needs every tensor at once."""
    import json
    import math
    import struct

    header: dict[str, Any] = {}
    offset = 0
    for name, tensor in state.items():
        size = math.prod(tensor.shape) * tensor.element_size()
        dtype = SAFETENSORS_DTYPES[str(tensor.dtype).removeprefix("torch.")]
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(path, "wb")) if write else None
        if out is not None:
            out.write(struct.pack("<Q", len(text)) + text)
        for tensor in state.values():
            append(out, whole(tensor))  # the whole tensor is freed when append returns


def append(out: Any, tensor: Any) -> None:
    """`tensor`'s bytes (on the host, in its dtype, row-major) at the end of `out` (None: nowhere)."""
    import torch

    if out is not None:
        data = tensor.detach().cpu().contiguous().reshape(-1)
        out.write(data.view(torch.uint8).numpy().data)  # the tensor's own bytes, no copy


def _contiguous(state: dict[str, Any]) -> dict[str, Any]:
    return {name: tensor.detach().cpu().contiguous() for name, tensor in state.items()}


def _saved_optimizer_params(checkpoint: Path) -> set[str]:
    """The parameter names whose optimizer state a DCP checkpoint holds (its flattened keys are
    `optimizer.state.<parameter>.<state name>`, the state names having no dots)."""
    import torch.distributed.checkpoint as dcp

    prefix = "optimizer.state."
    keys = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {key[len(prefix) :].rsplit(".", 1)[0] for key in keys if key.startswith(prefix)}
