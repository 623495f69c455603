"""accelerate's DDP with parameters that no loss reaches: Qwen-Image's last block computes a text
stream that the transformer's output never reads, so LoRA targets there (`to_add_out`, `txt_mlp`)
get no gradient. Two processes over gloo, through the launcher's torchrun command, a tiny model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import train_runs as runs
from train_runs import HP

pytestmark = pytest.mark.image


def test_train_ddp_lora_two_processes_with_targets_no_loss_reaches_trains_every_step(
    tmp_path: Path, bases: Callable[[str], Path], dataset: Path
) -> None:
    targets = "to_q,to_k,to_v,to_out.0,to_add_out,txt_mlp.net.2"
    hp = {**HP, "training_method": "lora", "lora_rank": "4", "lora_target_modules": targets, "max_train_steps": "2"}
    opt_ml = runs.job(tmp_path, "qwen-lora", hp, bases("qwenimage"), dataset)
    code, out = runs.run(opt_ml, 2)
    # Without find_unused_parameters, DDP's reducer waits for the unused adapters' gradients and
    # step 2's forward raises "Expected to have finished reduction in the prior iteration".
    assert code == 0, out[-4000:]
    assert sorted(runs.losses(out)) == [1, 2]
    assert runs.summary(opt_ml)["world_size"] == 2
