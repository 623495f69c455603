"""The peak GPU memory of one training step, counted on fake tensors: no GPU, no weights, seconds.

torch's own memory trackers (`torch.distributed._tools`: `FSDPMemTracker` for fsdp2, `MemTracker` for
ddp) count every tensor a step allocates, by storage, as the step runs under `FakeTensorMode` (tensors
with shapes and dtypes, no data) and a fake process group (`fake_pg.FakeStore`: collectives that move
nothing). TorchTitan's scripts/estimate/estimation.py did the same for its models (until its 2026
config rewrite removed it). The step is the training loop's (training/loop.py `_step`): the family's
`encode_batch` through the frozen VAE and text encoder(s), its `compute_loss`, backward (with FSDP2's
`set_requires_gradient_sync(False)` on the micro-batches before the last, as backends/accelerate.py
`no_sync`), gradient clipping, AdamW over the trained parameters, zero_grad: one step, after an untraced
AdamW step on zero gradients that makes Adam's m and v, so that the traced step is any later step of a
run. The models are the published configs' (builders/random_families_next.py),
built on the meta device and made fake.

What the trace is and is not, on a CPU:
- The fake tensors live on the CPU device: FSDP2 on a "cuda" mesh asks the CUDA driver for the current
  device and for streams, which a machine without a GPU does not have. Allocation sizes are the same on
  either device; kernels that pick a different algorithm on CUDA (scaled_dot_product_attention's flash
  kernel saves its output and log-sum-exp, as the CPU's flash kernel does) are counted by the CPU's.
- ddp runs under `torch.autocast("cpu", bf16)`, the backend's `autocast("cuda", bf16)` on a GPU: the two
  op lists differ in details (which reductions stay fp32), not in the linear layers that hold the memory.
- AdamW is given `foreach=True`, what torch picks for CUDA parameters (the CPU default is the for-loop):
  its step allocates a temporary of the parameters' size (`_foreach_sqrt` of v).
- The tracker counts tensors, not the caching allocator's blocks: like `torch.cuda.max_memory_allocated`
  (the GPU acceptance's figure), it leaves out the CUDA context and fragmentation (the estimate's
  CUDA_RESERVE_GIB), and NCCL's buffers.
- DDP itself is not built (its C++ reducer reads parameter data, which fake tensors do not have): the
  step runs on the bare denoiser, and DDP's gradient buckets are added as one fp32 tensor of 4 B per
  trained parameter (torch's default `gradient_as_bucket_view=False` copies every gradient into them).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import dataclass
from typing import Any

GIB = 1024**3
PLUGINS = ("ddp", "fsdp2")
METHODS = ("full", "lora")
BUCKET_BYTES = 4  # DDP's fp32 gradient buckets, per trained parameter (see the module docstring)


@dataclass(frozen=True)
class Row:
    variant: str  # builders.random_families_next.VARIANTS
    method: str = "full"
    plugin: str = "fsdp2"
    gpus: int = 8
    batch: int = 1
    resolution: int = 512
    accumulation: int = 1
    gradient_checkpointing: bool = False
    lora_rank: int = 4
    with_t5: bool = True  # SD 3.5 with its T5-XXL encoder (the GPU acceptance's random models have none)


@dataclass(frozen=True)
class Traced:
    row: Row
    peak_bytes: int
    parts: dict[str, int]  # the peak's split by the tracker's categories (bytes)
    trained: int  # trained parameters
    seconds: float  # wall clock
    cpu_seconds: float  # this process's CPU time (the wall clock of a shared machine says little)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB


def _process_group(world_size: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_world_size() == world_size:
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def _lora_args(row: Row) -> argparse.Namespace:
    return argparse.Namespace(
        lora_rank=row.lora_rank,
        lora_alpha=float(row.lora_rank),
        lora_dropout=0.0,
        lora_target_modules=[],
        train_text_encoder_lora=False,
    )


def _batch(family: Any, parts: Any, row: Row) -> dict[str, Any]:
    """What the DataLoader gives the step: one caption's ids per sample and the pixels."""
    import torch

    ids = family.caption_ids(parts)("a photo of a red cube on a table")
    batch = {key: value.unsqueeze(0).repeat(row.batch, *[1] * value.ndim) for key, value in ids.items()}
    batch["pixel_values"] = torch.zeros(row.batch, 3, row.resolution, row.resolution)
    return batch


def _parts(components: dict[str, Any]) -> Any:
    from sdflow_image.families.base import Parts

    known = {name: components.get(name) for name in Parts.__dataclass_fields__ if name in components}
    return Parts(
        unet=None,
        noise_scheduler=components["scheduler"],
        **{k: v for k, v in known.items() if k not in ("unet", "noise_scheduler")},
    )


def _shard(denoiser: Any, world_size: int) -> None:
    """fsdp2 as backends/accelerate.py `_shard` wraps it (fully_shard per block and the root, bf16
    parameters with fp32 reduction), on the meta device: the mesh's ranks are a real tensor, which
    FakeTensorMode cannot read."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from sdflow_image.backends.accelerate import shard_units

    mesh = init_device_mesh("cpu", (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in shard_units(denoiser):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(denoiser, mesh=mesh, mp_policy=policy)


def _flux2_sizes_known(row: Row) -> None:
    """FLUX.2's `_unpack_latents_with_ids` reads the latent grid's size off the position ids
    (`torch.max(h_ids) + 1`, a value fake tensors do not have) unless given it: give it the row's."""
    import functools

    from sdflow_image.families.base import second_stack

    pipeline = second_stack("diffusers").Flux2KleinPipeline
    unpack = pipeline.__dict__["_unpack_latents_with_ids"]
    original = getattr(unpack, "traced_from", unpack).__func__
    side = row.resolution // 16  # the VAE's 8x, then 2x2 patches
    patched = staticmethod(functools.partial(original, height=side, width=side))
    patched.traced_from = staticmethod(original)  # type: ignore[attr-defined]
    pipeline._unpack_latents_with_ids = patched


@contextlib.contextmanager
def _qwen_rows_of_known_length(batch: dict[str, Any]) -> Any:
    """Qwen-Image keeps each prompt's real tokens by boolean indexing with the attention mask
    (families/qwenimage.py `prompt_rows`), an output size fake tensors do not have: for the trace, the
    same slice with the length read off the real mask beforehand."""
    from sdflow_image.families import qwenimage

    original = qwenimage.prompt_rows
    if "attention_mask" not in batch:
        yield
        return
    length = int(batch["attention_mask"][0].sum()) - qwenimage.TEMPLATE_START

    def rows(hidden: Any, mask: Any) -> list[Any]:
        start = qwenimage.TEMPLATE_START
        return [states[start : start + length] for states in hidden]

    qwenimage.prompt_rows = rows
    try:
        yield
    finally:
        qwenimage.prompt_rows = original


def _fast(tracker_class: Any) -> Any:
    """`tracker_class` keeping the global peak only: the stock `_update_peak_stats` walks every module
    seen so far at every op (thousands of modules times thousands of ops: minutes per step)."""

    class PeakOnly(tracker_class):  # type: ignore[misc, valid-type]
        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)
                    self.peak_at = (sorted(self._mod_tracker.parents), self._mod_tracker.is_bw)

        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
            # MemTracker hooks the gradient of every parameter of a module that runs, and torch refuses
            # a hook on a frozen one (the VAE, the text encoders, a LoRA layer's base weight).
            frozen = [p for p in module.parameters() if not p.requires_grad]
            for param in frozen:
                self._param_to_grad_hook_handles.setdefault(param, ())
            try:
                return super()._track_module_params_and_buffers(module, install_grad_hooks)
            finally:
                for param in frozen:
                    if self._param_to_grad_hook_handles.get(param) == ():
                        del self._param_to_grad_hook_handles[param]

    return PeakOnly


def trace(row: Row) -> Traced:
    """Count one row's training step (see the module docstring)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from sdflow_image import families
    from sdflow_image.builders import random_families_next
    from sdflow_image.training import lora

    started, cpu = time.perf_counter(), time.process_time()
    _process_group(row.gpus)
    _flux2_sizes_known(row)
    family = families.get(random_families_next.FAMILY_OF[row.variant])
    parts = _parts(random_families_next.build_components(row.variant, device="meta", with_t5=row.with_t5))
    device = torch.device("cpu")
    # dtypes are set on the meta device (a fake tensor cannot be swapped for its cast copy), then
    # every module is made fake in place (`to_empty`).
    frozen = [parts.vae, *parts.text_encoders]
    for module in frozen:  # training/model.py prepare_parts: frozen, in the training precision, on the GPU
        module.requires_grad_(False)
        module.eval()
        module.to(torch.bfloat16)
    denoiser = parts.denoiser
    if row.method == "lora":
        lora.add_adapters(parts, _lora_args(row), family)
        if row.plugin == "ddp":  # the backend's bf16 frozen base (the adapter stays fp32)
            for param in denoiser.parameters():
                if not param.requires_grad:
                    param.data = param.data.to(torch.bfloat16)
    if row.gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    denoiser.train()
    if row.plugin == "fsdp2":
        _shard(denoiser, row.gpus)
    # The frozen VAE and text encoders sit on the GPU for the whole step and never appear as an op's
    # output (FSDPMemTracker.track_external is a no-op): their bytes are added to every moment.
    frozen_bytes = sum(t.numel() * t.element_size() for m in frozen for t in (*m.parameters(), *m.buffers()))
    batch = _batch(family, parts, row)  # real token ids: their mask is read below
    with _qwen_rows_of_known_length(batch), FakeTensorMode(allow_non_fake_inputs=True):
        for module in (*frozen, denoiser):
            module.to_empty(device=device)
        # ddp: the bare denoiser. DistributedDataParallel cannot be built on fake tensors (its C++ reducer
        # reads the parameters' data); what it adds to the step's memory is its buckets, counted below.
        model = denoiser
        params = [p for p in denoiser.parameters() if p.requires_grad]
        trained = sum(p.numel() for p in params)  # a DTensor's numel is the whole parameter's
        optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-2, foreach=True)
        if row.plugin == "fsdp2":
            tracker: Any = _fast(FSDPMemTracker)(model, optimizer)
        else:
            tracker = _fast(MemTracker)()
            # DDP's buckets, allocated by its C++ reducer out of the tracker's sight (module docstring).
            tracker.track_external(model, optimizer, *frozen, torch.empty(trained, dtype=torch.float32, device=device))
        # Adam's m and v made by one step on zero gradients, before the traced step: the traced step
        # is then every later step of a run (TorchTitan traced two steps for this; one is half the time).
        for param in params:
            param.grad = torch.zeros_like(param)
        optimizer.step()
        optimizer.zero_grad()
        generator = torch.Generator(device="cpu").manual_seed(0)
        with tracker:
            _step(family, parts, model, batch, row, device, generator)
            _optimizer_step(tracker, optimizer, row, device)
    peak = tracker.get_tracker_snapshot("peak")[device]
    split = {str(getattr(k, "value", k)): int(v) for k, v in peak.items() if k != "Total" and v}
    if row.plugin != "fsdp2":  # MemTracker counts them itself (track_external)
        frozen_bytes = 0
    split["Frozen (VAE, text encoders)"] = frozen_bytes
    print("peak at", getattr(tracker, "peak_at", None), flush=True)
    return Traced(
        row, int(peak["Total"]) + frozen_bytes, split, trained, time.perf_counter() - started, time.process_time() - cpu
    )


def _optimizer_step(tracker: Any, optimizer: Any, row: Row, device: Any) -> None:
    """Clip, step, zero_grad (backends/accelerate.py `step`). On fake DTensors (fsdp2) the tracker counts
    a shard-sized temporary for every foreach op of the clip and the step (seen here: 17 x the shards in
    `clip_grad_norm_`, 13 x in AdamW's step), where torch's foreach AdamW allocates one
    (`_multi_tensor_adam`: `exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)`) and the clip
    none of that size; on plain tensors (ddp) it counts right. So under fsdp2 the two are left out of the
    tracked peak, and the step's peak is taken as what the step leaves (weights, gradients, Adam's m and
    v) plus that one fp32 temporary of the local shards."""
    import torch

    params = [p for group in optimizer.param_groups for p in group["params"]]
    if row.plugin != "fsdp2":
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad()
        return
    peak, snap = dict(tracker._peak_mem), dict(tracker._peak_mem_snap)
    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    optimizer.step()
    tracker._peak_mem, tracker._peak_mem_snap = peak, snap
    after = dict(tracker.get_tracker_snapshot("current")[device])
    after["Total"] += 4 * sum(p.to_local().numel() for p in params)
    if after["Total"] > peak.get(device, 0):
        tracker._peak_mem[device], tracker._peak_mem_snap[device] = after["Total"], after
    optimizer.zero_grad()


def _no_sync(model: Any, row: Row, last: bool) -> Any:
    if row.accumulation == 1 or row.gpus == 1 or last:  # backends.base.skips_sync
        return contextlib.nullcontext()
    if row.plugin == "ddp":  # DDP's no_sync only skips the all-reduce: no memory of its own
        return contextlib.nullcontext()
    return _fsdp_no_sync(model)


@contextlib.contextmanager
def _fsdp_no_sync(model: Any) -> Any:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _step(family: Any, parts: Any, model: Any, batch: dict[str, Any], row: Row, device: Any, generator: Any) -> None:
    """training/loop.py `_step`'s micro-batches on fake tensors."""
    import torch

    autocast = torch.bfloat16 if row.plugin == "ddp" else None
    for micro in range(row.accumulation):
        encoded = family.encode_batch(batch, parts, device, generator, 0.0)
        with _no_sync(model, row, last=micro == row.accumulation - 1):
            loss = family.compute_loss(model, parts, encoded, generator, autocast=autocast)
            (loss / row.accumulation).backward()
        del encoded, loss


# builders.random_families_next's variants as the estimate names them: (family, variant)
ESTIMATE_NAMES = {
    "sd35-large": ("sd35", ""),
    "sd35-medium": ("sd35", "medium"),
    "flux2-klein-4b": ("flux2", "4b"),
    "flux2-klein-9b": ("flux2", ""),
    "qwenimage": ("qwenimage", ""),
}


def estimate_setup(row: Row) -> Any:
    """The memory estimate's Setup of a traced row (bf16, the run's defaults otherwise)."""
    from sdflow_common import memory_estimate

    family, variant = ESTIMATE_NAMES[row.variant]
    return memory_estimate.Setup(
        family,
        row.method,
        row.plugin,
        "bf16",
        row.batch,
        row.resolution,
        gradient_checkpointing=row.gradient_checkpointing,
        lora_rank=row.lora_rank,
        gpus=row.gpus,
        variant=variant,
        gradient_accumulation_steps=row.accumulation,
        with_t5=row.with_t5,
    )
