"""The GPU acceptance's inputs (bench/gpu_acceptance.py): a base model of the family asked for,
random at full size or tiny, and webdataset shards, in a folder or on a local S3 (moto's server).
Apart from gpu_acceptance.py to keep each module short; `weight_difference` compares two saved models."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BUCKET = "sdflow-acceptance"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- inputs -------------------------------------------------------------------------------


def write_shards(root: Path, size: int, shards: int = 4, per_shard: int = 16, seed: int = 0) -> Path:
    """`root/shards/<id>/00000.tar` of scene images and captions, and `root/index.json`, as
    img2dataset and build_index lay them out; images up to a quarter larger than `size`."""
    import io
    import random
    import tarfile

    from sdflow_image import scenes

    rnd, every, entries = random.Random(seed), scenes.all_scenes(), []
    for shard in range(shards):
        folder = root / "shards" / f"{shard:05d}"
        folder.mkdir(parents=True, exist_ok=True)
        with tarfile.open(folder / "00000.tar", "w") as tar:
            for i in range(per_shard):
                scene = rnd.choice(every)
                image = scenes.draw(scene, size + rnd.randrange(size // 4 + 1), size, rnd)
                jpeg = io.BytesIO()
                image.save(jpeg, "JPEG", quality=90)
                key = f"{shard:05d}{i:04d}"
                for name, data in (
                    (f"{key}.jpg", jpeg.getvalue()),
                    (f"{key}.txt", scene.caption.encode()),
                    (f"{key}.json", json.dumps({"key": key, "caption": scene.caption, "status": "success"}).encode()),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        entries.append(
            {"shard_id": f"{shard:05d}", "tar_files": [f"shards/{shard:05d}/00000.tar"], "samples": per_shard}
        )
    index = {"version": 1, "run_id": "acceptance", "total_samples": shards * per_shard, "shards": entries,
             "failed_shards": [], "image_size": size}  # fmt: skip
    (root / "index.json").write_text(json.dumps(index))
    return root


@contextmanager
def local_s3(folder: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """moto's S3 server on 127.0.0.1 holding `folder` under s3://BUCKET/runs/; yields the
    dataset_dir and the environment the training processes need to reach it."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # not a line per GET
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "acceptance",
        "AWS_SECRET_ACCESS_KEY": "acceptance",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    try:
        s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="acceptance", aws_secret_access_key="acceptance")  # fmt: skip
        s3.create_bucket(Bucket=BUCKET)
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            s3.upload_file(str(path), BUCKET, f"runs/{path.relative_to(folder).as_posix()}")
        yield f"s3://{BUCKET}/runs/", env
    finally:
        server.stop()


@contextmanager
def in_folder(shards: Path) -> Iterator[tuple[str, dict[str, str]]]:
    yield str(shards), {}


# The new families' full-size variant a row trains unless --variant says (random_families_next.VARIANTS);
# their published models are trained at 1024 px, as diffusers' scripts default.
DEFAULT_VARIANT = {"sd35": "sd35-medium", "flux2": "flux2-klein-4b", "qwenimage": "qwenimage"}
NEW_FAMILY_RESOLUTION = 1024


def build_base(folder: Path, family: str, tiny: bool, variant: str | None = None) -> tuple[Path, int]:
    """The base model of `family` and its resolution: tiny (32 px, CPU) or random at full size.
    SD 3 and SD 3.5 are built without T5 either way, so a tiny row takes the path its full-size
    row takes. The new families' full-size models are built on the GPU (minutes on a CPU)."""
    if tiny:
        from sdflow_image.builders import tiny, tiny_model

        return tiny.build_tiny(family, folder, with_t5=False), tiny_model.IMAGE_SIZE
    if family in DEFAULT_VARIANT:
        from sdflow_image.builders import random_families_next

        chosen = variant or DEFAULT_VARIANT[family]
        if random_families_next.FAMILY_OF.get(chosen) != family:
            raise ValueError(f"variant={chosen!r} is not a {family} model: use one of {random_families_next.VARIANTS}")
        built = random_families_next.build_pipeline(chosen, folder, device="cuda", with_t5=False)
        return built, NEW_FAMILY_RESOLUTION
    if family == "sd":
        from sdflow_image.builders import random_sd15

        return random_sd15.build_pipeline(folder), random_sd15.RESOLUTION
    from sdflow_image.builders import random_families

    return random_families.build_pipeline(family, folder), random_families.RESOLUTION


# --- comparing saved models -----------------------------------------------------------------


def weight_difference(a: Path, b: Path) -> float:
    """Relative L2 difference of two saved models: safetensors files, or every one in two folders."""
    from safetensors.torch import load_file

    def load(folder: Path) -> dict[str, Any]:
        tensors: dict[str, Any] = {}
        for file in [folder] if folder.is_file() else sorted(folder.glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        return tensors

    left, right = load(a), load(b)
    if left.keys() != right.keys() or not left:
        raise ValueError(f"{a} and {b} hold different tensors")
    diff = norm = 0.0
    for key, tensor in left.items():
        x, y = tensor.double(), right[key].double()
        diff += float((x - y).pow(2).sum())
        norm += float(x.pow(2).sum())
    return math.sqrt(diff / norm) if norm else math.sqrt(diff)
