"""Tiny SD and SDXL models train in aspect-ratio buckets (non-square latents: 2:1 and 1:2 images at
32² area), and a run resumed from its checkpoint repeats the uninterrupted run's losses, with
samples of the other bucket waiting in the saved data position."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from data_fixtures import write_aspect_shards
from family_fixtures import FAMILY_HP, losses_of, train_in_process

pytestmark = pytest.mark.image

# (width, height): 2:1 and 1:2 (buckets 24x48 and 48x24 at resolution 32) and a square (32x32); in this
# order, the checkpoint after step 2 has a sample waiting in another bucket (seed 0, 2 shards interleaved).
SIZES = [(64, 32), (48, 48), (32, 64), (64, 32), (32, 64)]


@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_bucketed_training_trains_non_square_and_resumes_exactly(
    family: str, tmp_path: Path, family_base: Callable[[str], Path]
) -> None:
    root = tmp_path / "runs"
    index = write_aspect_shards(root, [SIZES, list(reversed(SIZES))])

    def hp(name: str) -> dict[str, str]:
        return {
            **FAMILY_HP, "model_family": family, "aspect_buckets": "true", "center_crop": "false",
            "random_flip": "true", "base_model_uri": f"s3://bucket/models/tiny-{family}/",
            "pretrained_model_name_or_path": str(family_base(family)), "dataset_dir": str(root),
            "dataset_index": index, "output_dir": str(tmp_path / name / "model"),
            "checkpoints_dir": str(tmp_path / name / "checkpoints"),
        }  # fmt: skip

    first = hp("first")
    _, stdout = train_in_process(first)
    losses = losses_of(stdout)
    assert sorted(losses) == [1, 2, 3, 4]
    assert all(math.isfinite(v) for v in losses.values())
    [data_state] = Path(first["checkpoints_dir"]).glob("*/data_state_rank0.json")
    position = json.loads(data_state.read_text())
    assert position["buckets"]
    assert any(c["pending"] for c in position["cursors"].values())
    second = hp("resumed")
    shutil.copytree(Path(first["checkpoints_dir"]), Path(second["checkpoints_dir"]))
    _, resumed_stdout = train_in_process(second)
    assert losses_of(resumed_stdout) == pytest.approx({3: losses[3], 4: losses[4]}, rel=1e-5)
