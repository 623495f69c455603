"""The new families through the image's real training entrypoint on the accelerate backend: each
tiny model trained by `bin/train` (FLUX.2 [klein] and SD 3.5 as LoRA adapters under ddp in one
process; Qwen-Image in full, sharded with FSDP2 across two gloo processes, whose last block has
weights no gradient reaches), ending with the job's outputs: the adapter or the whole exported
model, the samples and the model card. Each run leaves a checkpoint halfway, and a new attempt
given it (as SageMaker's restart downloads it) resumes there and repeats the last steps' losses.
The families' own tests check their encode, loss, LoRA files and serving one piece at a time;
these check that the Trainer drives them end to end."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import train_runs as runs
from train_runs import HP, STEPS


@pytest.mark.parametrize("family", ["flux2", "sd35"])
def test_train_new_family_lora_one_process_writes_adapter_samples_card_and_resumes_exactly(
    family: str, tmp_path: Path, bases: Callable[[str], Path], dataset: Path
) -> None:
    hp = {**HP, "training_method": "lora", "lora_rank": "4", "checkpointing_steps": "2"}
    if family == "sd35":
        hp["sd3_t5"] = "false"
    opt_ml = runs.job(tmp_path, family, hp, bases(family), dataset)

    code, out = runs.run(opt_ml, 1)

    assert code == 0, out[-4000:]
    losses = runs.losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(math.isfinite(loss) for loss in losses.values())
    summary = runs.summary(opt_ml)
    assert (summary["plugin"], summary["world_size"]) == ("ddp", 1)
    model = opt_ml / "model"
    adapters = list(model.rglob("*.safetensors"))
    assert adapters, sorted(p.name for p in model.rglob("*"))
    assert sum(p.stat().st_size for p in adapters) < 5e6, "a LoRA job writes the adapter, not the model"
    assert any(model.rglob("samples*.png")), sorted(p.name for p in model.rglob("*"))
    card = json.loads((model / "sdflow_model.json").read_text())
    assert (card["family"], card["method"]) == (family, "lora")
    resumed = runs.resumed_copy(tmp_path, opt_ml, hp, bases(family), dataset, 1)
    assert resumed == pytest.approx({3: losses[3], 4: losses[4]}, rel=1e-5)


def test_train_qwenimage_full_fsdp2_two_processes_exports_whole_transformer_and_resumes_exactly(
    tmp_path: Path, bases: Callable[[str], Path], dataset: Path
) -> None:
    from safetensors import safe_open

    hp = {**HP, "training_method": "full", "plugin": "fsdp2", "mixed_precision": "bf16", "checkpointing_steps": "2"}
    opt_ml = runs.job(tmp_path, "qwenimage", hp, bases("qwenimage"), dataset)

    code, out = runs.run(opt_ml, 2)

    assert code == 0, out[-4000:]
    losses = runs.losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    summary = runs.summary(opt_ml)
    assert (summary["plugin"], summary["world_size"]) == ("fsdp2", 2)
    exported = sorted((opt_ml / "model").rglob("transformer/*.safetensors"))
    assert exported, sorted(str(p) for p in (opt_ml / "model").rglob("*"))
    names: set[str] = set()
    for file in exported:
        with safe_open(str(file), "pt") as handle:
            names |= set(handle.keys())
    # Every weight of the base transformer is in the export, whole (no DTensor shard left).
    with safe_open(str(next((bases("qwenimage") / "transformer").glob("*.safetensors"))), "pt") as base:
        assert set(base.keys()) <= names
    resumed = runs.resumed_copy(tmp_path, opt_ml, hp, bases("qwenimage"), dataset, 2)
    assert resumed == pytest.approx({3: losses[3], 4: losses[4]}, rel=1e-5)
