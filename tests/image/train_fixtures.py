"""Helpers for the train tests and bench: a dataset channel of webdataset shards, built in code."""

from __future__ import annotations

import contextlib
import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sdflow import samples


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_dataset_channel(
    root: str | Path,
    shards: int = 2,
    samples_per_shard: int = 8,
    image_size: int = 64,
    seed: int = 0,
    *,
    run: str | None = None,
    reused_from: str | None = None,
) -> Path:
    """Write `root/shards/<id>/00000.tar` like img2dataset, plus `root/index.json` like build_index.

    With `run`, the layout SageMaker makes of build_index's manifest (prefix `s3://<bucket>/runs/`):
    `root/<run>/dataset/index.json`, and each shard under `root/<run>/dataset/shards/<id>/`, or, for
    the even shards when `reused_from` is given, under that earlier run's folder (a resumed run)."""
    root = Path(root)
    entries: list[dict[str, Any]] = []
    for shard in range(shards):
        shard_id = f"{shard:05d}"
        owner = reused_from if reused_from and shard % 2 == 0 else run
        relative = f"{owner}/dataset/shards/{shard_id}" if owner else f"shards/{shard_id}"
        folder = root / relative
        folder.mkdir(parents=True, exist_ok=True)
        # Not square on purpose (up to a quarter wider or taller): the loader must resize and crop.
        images = samples.make_images(
            samples_per_shard, seed=seed * 1000 + shard, min_size=image_size,
            max_size=image_size + image_size // 4, formats=("jpeg",),
        )  # fmt: skip
        with tarfile.open(folder / "00000.tar", "w") as tar:
            for i, image in enumerate(images):
                key = f"{shard:05d}{i:04d}"
                caption = image.caption
                _add(tar, f"{key}.jpg", image.data)
                _add(tar, f"{key}.txt", caption.encode())
                _add(tar, f"{key}.json", json.dumps({"key": key, "caption": caption, "status": "success"}).encode())
        entries.append({"shard_id": shard_id, "tar_files": [f"{relative}/00000.tar"], "samples": samples_per_shard})
    index = {
        "version": 1,
        "run_id": "test-run",
        "total_samples": shards * samples_per_shard,
        "shards": entries,
        "failed_shards": [],
        "image_size": image_size,
    }
    index_file = root / index_in_channel(run)
    index_file.parent.mkdir(parents=True, exist_ok=True)
    index_file.write_text(json.dumps(index))
    return root


def index_in_channel(run: str | None) -> str:
    """The `dataset_index` hyperparameter for a channel write_dataset_channel made."""
    return f"{run}/dataset/index.json" if run else "index.json"


def write_job_config(
    opt_ml: str | Path,
    hyperparameters: dict[str, str],
    *,
    dataset_dir: Path,
    base_model_dir: Path,
    hosts: list[str] | None = None,
    current_host: str = "algo-1",
) -> Path:
    """Lay out one host's /opt/ml: config files and the two channels (symlinked, read-only use)."""
    opt_ml = Path(opt_ml)
    config = opt_ml / "input" / "config"
    config.mkdir(parents=True, exist_ok=True)
    (config / "hyperparameters.json").write_text(json.dumps(hyperparameters))
    (config / "resourceconfig.json").write_text(
        json.dumps({"current_host": current_host, "hosts": hosts or [current_host], "network_interface_name": "lo"})
    )
    data = opt_ml / "input" / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name, target in (("dataset", dataset_dir), ("base_model", base_model_dir)):
        link = data / name
        if not link.exists():
            link.symlink_to(target, target_is_directory=True)
    return opt_ml


@contextlib.contextmanager
def gloo_world_of_one() -> Iterator[None]:
    """A process group of one (gloo, CPU) in this process, as `colossalai.launch_from_torch` makes it
    under torchrun; Colossal-AI's plugins need one to be built."""
    import colossalai
    import torch.distributed as dist

    from tests.helpers import free_port

    colossalai.launch(rank=0, world_size=1, host="127.0.0.1", port=free_port(), backend="gloo", verbose=False)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
