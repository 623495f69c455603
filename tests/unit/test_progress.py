"""What `sdflow watch` reports, read from S3 and the local job logs."""

from __future__ import annotations

from pathlib import Path

from sdflow import progress
from sdflow_common import names
from tests.unit.evaluation_documents import EVALUATION_URI, PACKAGE_ARN, registered_model
from tests.unit.helpers import DATA_BUCKET, AwsWorld

EXECUTION = "arn:aws:states:us-east-1:123456789012:execution:sdflow-pipeline:demo-1"
OTHER = "arn:aws:states:us-east-1:123456789012:execution:sdflow-pipeline:demo-2"
START = "2026-11-23T16:48:03.123Z"


def _log(workdir: Path, job: str, text: str) -> None:
    folder = workdir / "sagemaker" / "jobs" / job
    folder.mkdir(parents=True)
    (folder / "algo-1.log").write_text(text)


def test_progress_training_reads_this_executions_job_not_another(tmp_path: Path) -> None:
    mine = names.training_job_name(names.run_hash(EXECUTION, START), "demo-1", 0, 1)
    _log(tmp_path, names.training_job_name(names.run_hash(OTHER, START), "demo-2", 0, 0), "step=9 loss=0.9\n")
    _log(tmp_path, mine, "step=1 loss=0.5\nstep=2 loss=0.25\n")
    snap = progress.Progress(execution_arn=EXECUTION, status="RUNNING")

    progress._training(tmp_path, EXECUTION, START, snap)

    assert snap.training_job == mine
    assert (snap.training_step, snap.training_loss) == (2, 0.25)


def test_progress_shards_counts_markers_then_takes_the_index(mocked_aws: AwsWorld) -> None:
    mocked_aws.put_json("runs/demo-1/shards.json", [{"shard_id": f"{i:05d}"} for i in range(3)])
    mocked_aws.put_json("runs/demo-1/dataset/shards/00000/_SUCCESS", {"samples": 5})
    snap = progress.Progress(execution_arn=EXECUTION, status="RUNNING")

    progress._shards(mocked_aws.s3, DATA_BUCKET, "demo-1", snap)
    assert (snap.shards_total, snap.shards_done, snap.shards_failed) == (3, 1, None)
    assert progress.data_lines(snap) == []  # no counts before the index

    curation = {"rows_read": 30, "filter_drops": {}, "failed_to_download": 2, "failed_to_resize": 0, "holdout": 0,
                "url_duplicates": None, "image_duplicates": None, "kept": 28, "deduplicated": False}  # fmt: skip
    index = {"shards": [{"shard_id": "00000"}, {"shard_id": "00001"}], "failed_shards": [{"shard_id": "00002"}],
             "curation": curation}  # fmt: skip
    mocked_aws.put_json("runs/demo-1/dataset/index.json", index)
    progress._shards(mocked_aws.s3, DATA_BUCKET, "demo-1", snap)
    assert (snap.shards_total, snap.shards_done, snap.shards_failed) == (3, 2, 1)
    assert progress.data_lines(snap) == [
        "  data: 30 rows read",
        "        → 0 filtered (no filter set)",
        "        → 2 failed to download (6.7%)",
        "        → duplicates not checked (deduplication off)",
        "        → 28 kept for training (93.3%)",
    ]


def test_render_lines_succeeded_run_shows_model_metrics_gate_missing_and_grid() -> None:
    snap = progress.Progress(
        execution_arn=EXECUTION, status="SUCCEEDED", output={"registry": {"model": registered_model()}}
    )

    text = "\n".join(progress.render_lines(snap))

    assert f"  model: {PACKAGE_ARN} (Approved)" in text
    assert "    clip_score ↑: base 21.30 → trained 27.90 (64 held-out samples)" in text
    assert "    kid ↓: base 0.0510 ± 0.0040 → trained 0.0120 ± 0.0020 (64 held-out samples)" in text
    assert "    quality gate: 2 of 2 checks passed" in text
    assert "      ✓ kid (trained - base ≤ 0): base 0.0510 → trained 0.0120, change -0.0390" in text
    assert "    fid: not computed: 64 held-out samples" in text
    assert f"    held-out grid (real | base | trained per caption): {EVALUATION_URI}holdout.png" in text


def test_render_lines_run_without_registered_model_shows_no_evaluation() -> None:
    snap = progress.Progress(execution_arn=EXECUTION, status="RUNNING", output=None)

    assert not any("model" in line or "evaluation" in line for line in progress.render_lines(snap))


def test_state_lines_find_duplicates_shows_between_download_and_index() -> None:
    found = progress.Progress(
        execution_arn="arn",
        status="RUNNING",
        states={"Build dataset index": "running", "Find duplicates": "succeeded", "Download shards": "succeeded"},
        attempts={"Find duplicates": 2},
    )

    lines = progress.state_lines(found)

    assert list(lines) == ["Download shards", "Find duplicates", "Build dataset index"]
    assert lines["Find duplicates"].startswith("  ✔ Find duplicates")
    assert lines["Find duplicates"].endswith("(attempt 2)")
