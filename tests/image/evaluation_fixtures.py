"""Fixtures and helpers of the evaluation tests: the tiny SD model with a "trained" copy and its
model.tar.gz, a tiny CLIP model (random weights: fast), and held-out webdataset tars written as the
download job writes them. Pulled into tests/image by conftest.py."""

from __future__ import annotations

import io
import json
import random
import shutil
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image

from sdflow_image import scenes
from sdflow_image.builders.tiny_clip import build_tiny_clip
from sdflow_image.builders.tiny_model import build_tiny_pipeline


@dataclass(frozen=True)
class Sample:
    key: str
    image: Image.Image
    caption: str
    url: str | None  # None: no .json (the key stands in for the url)
    ext: str = "jpg"


def scene_samples(count: int, prefix: str = "https://scenes.example.com/", size: int = 48) -> list[Sample]:
    """`count` scene images with their captions, keyed as img2dataset keys them (000000000, ...)."""
    rnd = random.Random(count)
    every = scenes.all_scenes()
    chosen = [every[(7 * i) % len(every)] for i in range(count)]
    return [
        Sample(f"{i:09d}", scenes.draw(scene, size, size, rnd), scene.caption, f"{prefix}{i}.png")
        for i, scene in enumerate(chosen)
    ]


def write_holdout_tar(path: Path, samples: Sequence[Sample]) -> Path:
    """A webdataset tar with img2dataset's member names: <key>.<ext>, <key>.txt, <key>.json."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for sample in samples:
            buffer = io.BytesIO()
            sample.image.save(buffer, format={"jpg": "JPEG"}.get(sample.ext, sample.ext.upper()))
            members = {sample.ext: buffer.getvalue(), "txt": sample.caption.encode("utf-8")}
            if sample.url is not None:
                members["json"] = json.dumps({"url": sample.url, "key": sample.key, "status": "success"}).encode()
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{sample.key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="session")
def evaluation_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny random base; a "trained" copy with training's sdflow_model.json; its model.tar.gz."""
    root = tmp_path_factory.mktemp("models")
    base = build_tiny_pipeline(root / "base", 0, 0)
    trained = root / "trained"
    shutil.copytree(base, trained)
    (trained / "sdflow_model.json").write_text(json.dumps({"resolution": 32, "dtype": "float32", "steps": 1}))
    archive = root / "artifact"
    archive.mkdir()
    # As training leaves it: the files at the archive's root, no folder around them.
    with tarfile.open(archive / "model.tar.gz", "w:gz") as tar:
        for path in sorted(trained.iterdir()):
            tar.add(path, arcname=path.name)
    return {"base": base, "trained": trained, "archive": archive}


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A transformers CLIPModel folder with its processor (random weights: the path, not the scores)."""
    return build_tiny_clip(tmp_path_factory.mktemp("clip") / "tiny-clip", train_steps=0)
