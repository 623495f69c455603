"""A sharded checkpoint of two hosts survives on each host, is whole once S3 merges them, and a job
restarted from S3 alone resumes from it.

Two `bin/train` processes on localhost, each its own SageMaker host (its own /opt/ml, torchrun with
one gloo process per host), train SD 3's tiny transformer under FSDP2 (`plugin=fsdp2`): each rank
writes its own DCP shard (`dcp/__<rank>_0.distcp`), so neither host's folder holds the whole
checkpoint. SageMaker's sync uploads both hosts' /opt/ml/checkpoints to one S3 prefix, and a
restarted job's hosts each get the whole prefix ("Use checkpoints in Amazon SageMaker AI"); here S3
is moto's server and the sync is an upload of each host's folder, then a download of the prefix
into each new host's folder. One run of two steps with a checkpoint at step 1, one restart that
trains step 2 again: it must log the loss the first run logged (same draws, same data position,
same Adam state from the shards).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import train_runs as runs
from data_fixtures import local_s3
from train_fixtures import write_job_config
from train_runs import SD3_HP

from sdflow_image.training import checkpoints
from tests.helpers import free_port

HOSTS = ["algo-1", "algo-2"]
BUCKET = "sdflow-data"
PREFIX = "runs/run-1/checkpoints/sdf-tr-run-1-r0-a0/"
# Two steps, a checkpoint after the first: the fewest that checkpoint, then train on from it.
HP = {**SD3_HP, "plugin": "fsdp2", "max_train_steps": "2", "checkpointing_steps": "1", "checkpoints_total_limit": "1"}


def two_hosts(tmp: Path, base: Path, dataset: Path) -> list[Path]:
    """Each host's /opt/ml, as a two-instance job's hosts have them."""
    return [
        write_job_config(tmp / host, HP, dataset_dir=dataset, base_model_dir=base, hosts=HOSTS, current_host=host)
        for host in HOSTS
    ]


def run_hosts(opt_mls: list[Path]) -> str:
    """`bin/train` on each host at once; host 1's (rank 0's) output. Fails the test if either fails."""
    master = {"SDFLOW_MASTER_ADDR": "127.0.0.1", "SDFLOW_MASTER_PORT": str(free_port())}
    command = [sys.executable, str(runs.BIN_TRAIN)]
    output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    procs = [subprocess.Popen(command, env={**runs.job_env(opt_ml), **master}, **output) for opt_ml in opt_mls]
    outputs = [p.communicate(timeout=runs.TIMEOUT)[0] for p in procs]
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-4000:]
    return outputs[0]


def sync_up(s3: Any, opt_ml: Path) -> None:
    """What SageMaker's sync uploads of one host's /opt/ml/checkpoints."""
    root = opt_ml / "checkpoints"
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        s3.upload_file(str(path), BUCKET, PREFIX + path.relative_to(root).as_posix())


def sync_down(s3: Any, opt_ml: Path) -> None:
    """What a restarted job's host gets before it starts: the whole prefix."""
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=PREFIX):
        for obj in page.get("Contents", []):
            target = opt_ml / "checkpoints" / obj["Key"][len(PREFIX) :]
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(BUCKET, obj["Key"], str(target))


@pytest.fixture
def s3() -> Iterator[Any]:
    with local_s3() as client:
        client.create_bucket(Bucket=BUCKET)
        yield client


def test_fsdp2_two_hosts_checkpoint_survives_on_each_host_merges_complete_in_s3_and_resumes_there(
    tmp_path: Path, bases: Callable[[str], Path], dataset: Path, s3: Any
) -> None:
    base = bases("sd3")
    first = two_hosts(tmp_path / "first", base, dataset)
    losses = runs.losses(run_hosts(first))
    assert sorted(losses) == [1, 2]
    name = checkpoints.checkpoint_name(1)
    for host, opt_ml in enumerate(first):
        folder = opt_ml / "checkpoints" / name
        assert checkpoints.holds_part(folder, host), f"host {host} lost the part of step 1 it wrote"
        assert (folder / "dcp" / f"__{host}_0.distcp").is_file()
        assert not checkpoints.is_complete(folder), "one host's folder holds only its own shard"

    for opt_ml in first:
        sync_up(s3, opt_ml)
    folders = checkpoints.s3_folders(s3, BUCKET, PREFIX)
    whole = [s for s, (folder, sizes) in folders.items() if checkpoints.s3_complete(s3, BUCKET, folder, s, sizes)]
    assert whole == [1]

    # A restarted job (spot) on two fresh hosts: its checkpoints are what S3 holds, nothing else.
    again = two_hosts(tmp_path / "again", base, dataset)
    for opt_ml in again:
        sync_down(s3, opt_ml)
        assert checkpoints.list_checkpoints(opt_ml / "checkpoints") == [(1, opt_ml / "checkpoints" / name)]
    resumed_out = run_hosts(again)
    assert f"resumed from checkpoint {again[0] / 'checkpoints' / name} at step 1" in resumed_out
    assert runs.losses(resumed_out) == pytest.approx({2: losses[2]}, rel=1e-5, abs=1e-7)
    assert not (again[1] / "model" / "training_summary.json").exists(), "only rank 0 writes the model"
