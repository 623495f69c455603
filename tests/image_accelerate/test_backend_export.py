"""The exported weights of an FSDP2 run: two processes over gloo (torch.multiprocessing), a small
model of `blocks` sharded as the backend shards a denoiser, one optimizer step, then the export.
The file holds the trained weights whole under their own names, and rank 0 never holds more
than one gathered weight at a time (torch's get_model_state_dict gathers every weight first)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port

pytestmark = pytest.mark.image

WORLD = 2
ARGS = {"plugin": "fsdp2", "mixed_precision": "no", "learning_rate": 1e-2, "adam_beta1": 0.9, "adam_beta2": 0.999,
        "adam_weight_decay": 0.0, "adam_epsilon": 1e-8, "lr_scheduler": "constant", "lr_warmup_steps": 0,
        "max_train_steps": 1, "training_method": "full", "max_grad_norm": 0.0}  # fmt: skip


def small_model() -> Any:
    import torch

    class Blocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6))
            self.out = torch.nn.Linear(64, 3)
            self.register_buffer("scale", torch.tensor([2.0]))

        def forward(self, x: Any) -> Any:
            for block in self.blocks:
                x = torch.tanh(block(x))
            return self.out(x) * self.scale

    torch.manual_seed(0)
    return Blocks()


def export_rank(rank: int, port: int, folder: str) -> None:
    """One rank: shard, train a step, export with gathered weights watched, then torch's own gather."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor
    from torch.multiprocessing.reductions import StorageWeakRef

    from sdflow_image.backends.accelerate import AccelerateBackend

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    model = small_model()
    backend = AccelerateBackend(argparse.Namespace(**ARGS))
    backend._wrap(model, [], torch.device("cpu"))
    backend.backward(model(torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))).square().mean())
    backend.step()

    # Every weight made whole on this rank (the redistribution to Replicate that full_tensor and
    # get_model_state_dict both do), watched at the storage: how many are still alive at each next one.
    gathered: list[Any] = []
    alive: list[int] = []
    redistribute = DTensor.redistribute

    def watched(self: Any, *args: Any, **kwargs: Any) -> Any:
        alive.append(sum(not ref.expired() for ref in gathered))
        result = redistribute(self, *args, **kwargs)
        gathered.append(StorageWeakRef(result.to_local().untyped_storage()))
        return result

    DTensor.redistribute = watched  # type: ignore[method-assign]
    try:
        backend.export(Path(folder) / "model.safetensors", rank)
    finally:
        DTensor.redistribute = redistribute  # type: ignore[method-assign]
    trained = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(trained, Path(folder) / "trained.pt")
        (Path(folder) / "watch.json").write_text(json.dumps({"alive": alive, "gathered": len(gathered)}))
    dist.destroy_process_group()


def test_export_fsdp2_two_ranks_writes_the_trained_weights_gathering_one_at_a_time(tmp_path: Path) -> None:
    import torch
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    mp.spawn(export_rank, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    exported = load_file(str(tmp_path / "model.safetensors"))
    trained = torch.load(tmp_path / "trained.pt", weights_only=True)
    assert sorted(exported) == sorted(trained) == sorted(small_model().state_dict())
    assert all(torch.equal(exported[name], trained[name]) for name in trained)
    assert not torch.equal(exported["out.weight"], small_model().out.weight), "the step's weights, not the start's"
    watch = json.loads((tmp_path / "watch.json").read_text())
    assert watch["gathered"] == len(list(small_model().parameters()))
    assert max(watch["alive"]) <= 1, f"rank 0 held {max(watch['alive'])} gathered weights at once"
