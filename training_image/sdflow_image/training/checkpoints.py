"""Checkpoints that are whole or absent, kept to the newest few on disk and in S3.

SageMaker uploads whatever appears under /opt/ml/checkpoints while the job runs, and downloads
the whole CheckpointConfig.S3Uri there before a restarted job starts ("Use checkpoints in Amazon
SageMaker AI": checkpoints are synced continuously; on restart they are copied to the local path).
A checkpoint written in place would be uploaded half-written, and a job stopped mid-save would
leave a half checkpoint for the next attempt. So a checkpoint is written in a staging folder
beside the checkpoints folder (outside SageMaker's sync), `COMPLETE.json` (every file and its
size) is written into it last, and the folder is renamed into the checkpoints folder in one
step. A checkpoint counts only when its marker lists exactly what is there.

SageMaker's sync only adds files: deleting an old checkpoint locally leaves it in S3, so rank 0
also prunes S3 (ListObjectsV2, DeleteObjects: at most 1,000 keys per request, per the S3 API
reference), keeping at least the newest two there: the newest may still be uploading.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sdflow_image.s3_uri import S3Prefix

log = logging.getLogger("sdflow.train.checkpoints")

CHECKPOINT_PREFIX = "checkpoint-"
MARKER = "COMPLETE.json"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.bin"
S3_KEEP_AT_LEAST = 2
STAGING_INSIDE = ".staging"  # inside the checkpoints folder, where no folder beside it shares its mount
DELETE_OBJECTS_MAX_KEYS = 1000  # S3 DeleteObjects: "up to 1,000 keys" per request


class CheckpointError(RuntimeError):
    """A checkpoint to resume from cannot be used."""


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def step_of(name: str) -> int | None:
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    digits = name[len(CHECKPOINT_PREFIX) :]
    return int(digits) if digits.isdigit() else None


def data_state_file(rank: int) -> str:
    return f"data_state_rank{rank}.json"


def staging_root(checkpoints_dir: str | Path) -> Path:
    """Where checkpoints are staged: on the checkpoints folder's own mount, so that publishing is
    one rename and the bytes land on the job's storage volume.

    The SageMaker developer guide documents which paths are on the ML storage volume ("The default
    paths for SageMaker training jobs are mounted to Amazon EBS volumes or NVMe SSD volumes of the
    ML instance": /opt/ml/input/data/<channel>, /opt/ml/output/data, /opt/ml/model and
    /opt/ml/checkpoints; "Managing storage paths for different types of instance local storage" and
    "SageMaker AI environment variables and the default paths for training storage locations",
    https://docs.aws.amazon.com/sagemaker/latest/dg/model-train-storage-tips-considerations.html).
    /opt/ml itself is not among them: a folder beside /opt/ml/checkpoints may be on the container's
    root file system, which a multi-GB checkpoint fills, and from which rename(2) fails with EXDEV
    (as it does between two mounts even of one file system). So the folder beside is used only
    when a probe folder made there renames into the checkpoints folder (then both are on one mount:
    the volume when either is); otherwise checkpoints are staged inside the checkpoints folder, in
    STAGING_INSIDE, which SageMaker's sync may upload (prune_s3 deletes it there)."""
    root = Path(checkpoints_dir).resolve()
    beside = root.parent / f".{root.name}-staging"
    if _renames_into(beside, root):
        return beside
    log.warning("staging checkpoints inside %s: %s is on another mount or not writable", root, beside)
    return root / STAGING_INSIDE


def _renames_into(source_parent: Path, destination: Path) -> bool:
    """Whether a folder made in `source_parent` can be renamed into `destination`."""
    try:
        destination.mkdir(parents=True, exist_ok=True)
        source_parent.mkdir(parents=True, exist_ok=True)
        probe = Path(tempfile.mkdtemp(prefix=".rename-probe-", dir=source_parent))
    except OSError:
        return False
    target = destination / probe.name
    try:
        os.rename(probe, target)
    except OSError:
        shutil.rmtree(probe, ignore_errors=True)
        return False
    os.rmdir(target)
    return True


def file_sizes(folder: Path) -> dict[str, int]:
    """Every file below `folder` (relative path → bytes), the marker left out."""
    return {
        p.relative_to(folder).as_posix(): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MARKER
    }


def write_marker(folder: Path, step: int, files: dict[str, int]) -> None:
    (folder / MARKER).write_text(json.dumps({"step": step, "files": files}, indent=1, sort_keys=True))


def is_complete(folder: Path) -> bool:
    """The marker is there and every file it lists is there with its size."""
    try:
        marker = json.loads((folder / MARKER).read_text())
        files = marker["files"]
        if step_of(folder.name) != marker["step"] or not isinstance(files, dict) or not files:
            return False
        return all((folder / rel).is_file() and (folder / rel).stat().st_size == size for rel, size in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if (step := step_of(p.name)) is not None and p.is_dir()]
    return sorted((step, p) for step, p in found if is_complete(p))


def publish(staged: Path, final: Path) -> None:
    """Move a finished checkpoint into the checkpoints folder: one rename on the same filesystem.

    Across filesystems (EXDEV) it is copied with its marker last, so a reader never counts it
    before it is whole."""
    if final.exists():
        shutil.rmtree(final)
    try:
        os.replace(staged, final)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        shutil.copytree(staged, final, ignore=shutil.ignore_patterns(MARKER))
        shutil.copy2(staged / MARKER, final / MARKER)
        shutil.rmtree(staged)


def prune_local(root: str | Path, keep: int) -> list[Path]:
    """Remove every checkpoint folder but the newest `keep` complete ones (incomplete ones too)."""
    root = Path(root)
    kept = {p for _, p in list_checkpoints(root)[-keep:]}
    removed = []
    for path in root.iterdir() if root.is_dir() else []:
        if step_of(path.name) is not None and path.is_dir() and path not in kept:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def split_s3_uri(uri: str) -> tuple[str, str]:
    try:
        location = S3Prefix.parse(uri)
    except ValueError:
        raise ValueError(f"checkpoint_s3_uri={uri!r} is not an s3://bucket/prefix/ URI") from None
    return location.bucket, location.prefix


def prune_s3(uri: str, keep: int, client: Any = None) -> list[int]:
    """Delete the checkpoints under `uri` but the newest max(keep, 2); returns the steps deleted.

    A failed delete is logged, not raised: an old checkpoint left in S3 costs storage, not correctness."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix = split_s3_uri(uri)
    s3 = client or boto3.client("s3")
    try:
        steps: dict[int, str] = {}
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                name = common["Prefix"][len(prefix) :].rstrip("/")
                if (step := step_of(name)) is not None:
                    steps[step] = common["Prefix"]
        doomed = sorted(steps)[: -max(keep, S3_KEEP_AT_LEAST)] if len(steps) > max(keep, S3_KEEP_AT_LEAST) else []
        for step in doomed:
            _delete_prefix(s3, bucket, steps[step])
        # What the sync uploaded from a staging folder inside the checkpoints folder (staging_root):
        # published since, so never read; the next prune catches files uploaded after this one.
        _delete_prefix(s3, bucket, f"{prefix}{STAGING_INSIDE}/")
    except (BotoCoreError, ClientError) as exc:
        log.warning("could not prune old checkpoints under %s: %s", uri, exc)
        return []
    return doomed


def _delete_prefix(s3: Any, bucket: str, prefix: str) -> None:
    keys = [
        obj["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for obj in page.get("Contents", [])
    ]
    for start in range(0, len(keys), DELETE_OBJECTS_MAX_KEYS):
        batch = keys[start : start + DELETE_OBJECTS_MAX_KEYS]
        response = s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
        for error in response.get("Errors", []):
            log.warning("could not delete s3://%s/%s: %s %s", bucket, error.get("Key"), error.get("Code"),
                        error.get("Message"))  # fmt: skip


def save(
    root: str | Path,
    step: int,
    write: Callable[[Path], None],
    *,
    local_rank: int,
    limit: int,
    s3_uri: str | None,
    rank: int,
) -> Path:
    """Collective: every rank calls `write(staged_folder)`; then each host's local rank 0 marks the
    checkpoint complete, renames it into `root` and prunes; rank 0 prunes S3.

    The marker lists the files of every host (gathered), identical on each: SageMaker merges the
    hosts' uploads in one S3 prefix and gives every host all of it on restart, and the checkpoint
    counts there only once every host's files arrived. A host that wrote nothing (torch_ddp:
    only rank 0 writes) publishes nothing."""
    import torch.distributed as dist

    root = Path(root)
    staged = staging_root(root) / checkpoint_name(step)
    final = root / checkpoint_name(step)
    if local_rank == 0:
        # What a save killed half-way left (one save at a time); only checkpoint folders: the other
        # local ranks may be probing the staging folder (staging_root) at this moment.
        for leftover in staged.parent.glob(f"{CHECKPOINT_PREFIX}*") if staged.parent.is_dir() else []:
            shutil.rmtree(leftover, ignore_errors=True)
        staged.mkdir(parents=True)
        root.mkdir(parents=True, exist_ok=True)
    _barrier()
    write(staged)
    _barrier()
    mine = file_sizes(staged) if local_rank == 0 else {}
    gathered: list[dict[str, int]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    every_file = {rel: size for files in gathered for rel, size in files.items()}
    if local_rank == 0:
        if mine:
            write_marker(staged, step, every_file)
            publish(staged, final)
        else:
            shutil.rmtree(staged, ignore_errors=True)
        prune_local(root, limit)
    _barrier()
    if rank == 0 and s3_uri:
        prune_s3(s3_uri, limit)
    return final


def _barrier() -> None:
    import torch.distributed as dist

    if dist.get_world_size() > 1:
        dist.barrier()


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} cannot be read ({exc}); delete the checkpoint to start afresh") from None
