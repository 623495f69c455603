"""Checkpoints are whole or absent in the synced folder, and old ones go locally and in S3.

S3 is moto's server on 127.0.0.1 (`local_s3`), reached the way a job container reaches it
(AWS_ENDPOINT_URL); a denied request comes from botocore's Stubber."""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from data_fixtures import local_s3
from train_fixtures import gloo_world_of_one

from sdflow_image.training import checkpoints, earlier_attempts

pytestmark = pytest.mark.image

BUCKET = "sdflow-data"
PREFIX = "runs/run-1/checkpoints/job-1/"


@pytest.fixture(scope="module")
def process_group() -> Iterator[None]:
    with gloo_world_of_one():
        yield


def _write_files(folder: Path, step: int) -> None:
    (folder / "unet").mkdir(parents=True, exist_ok=True)
    (folder / "unet" / "model.safetensors").write_bytes(b"w" * (100 + step))
    (folder / checkpoints.TRAINER_STATE).write_text(json.dumps({"step": step}))


def _complete(root: Path, step: int) -> Path:
    folder = root / checkpoints.checkpoint_name(step)
    _write_files(folder, step)
    checkpoints.write_marker(folder, step, checkpoints.file_sizes(folder))
    return folder


def _save(root: Path, step: int, limit: int = 2, s3_uri: str | None = None, write: Any = None) -> Path:
    return checkpoints.save(
        root,
        step,
        write or (lambda folder: _write_files(folder, step)),
        local_rank=0,
        limit=limit,
        s3_uri=s3_uri,
        rank=0,
    )


# --- what counts as a checkpoint ------------------------------------------------------------------


def test_list_checkpoints_counts_only_those_whose_marker_matches(tmp_path: Path) -> None:
    _complete(tmp_path, 1)
    _write_files(tmp_path / checkpoints.checkpoint_name(2), 2)  # no marker: a save cut short
    short = _complete(tmp_path, 3)
    (short / "unet" / "model.safetensors").write_bytes(b"w")  # a file shorter than the marker says
    missing = _complete(tmp_path, 4)
    (missing / checkpoints.TRAINER_STATE).unlink()  # a file the marker lists is not there
    renamed = _complete(tmp_path, 5)
    os.rename(renamed, tmp_path / checkpoints.checkpoint_name(6))  # marker of another step
    assert [step for step, _ in checkpoints.list_checkpoints(tmp_path)] == [1]


def test_file_sizes_lists_nested_files_but_not_the_marker(tmp_path: Path) -> None:
    folder = _complete(tmp_path, 7)
    marker = json.loads((folder / checkpoints.MARKER).read_text())
    assert marker == {"step": 7, "files": {"trainer_state.json": 11, "unet/model.safetensors": 107}}


# --- saving: staged, marked, renamed ----------------------------------------------------------------


def test_save_writes_in_staging_outside_the_synced_folder(tmp_path: Path, process_group: None) -> None:
    root = tmp_path / "checkpoints"
    seen: list[Path] = []

    def write(folder: Path) -> None:
        seen.append(folder)
        assert root.resolve() not in folder.resolve().parents
        assert not (root / checkpoints.checkpoint_name(3)).exists()
        _write_files(folder, 3)

    final = _save(root, 3, write=write)
    assert seen[0].parent == tmp_path / ".checkpoints-staging"
    assert final == root / checkpoints.checkpoint_name(3)
    assert checkpoints.is_complete(final)
    assert not seen[0].exists(), "the staged folder is renamed, not copied"


def test_save_clears_earlier_leftovers_in_staging_but_not_other_ranks_probes(
    tmp_path: Path, process_group: None
) -> None:
    root = tmp_path / "checkpoints"
    staging = checkpoints.staging_root(root)
    _write_files(staging / checkpoints.checkpoint_name(9), 9)  # a save of another step, killed
    probe = staging / ".rename-probe-of-another-rank"
    probe.mkdir()
    _save(root, 3)
    assert not (staging / checkpoints.checkpoint_name(9)).exists()
    assert probe.is_dir(), "another local rank's staging probe is left alone"


@pytest.fixture
def checkpoints_mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp_path/checkpoints as a mount of its own, as /opt/ml/checkpoints may be under /opt/ml on
    the container's root file system: rename(2) in or out of it fails with EXDEV, and a copy across
    it fails the test (a cross-device copy of a multi-GB checkpoint is what staging must avoid)."""
    root = (tmp_path / "checkpoints").resolve()

    def inside(path: Any) -> bool:
        resolved = Path(path).resolve()
        return resolved == root or root in resolved.parents

    for name in ("rename", "replace"):
        real = getattr(os, name)

        def crossing(src: Any, dst: Any, *, _real: Any = real) -> None:
            if inside(src) != inside(dst):
                raise OSError(errno.EXDEV, "Invalid cross-device link")
            _real(src, dst)

        monkeypatch.setattr(os, name, crossing)

    def no_copy(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"copied across file systems: {args}")

    monkeypatch.setattr(checkpoints.shutil, "copytree", no_copy)
    return root


def test_save_checkpoints_folder_on_its_own_mount_stages_inside_it_and_renames(
    checkpoints_mount: Path, tmp_path: Path, process_group: None
) -> None:
    seen: list[Path] = []

    def write(folder: Path) -> None:
        seen.append(folder)
        _write_files(folder, 3)

    final = _save(checkpoints_mount, 3, write=write)
    assert seen[0].parent == checkpoints_mount / checkpoints.STAGING_INSIDE
    assert checkpoints.is_complete(final)
    assert not seen[0].exists(), "the staged folder is renamed, not copied"
    beside = tmp_path / ".checkpoints-staging"
    assert not any(beside.rglob("*")), "nothing is written outside the checkpoints folder's mount"
    assert [step for step, _ in checkpoints.list_checkpoints(checkpoints_mount)] == [3]


def test_save_killed_mid_write_leaves_nothing_in_synced_folder_and_next_save_recovers(
    tmp_path: Path, process_group: None
) -> None:
    root = tmp_path / "checkpoints"
    _save(root, 1)

    def dies_half_way(folder: Path) -> None:
        (folder / "unet").mkdir()
        (folder / "unet" / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # stands for the SIGKILL after SageMaker's stop timeout

    with pytest.raises(KeyboardInterrupt):
        _save(root, 2, write=dies_half_way)
    assert sorted(p.name for p in root.iterdir()) == [checkpoints.checkpoint_name(1)]
    _save(root, 2)  # the next attempt replaces the half-written staging folder
    assert [s for s, _ in checkpoints.list_checkpoints(root)] == [1, 2]


def test_save_keeps_newest_limit_locally_and_drops_incomplete_ones(tmp_path: Path, process_group: None) -> None:
    root = tmp_path / "checkpoints"
    _write_files(root / checkpoints.checkpoint_name(9), 9)  # an incomplete one synced down from S3
    for step in range(1, 5):
        _save(root, step, limit=2)
    assert sorted(p.name for p in root.iterdir()) == [checkpoints.checkpoint_name(3), checkpoints.checkpoint_name(4)]


def test_publish_across_filesystems_copies_with_marker_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    staged = _complete(tmp_path / "staging", 5)
    final = tmp_path / "checkpoints" / staged.name
    final.parent.mkdir()
    copied: list[str] = []
    real_copy2 = checkpoints.shutil.copy2

    def exdev(src: Any, dst: Any) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    def recording_copy2(src: Any, dst: Any, **kwargs: Any) -> Any:
        copied.append(Path(src).name)
        return real_copy2(src, dst, **kwargs)

    monkeypatch.setattr(checkpoints.os, "replace", exdev)
    monkeypatch.setattr(checkpoints.shutil, "copy2", recording_copy2)
    checkpoints.publish(staged, final)
    assert checkpoints.is_complete(final)
    assert copied[-1] == checkpoints.MARKER
    assert not staged.exists()


# --- pruning S3 -------------------------------------------------------------------------------------


@pytest.fixture
def s3() -> Iterator[Any]:
    import urllib.request

    with local_s3() as client:
        # moto keeps its backends per process, not per server: start each test from an empty S3.
        urllib.request.urlopen(
            urllib.request.Request(f"{os.environ['AWS_ENDPOINT_URL']}/moto-api/reset", method="POST")
        )
        client.create_bucket(Bucket=BUCKET)
        yield client


def _upload(client: Any, step: int, files: int = 2) -> None:
    for i in range(files):
        client.put_object(Bucket=BUCKET, Key=f"{PREFIX}{checkpoints.checkpoint_name(step)}/f{i}", Body=b"x")


def _steps_in_s3(client: Any) -> list[int]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=PREFIX)
    keys = [obj["Key"] for page in pages for obj in page.get("Contents", [])]
    steps = {checkpoints.step_of(k[len(PREFIX) :].split("/")[0]) for k in keys}
    return sorted(step for step in steps if step is not None)


@pytest.mark.parametrize(("keep", "left"), [(1, [4, 5]), (2, [4, 5]), (3, [3, 4, 5])])
def test_prune_s3_keeps_newest_limit_but_never_fewer_than_two(s3: Any, keep: int, left: list[int]) -> None:
    for step in range(1, 6):
        _upload(s3, step)
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}notes.txt", Body=b"not a checkpoint")
    deleted = checkpoints.prune_s3(f"s3://{BUCKET}/{PREFIX}", keep)
    assert deleted == [s for s in range(1, 6) if s not in left]
    assert _steps_in_s3(s3) == left
    assert s3.get_object(Bucket=BUCKET, Key=f"{PREFIX}notes.txt")["Body"].read() == b"not a checkpoint"


def test_prune_s3_checkpoint_over_1000_objects_is_deleted_in_batches(s3: Any) -> None:
    _upload(s3, 1, files=checkpoints.DELETE_OBJECTS_MAX_KEYS + 5)
    for step in (2, 3):
        _upload(s3, step)
    assert checkpoints.prune_s3(f"s3://{BUCKET}/{PREFIX.rstrip('/')}", 2) == [1]
    assert _steps_in_s3(s3) == [2, 3]


def test_prune_s3_deletes_what_the_sync_uploaded_from_staging_inside(s3: Any) -> None:
    for step in (1, 2):
        _upload(s3, step)
    staged_key = f"{PREFIX}{checkpoints.STAGING_INSIDE}/{checkpoints.checkpoint_name(2)}/unet/model.safetensors"
    s3.put_object(Bucket=BUCKET, Key=staged_key, Body=b"half")
    assert checkpoints.prune_s3(f"s3://{BUCKET}/{PREFIX}", 2) == []
    assert s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}{checkpoints.STAGING_INSIDE}/")["KeyCount"] == 0
    assert _steps_in_s3(s3) == [1, 2]


def test_save_with_checkpoint_s3_uri_prunes_s3_too(tmp_path: Path, s3: Any, process_group: None) -> None:
    for step in (1, 2, 3):
        _upload(s3, step)
    _save(tmp_path / "checkpoints", 4, limit=2, s3_uri=f"s3://{BUCKET}/{PREFIX}")
    assert _steps_in_s3(s3) == [2, 3]


def test_prune_s3_access_denied_logs_and_returns_nothing(caplog: pytest.LogCaptureFixture) -> None:
    import boto3
    from botocore.stub import Stubber

    client = boto3.client("s3", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    with Stubber(client) as stub:
        stub.add_client_error("list_objects_v2", service_error_code="AccessDenied", http_status_code=403)
        with caplog.at_level(logging.WARNING, logger="sdflow.train.checkpoints"):
            assert checkpoints.prune_s3(f"s3://{BUCKET}/{PREFIX}", 2, client=client) == []
    assert "could not prune old checkpoints" in caplog.text
    assert "AccessDenied" in caplog.text


def test_prune_s3_bad_uri_raises_naming_hyperparameter() -> None:
    with pytest.raises(ValueError, match="checkpoint_s3_uri='/local/path' is not an s3://"):
        checkpoints.prune_s3("/local/path", 2)


# --- a new job of the run starts from an earlier job's checkpoint ------------------------------

RUN_PREFIX = "runs/run-1/checkpoints/"


def _upload_complete(client: Any, tmp: Path, job: str, step: int, drop: str | None = None) -> None:
    """A complete checkpoint of `job` in S3 (with `drop` missing from S3 though its marker lists it)."""
    folder = _complete(tmp / job, step)
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel != drop:
            client.upload_file(str(path), BUCKET, f"{RUN_PREFIX}{job}/{folder.name}/{rel}")


def test_adopt_takes_newest_complete_checkpoint_of_an_earlier_job_of_the_run(
    tmp_path: Path, s3: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    _upload_complete(s3, tmp_path / "src", "sdf-tr-run-1-r0-a0", 4)
    _upload_complete(s3, tmp_path / "src", "sdf-tr-run-1-r0-a0", 9, drop="unet/model.safetensors")  # incomplete
    _upload_complete(s3, tmp_path / "src", "sdf-tr-run-1-r0-a1", 6)
    _upload_complete(s3, tmp_path / "src", "sdf-tr-run-1-r1-a0", 12)  # this job's own prefix: SageMaker syncs it
    s3.put_object(Bucket=BUCKET, Key="runs/run-2/checkpoints/sdf-tr-run-2-r0-a0/checkpoint-00000099/x", Body=b"x")

    local = tmp_path / "checkpoints"
    adopted = earlier_attempts.adopt(f"s3://{BUCKET}/{RUN_PREFIX}sdf-tr-run-1-r1-a0/", local)

    assert adopted == local / checkpoints.checkpoint_name(6)
    assert [step for step, _ in checkpoints.list_checkpoints(local)] == [6]
    assert (adopted / "unet" / "model.safetensors").read_bytes() == b"w" * 106
    assert "resuming from s3://sdflow-data/runs/run-1/checkpoints/sdf-tr-run-1-r0-a1/checkpoint-00000006/ (step 6)" in (
        capsys.readouterr().out
    )


def test_adopt_with_a_checkpoint_of_its_own_or_no_earlier_job_downloads_nothing(tmp_path: Path, s3: Any) -> None:
    own = f"s3://{BUCKET}/{RUN_PREFIX}sdf-tr-run-1-r0-a1/"
    assert earlier_attempts.adopt(own, tmp_path / "empty") is None
    _upload_complete(s3, tmp_path / "src", "sdf-tr-run-1-r0-a0", 4)
    local = tmp_path / "checkpoints"
    _complete(local, 2)  # a spot restart of the same job: its own checkpoint comes first
    assert earlier_attempts.adopt(own, local) is None
    assert [step for step, _ in checkpoints.list_checkpoints(local)] == [2]
    assert earlier_attempts.adopt(None, tmp_path / "none") is None
