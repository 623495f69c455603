"""Memory measured, not only estimated: torch's memory trackers count a training step on fake tensors
(bench/memory_trace.py), and the estimate (sdflow_common.memory_estimate) is held to what they count.

FSDP2 runs here in one process over torch's fake process group (`fake_pg.FakeStore`: collectives
that move nothing), which is all a count of bytes needs."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from sdflow_common import memory_estimate

WORLD = 2
WIDTH = 256
BLOCKS = 16


@pytest.fixture
def fake_group() -> Iterator[int]:
    """A fake process group of WORLD ranks, this process rank 0."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield WORLD
    finally:
        dist.destroy_process_group()


def _sharded_blocks(blocks: int) -> Any:
    """A stack of Linear blocks sharded as backends/accelerate.py `_shard` shards a denoiser: each
    block, then the root, with bf16 parameters and fp32 gradient reduction."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(blocks)])
    mesh = init_device_mesh("cpu", (WORLD,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _kept_gradients(model: Any) -> list[Any]:
    """Every FSDP parameter's gradient on its unsharded parameter (torch 2.15 `FSDPParam.
    unsharded_accumulated_grad`: `_unsharded_param.grad`, kept between backwards while resharded)."""
    found = []
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state else None
        for fsdp_param in group.fsdp_params if group else ():
            if fsdp_param.unsharded_accumulated_grad is not None:
                found.append(fsdp_param.unsharded_accumulated_grad)
    return found


def test_fsdp2_no_sync_micro_batch_keeps_unsharded_fp32_gradients_the_estimate_counts(
    fake_group: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    model = _sharded_blocks(blocks=3)
    parameters = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the whole parameter's
    model.set_requires_gradient_sync(False)  # backends/accelerate.py no_sync, on the micro-batches before the last
    model(torch.randn(4, WIDTH)).float().pow(2).mean().backward()
    kept = _kept_gradients(model)
    assert kept
    assert all(g.dtype == torch.float32 for g in kept)  # the policy's reduce_dtype
    assert sum(g.numel() for g in kept) == parameters  # whole, not 1/WORLD of each
    kept_bytes = sum(g.numel() * g.element_size() for g in kept)

    tiny = memory_estimate.Family("tiny", denoiser=float(parameters), frozen=0.0, lora_per_rank=0, text_lora_per_rank=0)
    monkeypatch.setitem(memory_estimate.FAMILIES, "tiny", tiny)
    once = memory_estimate.Setup("tiny", "full", "fsdp2", "bf16", 1, 512, gpus=fake_group)
    twice = replace(once, gradient_accumulation_steps=2)
    assert memory_estimate.accumulated_gradient_bytes(twice) == kept_bytes
    # in place of the sharded gradients (4/N B a parameter), which the last micro-batch makes as it frees these
    added = memory_estimate.estimate(twice).states_gib - memory_estimate.estimate(once).states_gib
    assert added * memory_estimate.GIB == pytest.approx(kept_bytes - kept_bytes / fake_group)


def test_fsdp2_synced_backward_keeps_no_unsharded_gradient(fake_group: int) -> None:
    import torch

    model = _sharded_blocks(blocks=2)
    model(torch.randn(4, WIDTH)).float().pow(2).mean().backward()
    assert _kept_gradients(model) == []
    assert all(p.grad is not None and p.grad.to_local().numel() * WORLD == p.numel() for p in model.parameters())


def _tiny_peak(accumulation: int) -> int:
    """bench/memory_trace's way on the tiny blocks: fake tensors, FSDPMemTracker, `accumulation`
    micro-batches with the gradient sync skipped on all but the last, one AdamW step."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    model = _sharded_blocks(blocks=BLOCKS)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        tracker = FSDPMemTracker(model)
        x = torch.randn(2, WIDTH)
        with tracker:
            for micro in range(accumulation):
                model.set_requires_gradient_sync(micro == accumulation - 1)
                model(x).float().pow(2).mean().backward()
        return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def test_fsdp2_traced_peak_with_accumulation_grows_by_the_estimates_term(
    fake_group: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    parameters = BLOCKS * (WIDTH * WIDTH + WIDTH)
    monkeypatch.setitem(memory_estimate.FAMILIES, "tiny", memory_estimate.Family("tiny", float(parameters), 0.0, 0, 0))
    once = memory_estimate.Setup("tiny", "full", "fsdp2", "bf16", 1, 512, gpus=fake_group)
    term = memory_estimate.accumulated_gradient_bytes(replace(once, gradient_accumulation_steps=2))
    assert term == 4 * parameters
    grown = _tiny_peak(accumulation=2) - _tiny_peak(accumulation=1)
    # What the estimate adds: the kept gradients less the sharded ones they stand in for; within two blocks'
    # fp32 gradients (FSDP2's transient blocks in the estimate), which each peak holds in its own way.
    added = memory_estimate.estimate(replace(once, gradient_accumulation_steps=2)).states_gib * memory_estimate.GIB
    added -= memory_estimate.estimate(once).states_gib * memory_estimate.GIB
    transient = memory_estimate.FSDP_TRANSIENT_BLOCKS * memory_estimate.FULL_BYTES * parameters / BLOCKS
    assert added == pytest.approx(term - term / fake_group)
    assert grown == pytest.approx(added, abs=transient)


# The estimate against the trace, per GPU. The estimate counts weights, gradients, Adam's state, the frozen
# parts and FSDP2's gathered units from parameter counts (exact), and the activations from one traced figure
# per family (the full fsdp2 row at 512 px) times shares measured once (LoRA, gradient checkpointing). What
# it models coarsely: the moment of the peak (it adds FSDP2's root and two LARGEST blocks gathered, where
# the trace finds the peak early in the backward among FLUX.2's single blocks, half the size: the estimate
# stays above by about 10 %), and LoRA's activations as one share of the full run's (a LoRA row lands a few
# per cent either side). Hence 0.9 to 1.15: tight enough that the old rule (activations scaled from SD 1.5's
# UNet by parameter count, a third of the trace for FLUX.2) fails it, loose enough for those two.
ESTIMATE_OVER_TRACE = (0.9, 1.15)


@pytest.mark.parametrize(("method", "plugin"), [("full", "fsdp2"), ("lora", "ddp")])
def test_estimate_of_flux2_klein_4b_is_within_tolerance_of_the_traced_peak(method: str, plugin: str) -> None:
    import torch.distributed as dist

    from bench import memory_trace

    row = memory_trace.Row("flux2-klein-4b", method, plugin, gpus=8)
    try:
        traced = memory_trace.trace(row)
    finally:
        dist.destroy_process_group()
    estimated = memory_estimate.estimate(memory_trace.estimate_setup(row)).total_gib
    low, high = ESTIMATE_OVER_TRACE
    assert low <= estimated / traced.peak_gib <= high, (estimated, traced.peak_gib, traced.parts)
