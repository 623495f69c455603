"""FLUX.2 [klein] and SD 3.5 train in aspect-ratio buckets on the accelerate backend, through the
image's `bin/train`: non-square latents (buckets 32x48 and 48x32 at resolution 32, rounded to their
multiple of 16), and a new attempt given the halfway checkpoint (a sample waiting in another bucket
in its data position) repeats the last steps' losses."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import train_runs as runs
from data_fixtures import write_aspect_shards
from train_runs import HP, STEPS

# (width, height): 2:1, square, 1:2. In this order (seed 0, two shards interleaved) the checkpoint after
# step 2 holds a sample pending in another bucket.
SIZES = [(64, 32), (48, 48), (32, 64), (64, 32), (32, 64)]


@pytest.mark.parametrize("family", ["flux2", "sd35"])
def test_bucketed_new_family_trains_non_square_and_resumes_exactly(
    family: str, tmp_path: Path, bases: Callable[[str], Path]
) -> None:
    dataset = tmp_path / "runs"
    index = write_aspect_shards(dataset, [SIZES, list(reversed(SIZES))])
    hp = {**HP, "training_method": "lora", "lora_rank": "4", "checkpointing_steps": "2", "aspect_buckets": "true",
          "center_crop": "false", "random_flip": "true", "dataset_index": index}  # fmt: skip
    if family == "sd35":
        hp["sd3_t5"] = "false"
    opt_ml = runs.job(tmp_path, family, hp, bases(family), dataset)

    code, out = runs.run(opt_ml, 1)

    assert code == 0, out[-4000:]
    losses = runs.losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in losses.values())
    [data_state] = (opt_ml / "checkpoints").glob("*2*/data_state_rank0.json")
    position = json.loads(data_state.read_text())
    assert position["buckets"]
    assert position["cursors"]["0"]["pending"]
    resumed = runs.resumed_copy(tmp_path, opt_ml, hp, bases(family), dataset, 1)
    assert resumed == pytest.approx({3: losses[3], 4: losses[4]}, rel=1e-5)
