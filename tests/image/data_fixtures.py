"""Helpers for the data tests and bench: tar shards whose captions name their sample, a local S3.

Every caption is the sample's key, and `KeyTokenizer` turns it into token ids and back, so a test
can tell from a batch exactly which samples it holds."""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

MAX_LENGTH = 24
REGION = "us-east-1"


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def tiny_jpeg(seed: int, size: int = 8) -> bytes:
    """Noise, up to 2 px wider than tall: a random crop or a flip changes its pixels."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size + seed % 3, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG")
    return buffer.getvalue()


def write_key_shards(root: Path, shards: int, samples_per_shard: int, *, run: str = "run", size: int = 8) -> str:
    """`root/<run>/dataset/shards/NNNNN/00000.tar` + `root/<run>/dataset/index.json` (build_index's
    layout below `runs/`); returns the index path relative to `root` (the dataset_index flag)."""
    entries: list[dict[str, Any]] = []
    for shard in range(shards):
        relative = f"{run}/dataset/shards/{shard:05d}/00000.tar"
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(root / relative, "w") as tar:
            for i in range(samples_per_shard):
                key = f"s{shard:05d}{i:04d}"
                _add(tar, f"{key}.jpg", tiny_jpeg(shard * samples_per_shard + i, size))
                _add(tar, f"{key}.txt", key.encode())
                _add(tar, f"{key}.json", json.dumps({"key": key}).encode())
        entries.append({"shard_id": f"{shard:05d}", "tar_files": [relative], "samples": samples_per_shard})
    index = {"version": 1, "run_id": run, "total_samples": shards * samples_per_shard, "shards": entries,
             "failed_shards": [], "image_size": size}  # fmt: skip
    index_path = f"{run}/dataset/index.json"
    (root / index_path).write_text(json.dumps(index))
    return index_path


class KeyTokenizer:
    """A stand-in for CLIPTokenizer: a caption's bytes as ids, padded to MAX_LENGTH."""

    model_max_length = MAX_LENGTH

    class _Out:
        def __init__(self, ids: torch.Tensor) -> None:
            self.input_ids = ids

    def __call__(self, text: str, **_: Any) -> _Out:
        ids = list(text.encode())[:MAX_LENGTH]
        return self._Out(torch.tensor([ids + [0] * (MAX_LENGTH - len(ids))]))


def keys_of(batch: dict[str, torch.Tensor]) -> list[str]:
    return [bytes(int(v) for v in row if int(v)).decode() for row in batch["input_ids"]]


@contextmanager
def local_s3() -> Iterator[Any]:
    """moto's S3 server on 127.0.0.1, with AWS_ENDPOINT_URL and test keys in the environment (as the
    local runtime gives a job container); yields a client."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield boto3.client("s3", region_name=REGION)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


def upload_tree(client: Any, root: Path, bucket: str, prefix: str = "runs/") -> None:
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        client.upload_file(str(path), bucket, prefix + path.relative_to(root).as_posix())


def write_aspect_shards(root: Path, shards: list[list[tuple[int, int]]], *, run: str = "run") -> str:
    """Like `write_key_shards`, with each sample's stored (width, height) given: shard i holds one
    image per size in `shards[i]`. Each json records an `original_width`/`original_height` three
    times the stored size, as img2dataset records the web image it resized. Returns the index path."""
    entries: list[dict[str, Any]] = []
    for shard, sizes in enumerate(shards):
        relative = f"{run}/dataset/shards/{shard:05d}/00000.tar"
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(root / relative, "w") as tar:
            for i, (width, height) in enumerate(sizes):
                key = f"s{shard:05d}{i:04d}"
                pixels = np.random.default_rng(shard * 1000 + i).integers(0, 256, (height, width, 3), dtype=np.uint8)
                buffer = io.BytesIO()
                Image.fromarray(pixels).save(buffer, "JPEG")
                meta = {"key": key, "original_width": 3 * width, "original_height": 3 * height}
                _add(tar, f"{key}.jpg", buffer.getvalue())
                _add(tar, f"{key}.txt", key.encode())
                _add(tar, f"{key}.json", json.dumps(meta).encode())
        entries.append({"shard_id": f"{shard:05d}", "tar_files": [relative], "samples": len(sizes)})
    total = sum(len(sizes) for sizes in shards)
    index = {"version": 1, "run_id": run, "total_samples": total, "shards": entries, "failed_shards": []}
    index_path = f"{run}/dataset/index.json"
    (root / index_path).write_text(json.dumps(index))
    return index_path
