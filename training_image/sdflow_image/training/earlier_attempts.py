"""A new training job of a run starts from where the run's earlier jobs got to.

Every training job of a run (a Retry after a failure, a redrive, a capacity retry) has its own
CheckpointConfig prefix, `runs/<run>/checkpoints/<job name>/`, so one attempt never overwrites
another's. SageMaker gives a job only its own prefix: a redriven job started from step 0 although
the failed one had saved a complete checkpoint (seen at step 8). The run document, and with it
every training setting, is the same for all of a run's jobs, so before training starts the job
looks at its siblings under `runs/<run>/checkpoints/`, takes the newest complete checkpoint
(its COMPLETE.json lists every file and its size; each is checked in S3), and downloads it into
its own checkpoints folder, which the trainer then resumes from as from its own. Its own
checkpoints, when it has any (a spot restart of the same job), come first.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdflow_image.training import checkpoints

log = logging.getLogger("sdflow.train.checkpoints")


@dataclass(frozen=True)
class Found:
    step: int
    prefix: str  # the checkpoint's key prefix: runs/<run>/checkpoints/<job>/checkpoint-XXXXXXXX/
    files: dict[str, int]  # relative path -> bytes, from its marker


def _folders(s3: Any, bucket: str, prefix: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/")
    return [common["Prefix"] for page in pages for common in page.get("CommonPrefixes", [])]


def _complete(s3: Any, bucket: str, prefix: str, step: int) -> Found | None:
    """The checkpoint at `prefix` when its marker is readable and every file it lists is in S3
    with its size; else None."""
    from botocore.exceptions import ClientError

    try:
        marker = json.loads(s3.get_object(Bucket=bucket, Key=prefix + checkpoints.MARKER)["Body"].read())
    except (ClientError, ValueError):
        return None
    files = marker.get("files") if isinstance(marker, dict) else None
    if marker.get("step") != step or not isinstance(files, dict) or not files:
        return None
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    sizes = {obj["Key"][len(prefix) :]: obj["Size"] for page in pages for obj in page.get("Contents", [])}
    if any(sizes.get(rel) != size for rel, size in files.items()):
        return None
    return Found(step, prefix, {str(rel): int(size) for rel, size in files.items()})


def newest(s3: Any, bucket: str, own_prefix: str) -> Found | None:
    """The newest complete checkpoint in the sibling job folders of `own_prefix` (its own left out)."""
    parent = own_prefix.rstrip("/").rsplit("/", 1)[0] + "/"
    best: Found | None = None
    for job_prefix in _folders(s3, bucket, parent):
        if job_prefix == own_prefix:
            continue
        candidates = []
        for folder in _folders(s3, bucket, job_prefix):
            step = checkpoints.step_of(folder[len(job_prefix) :].rstrip("/"))
            if step is not None and (best is None or step > best.step):
                candidates.append((step, folder))
        for step, folder in sorted(candidates, reverse=True):
            found = _complete(s3, bucket, folder, step)
            if found is not None:
                best = found
                break
    return best


def adopt(checkpoint_s3_uri: str | None, local_dir: str | Path, client: Any = None) -> Path | None:
    """Download the run's newest complete checkpoint from an earlier job into `local_dir` when
    `local_dir` has none of its own; returns the local checkpoint, or None."""
    if not checkpoint_s3_uri or checkpoints.list_checkpoints(local_dir):
        return None
    import boto3

    bucket, own_prefix = checkpoints.split_s3_uri(checkpoint_s3_uri)
    own_prefix = own_prefix if own_prefix.endswith("/") else own_prefix + "/"
    s3 = client or boto3.client("s3")
    found = newest(s3, bucket, own_prefix)
    if found is None:
        return None
    target = Path(local_dir) / checkpoints.checkpoint_name(found.step)
    for rel in found.files:
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(bucket, found.prefix + rel, str(path))
    s3.download_file(bucket, found.prefix + checkpoints.MARKER, str(target / checkpoints.MARKER))  # last
    print(
        f"resuming from s3://{bucket}/{found.prefix} (step {found.step}): the newest complete checkpoint of an "
        "earlier training job of this run",
        flush=True,
    )
    return target
