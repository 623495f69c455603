"""Checkpoints that are whole or absent, on every host and in S3, kept to the newest few.

SageMaker uploads whatever appears under /opt/ml/checkpoints while the job runs, from every host
to the one CheckpointConfig.S3Uri, and downloads the whole of that prefix to every host before a
restarted job starts ("Use checkpoints in Amazon SageMaker AI": checkpoints are synced
continuously; on restart "the checkpoints from this S3 bucket are restored to
checkpoint_local_path in each instance of the new training job"). So S3 holds the union of the
hosts' folders, and a sharded checkpoint (fsdp2's DCP files, one per rank; Colossal-AI's ZeRO
shards) is whole only there, or on a host after a restart: never on one host while the job runs.

A checkpoint written in place would be uploaded half-written, and a job stopped mid-save would
leave a half checkpoint for the next attempt. So each host writes its part in a staging folder
beside the checkpoints folder (outside SageMaker's sync), then its marker, `COMPLETE.host-<h>.json`
(h: the host's place among the hosts, node rank order), and renames the folder into the
checkpoints folder in one step. A host's marker lists that host's own files and their sizes, the
save's id, and which hosts wrote a part (`hosts`: every host under the sharded plugins; host 0
alone when rank 0 writes everything, torch_ddp and ddp). Two readings follow:
- a host's part is there (`holds_part`): its marker lists exactly what it wrote. Local pruning
  keeps the newest parts this host wrote, so no host deletes the part it just wrote because the
  others' files are elsewhere.
- the checkpoint is complete (`is_complete`, what resuming takes): the marker of every host in
  `hosts` is there, all of one save, and every file any of them lists is there with its size; a
  missing host's marker, or a stale one from another save of the same step, leaves it incomplete.

SageMaker's sync only adds files: deleting an old checkpoint locally leaves it in S3, so rank 0
also prunes S3 (ListObjectsV2, whose entries carry each object's size; DeleteObjects: at most
1,000 keys per request, per the S3 API reference). It reads the markers there and never deletes
the newest checkpoint complete in S3, nor anything newer (it may still be uploading): an upload
slower than `checkpointing_steps` must not delete the only checkpoint a restart can use. Only
folders older than the newest `keep` complete ones go.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdflow_image.s3_uri import S3Prefix

log = logging.getLogger("sdflow.train.checkpoints")

CHECKPOINT_PREFIX = "checkpoint-"
MARKER_GLOB = "COMPLETE.host-*.json"
MARKER_NAME = re.compile(r"COMPLETE\.host-(\d+)\.json")
TRAINER_STATE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.bin"
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


def marker_name(host: int) -> str:
    return f"COMPLETE.host-{host}.json"


def host_of_marker(name: str) -> int | None:
    """The host whose marker a file of a checkpoint folder is (a top-level name), else None."""
    match = MARKER_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


# --- markers ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """One host's marker: what that host wrote of one save of a checkpoint."""

    host: int
    step: int
    save_id: str  # one per save, the same in every host's marker: a stale marker of an earlier save differs
    hosts: tuple[int, ...]  # the hosts that wrote a part of this save
    files: dict[str, int]  # this host's files: relative path -> bytes

    def to_json(self) -> str:
        doc = {"host": self.host, "step": self.step, "save": self.save_id, "hosts": list(self.hosts),
               "files": self.files}  # fmt: skip
        return json.dumps(doc, indent=1, sort_keys=True)


def parse_part(host: int, text: str | bytes) -> Part | None:
    """The marker named for `host`, or None when it is not a well-formed marker of that host."""
    try:
        raw = json.loads(text)
        files, hosts = raw["files"], raw["hosts"]
        if raw["host"] != host or not isinstance(files, dict) or not files or not isinstance(hosts, list):
            return None
        part = Part(host, int(raw["step"]), str(raw["save"]), tuple(int(h) for h in hosts),
                    {str(rel): int(size) for rel, size in files.items()})  # fmt: skip
    except (ValueError, KeyError, TypeError):
        return None
    return part if host in part.hosts else None


def whole(parts: Mapping[int, Part], step: int | None) -> dict[str, int] | None:
    """Every file of a checkpoint (relative path -> bytes) when `parts`, the markers found by host,
    make it whole: the marker of each host that wrote a part and no other, all of one save of
    `step`, no path listed twice with two sizes. None otherwise."""
    if not parts or step is None:
        return None
    first = next(iter(parts.values()))
    if set(parts) != set(first.hosts):
        return None  # a host's marker is missing (not uploaded yet), or a stranger's is there
    files: dict[str, int] = {}
    for part in parts.values():
        if (part.step, part.save_id, part.hosts) != (step, first.save_id, first.hosts):
            return None
        for rel, size in part.files.items():
            if files.setdefault(rel, size) != size:
                return None
    return files


def write_marker(
    folder: Path, step: int, files: dict[str, int], *, host: int = 0, hosts: tuple[int, ...] = (0,),
    save_id: str | None = None,
) -> None:  # fmt: skip
    part = Part(host, step, save_id or uuid.uuid4().hex, hosts, files)
    (folder / marker_name(host)).write_text(part.to_json())


def read_parts(folder: Path) -> dict[int, Part]:
    """The well-formed markers in `folder`, by host."""
    parts = {}
    for path in folder.glob(MARKER_GLOB):
        host = host_of_marker(path.name)
        try:
            part = parse_part(host, path.read_bytes()) if host is not None else None
        except OSError:
            part = None
        if part is not None:
            parts[part.host] = part
    return parts


def file_sizes(folder: Path) -> dict[str, int]:
    """Every file below `folder` (relative path -> bytes), the markers left out."""
    return {
        rel: p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and host_of_marker(rel := p.relative_to(folder).as_posix()) is None
    }


def _files_there(folder: Path, files: dict[str, int]) -> bool:
    try:
        return all((folder / rel).is_file() and (folder / rel).stat().st_size == size for rel, size in files.items())
    except OSError:
        return False


def is_complete(folder: Path) -> bool:
    """Every host's part of the checkpoint is here (the merged view S3 and a restarted host have)."""
    files = whole(read_parts(folder), step_of(folder.name))
    return files is not None and _files_there(folder, files)


def holds_part(folder: Path, host: int) -> bool:
    """`host`'s marker is here and every file it lists is here with its size (the others' may not be)."""
    part = read_parts(folder).get(host)
    return part is not None and part.step == step_of(folder.name) and _files_there(folder, part.files)


def part_bytes(folder: Path) -> int:
    """The most bytes one host wrote of the checkpoint in `folder`, by its markers (0 without any)."""
    return max((sum(part.files.values()) for part in read_parts(folder).values()), default=0)


def _checkpoint_folders(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    return sorted((step, p) for p in root.iterdir() if (step := step_of(p.name)) is not None and p.is_dir())


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    return [(step, p) for step, p in _checkpoint_folders(Path(root)) if is_complete(p)]


# --- staging and publishing -------------------------------------------------------------------------


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


def publish(staged: Path, final: Path) -> None:
    """Move a finished checkpoint into the checkpoints folder: one rename on the same filesystem.

    Across filesystems (EXDEV) it is copied with its markers last, so a reader never counts it
    before it is whole."""
    if final.exists():
        shutil.rmtree(final)
    try:
        os.replace(staged, final)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        shutil.copytree(staged, final, ignore=shutil.ignore_patterns(MARKER_GLOB))
        for marker in sorted(staged.glob(MARKER_GLOB)):
            shutil.copy2(marker, final / marker.name)
        shutil.rmtree(staged)


def prune_local(root: str | Path, keep: int, host: int = 0) -> list[Path]:
    """Remove every checkpoint folder but the newest `keep` that hold this host's part (or, on a
    host that wrote none, are complete): the others' parts are on their own hosts until S3
    merges them, so completeness cannot be asked of a folder this host just wrote."""
    found = _checkpoint_folders(Path(root))
    kept = [p for _, p in found if holds_part(p, host) or is_complete(p)][-keep:]
    removed = []
    for _, path in found:
        if path not in kept:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


# --- S3 ---------------------------------------------------------------------------------------------


def split_s3_uri(uri: str) -> tuple[str, str]:
    try:
        location = S3Prefix.parse(uri)
    except ValueError:
        raise ValueError(f"checkpoint_s3_uri={uri!r} is not an s3://bucket/prefix/ URI") from None
    return location.bucket, location.prefix


@dataclass(frozen=True)
class InS3:
    """A checkpoint complete in S3."""

    step: int
    prefix: str  # the checkpoint's key prefix, ending in checkpoint-XXXXXXXX/
    files: dict[str, int]  # every host's files: relative path -> bytes
    markers: tuple[str, ...]  # the markers' relative paths (download them last)


def s3_folders(s3: Any, bucket: str, prefix: str) -> dict[int, tuple[str, dict[str, int]]]:
    """The checkpoint folders under `prefix` (ending in "/" or empty) from one listing: step ->
    (folder prefix, relative key -> size)."""
    folders: dict[int, tuple[str, dict[str, int]]] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            name, _, rel = obj["Key"][len(prefix) :].partition("/")
            if (step := step_of(name)) is not None and rel:
                folders.setdefault(step, (f"{prefix}{name}/", {}))[1][rel] = int(obj["Size"])
    return folders


def s3_complete(s3: Any, bucket: str, folder: str, step: int, sizes: dict[str, int]) -> InS3 | None:
    """The checkpoint at `folder` when it is complete in S3 (what is_complete asks of a local
    folder, with the sizes ListObjectsV2 gave as `sizes`); None otherwise."""
    from botocore.exceptions import ClientError

    parts = {}
    for rel in sizes:
        host = host_of_marker(rel)
        if host is None:
            continue
        try:
            body = s3.get_object(Bucket=bucket, Key=folder + rel)["Body"].read()
        except ClientError:  # deleted since the listing
            continue
        if (part := parse_part(host, body)) is not None:
            parts[host] = part
    files = whole(parts, step)
    if files is None or any(sizes.get(rel) != size for rel, size in files.items()):
        return None
    return InS3(step, folder, files, tuple(marker_name(h) for h in sorted(parts)))


def prune_s3(uri: str, keep: int, client: Any = None) -> list[int]:
    """Delete the checkpoints under `uri` older than the newest `keep` complete there; returns
    the steps deleted. Nothing goes while fewer than `keep` are complete in S3, and nothing newer
    than the oldest kept one (an incomplete newer one may still be uploading).

    A failed delete is logged, not raised: an old checkpoint left in S3 costs storage, not correctness."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix = split_s3_uri(uri)
    s3 = client or boto3.client("s3")
    try:
        folders = s3_folders(s3, bucket, prefix)
        complete: list[int] = []
        for step in sorted(folders, reverse=True):
            if len(complete) == keep:
                break
            folder, sizes = folders[step]
            if s3_complete(s3, bucket, folder, step, sizes) is not None:
                complete.append(step)
        doomed = [step for step in sorted(folders) if step < complete[-1]] if len(complete) == keep else []
        for step in doomed:
            _delete_prefix(s3, bucket, folders[step][0])
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


# --- the collective save ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Saved:
    path: Path  # this host's checkpoint folder (absent on a host that wrote nothing)
    largest_part_bytes: int  # the most bytes one host wrote: what a stop-save would write (training.stop_save)


def save(
    root: str | Path,
    step: int,
    write: Callable[[Path], None],
    *,
    local_rank: int,
    limit: int,
    s3_uri: str | None,
    rank: int,
) -> Saved:
    """Collective: every rank calls `write(staged_folder)`; then each host's local rank 0 writes
    its host's marker (its own files), renames the folder into `root` and prunes; rank 0 prunes S3.

    Hosts are numbered by their local rank 0's global rank, which torchrun assigns in node rank
    order (torch/distributed/elastic/agent/server/api.py, `_assign_worker_ranks`: a node's workers
    are `group_rank * local_world_size + local_rank`), so a restarted job with the same hosts reads
    the same host numbers. A host that wrote nothing (torch_ddp, ddp: only rank 0 writes)
    publishes nothing and is not among the marker's `hosts`."""
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
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (local_rank, mine, uuid.uuid4().hex if rank == 0 else ""))
    firsts = [r for r, (lr, _, _) in enumerate(gathered) if lr == 0]  # each host's local rank 0
    writers = tuple(host for host, r in enumerate(firsts) if gathered[r][1])
    if local_rank == 0:
        host = firsts.index(rank)
        if mine:
            write_marker(staged, step, mine, host=host, hosts=writers, save_id=gathered[0][2])
            publish(staged, final)
        else:
            shutil.rmtree(staged, ignore_errors=True)
        prune_local(root, limit, host)
    _barrier()
    if rank == 0 and s3_uri:
        prune_s3(s3_uri, limit)
    return Saved(final, max((sum(gathered[r][1].values()) for r in firsts), default=0))


def _barrier() -> None:
    import torch.distributed as dist

    if dist.get_world_size() > 1:
        dist.barrier()


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} cannot be read ({exc}); delete the checkpoint to start afresh") from None
