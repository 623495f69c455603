"""Fixtures for the model-family tests: tiny base models of each family (built in code), a
small dataset channel, and in-process training runs of each family x method with a stop and
resume. Pulled into tests/image by conftest.py."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from train_fixtures import write_dataset_channel

from sdflow_image.builders import tiny
from sdflow_image.training import train

STEP_LINE = re.compile(r"^step=(\d+) loss=([0-9.eE+-]+)$", re.MULTILINE)
# (family, method, text-encoder LoRA): each family x method, and SDXL's two text encoders adapted.
FAMILY_METHODS = [(f, m, False) for f in ("sd", "sdxl", "sd3") for m in ("full", "lora")] + [("sdxl", "lora", True)]
STEPS = 4
CHECKPOINT_AT = 2

FAMILY_HP = {
    "plugin": "torch_ddp",
    "mixed_precision": "no",
    "resolution": "32",
    "train_batch_size": "2",
    "learning_rate": "1e-3",
    "max_train_steps": str(STEPS),
    "checkpointing_steps": str(CHECKPOINT_AT),
    "seed": "0",
    "validation_prompts": '["a red square on a blue background"]',
    "validation_inference_steps": "2",
    "dataloader_num_workers": "0",
    "interleave_shards": "2",
    "proportion_empty_prompts": "0.25",
}
LORA_HP = {"training_method": "lora", "lora_rank": "4", "lora_alpha": "8", "lora_dropout": "0.1"}


@pytest.fixture(scope="session")
def family_base(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """family → its tiny base model folder (built once per session)."""
    built: dict[str, Path] = {}

    def base(family: str) -> Path:
        if family not in built:
            built[family] = tiny.build_tiny(family, tmp_path_factory.mktemp(f"tiny-{family}") / "model")
        return built[family]

    return base


@pytest.fixture(scope="session")
def family_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset_channel(
        tmp_path_factory.mktemp("family-dataset"), shards=2, samples_per_shard=4, image_size=32
    )


@dataclass
class FamilyRun:
    family: str
    method: str
    text_encoder: bool
    base: Path
    out: Path  # the uninterrupted run's model folder
    resumed_out: Path
    losses: dict[int, float]  # uninterrupted
    resumed_losses: dict[int, float]  # the run resumed from the step-CHECKPOINT_AT checkpoint
    summary: dict[str, Any]
    stdout: str


def hyperparameters(
    family: str, method: str, base: Path, dataset: Path, root: Path, text_encoder: bool = False
) -> dict[str, str]:
    return {
        **FAMILY_HP,
        **(LORA_HP if method == "lora" else {}),
        **({"train_text_encoder_lora": "true"} if text_encoder else {}),
        "model_family": family,
        "base_model_uri": f"s3://bucket/models/tiny-{family}/",
        "pretrained_model_name_or_path": str(base),
        "dataset_dir": str(dataset),
        "output_dir": str(root / "model"),
        "checkpoints_dir": str(root / "checkpoints"),
    }


def train_in_process(hp: dict[str, str]) -> tuple[dict[str, Any], str]:
    """train.main in this process; its summary and what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = train.main(train.parse_args([], hp))
    return summary, printed.getvalue()


def losses_of(stdout: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in STEP_LINE.findall(stdout)}


def run_family(
    family: str, method: str, base: Path, dataset: Path, root: Path, text_encoder: bool = False
) -> FamilyRun:
    """Train STEPS steps (a checkpoint at CHECKPOINT_AT), then again from a copy of that
    checkpoint alone: the second run must repeat the first one's last steps."""
    first = hyperparameters(family, method, base, dataset, root / "first", text_encoder)
    summary, stdout = train_in_process(first)
    second = hyperparameters(family, method, base, dataset, root / "resumed", text_encoder)
    shutil.copytree(Path(first["checkpoints_dir"]), Path(second["checkpoints_dir"]))
    _, resumed_stdout = train_in_process(second)
    return FamilyRun(
        family=family,
        method=method,
        text_encoder=text_encoder,
        base=base,
        out=Path(first["output_dir"]),
        resumed_out=Path(second["output_dir"]),
        losses=losses_of(stdout),
        resumed_losses=losses_of(resumed_stdout),
        summary=summary,
        stdout=stdout,
    )


def model_info(folder: Path) -> dict[str, Any]:
    info: dict[str, Any] = json.loads((folder / "sdflow_model.json").read_text())
    return info
