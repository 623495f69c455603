"""A new training job of a run starts from where the run's earlier jobs got to.

Every training job of a run (a Retry after a failure, a redrive, a capacity retry) has its own
CheckpointConfig prefix, `runs/<run>/checkpoints/<job name>/`, so one attempt never overwrites
another's. SageMaker gives a job only its own prefix: a redriven job started from step 0 although
the failed one had saved a complete checkpoint (seen at step 8). The run document, and with it
every training setting, is the same for all of a run's jobs, so before training starts the job
looks at its siblings under `runs/<run>/checkpoints/`, takes the newest complete checkpoint
(every host's marker is there, all of one save, and each file they list is in S3 with its size:
checkpoints.s3_complete), and downloads the whole of it, every host's part, into
its own checkpoints folder, which the trainer then resumes from as from its own. Its own
checkpoints, when it has any (a spot restart of the same job), come first.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sdflow_image.training import checkpoints

log = logging.getLogger("sdflow.train.checkpoints")


def _folders(s3: Any, bucket: str, prefix: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/")
    return [common["Prefix"] for page in pages for common in page.get("CommonPrefixes", [])]


def newest(s3: Any, bucket: str, own_prefix: str) -> checkpoints.InS3 | None:
    """The newest complete checkpoint in the sibling job folders of `own_prefix` (its own left out)."""
    parent = own_prefix.rstrip("/").rsplit("/", 1)[0] + "/"
    best: checkpoints.InS3 | None = None
    for job_prefix in _folders(s3, bucket, parent):
        if job_prefix == own_prefix:
            continue
        folders = checkpoints.s3_folders(s3, bucket, job_prefix)
        for step in sorted(folders, reverse=True):
            if best is not None and step <= best.step:
                break
            found = checkpoints.s3_complete(s3, bucket, folders[step][0], step, folders[step][1])
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
    for marker in found.markers:  # last
        s3.download_file(bucket, found.prefix + marker, str(target / marker))
    print(
        f"resuming from s3://{bucket}/{found.prefix} (step {found.step}): the newest complete checkpoint of an "
        "earlier training job of this run",
        flush=True,
    )
    return target
