"""NoOpSageMaker's training job leaves its report files where the real one's go: output.tar.gz (the output data
dir's archive), or uncompressed under the model's prefix; the files a console shows: samples.png, loss.png,
training_summary.json; its dedup job an empty summary.json."""

from __future__ import annotations

import io
import json
import tarfile

import boto3
from PIL import Image

from sdflow.local.sagemaker.noop import NoOpSageMaker
from sdflow_common.dedup_job import DedupTask, dedup_job_request
from tests.constants import REGION
from tests.unit.helpers import load_event
from tests.unit.local.helpers import ROLE, TRAINING_REQUEST, wait_for
from tests.unit.local.recorders import Recorder


def test_noop_training_job_uploads_output_archive_with_summary_and_images(aws: None) -> None:
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket="data")  # TRAINING_REQUEST's S3OutputPath: s3://data/runs/run/training/
    recorder = Recorder()
    noop = NoOpSageMaker("http://127.0.0.1:9", recorder, direct_s3=True)  # no socket: straight into moto
    try:
        noop.run_training_job(TRAINING_REQUEST)
        status, fields = wait_for(lambda: recorder.final("sdf-tr-run-a0"), what="the no-op training job")
    finally:
        noop.shutdown()
    assert status == "Completed"
    output = fields["ModelArtifacts"]["S3ModelArtifacts"].replace("/model.tar.gz", "/output.tar.gz")
    assert output == "s3://data/runs/run/training/sdf-tr-run-a0/output/output.tar.gz"

    body = s3.get_object(Bucket="data", Key=output.removeprefix("s3://data/"))["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    assert sorted(members) == ["loss.png", "samples.png", "training_summary.json"]
    for name in ("loss.png", "samples.png"):
        with Image.open(io.BytesIO(members[name])) as image:
            assert (image.format, image.size) == ("PNG", (4, 4))
    assert json.loads(members["training_summary.json"]) == {"final_loss": 0.1, "steps": 10, "noop": True}
    assert fields["TrainingStartTime"] <= fields["TrainingEndTime"], "a finished job says when it ran"
    assert fields["TrainingTimeInSeconds"] >= 1


def test_noop_training_job_uncompressed_output_leaves_report_files_under_model_prefix(aws: None) -> None:
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket="data")
    recorder = Recorder()
    noop = NoOpSageMaker("http://127.0.0.1:9", recorder, direct_s3=True)
    output = {"S3OutputPath": "s3://data/runs/run/training/", "CompressionType": "NONE"}
    try:
        noop.run_training_job({**TRAINING_REQUEST, "OutputDataConfig": output})
        status, fields = wait_for(lambda: recorder.final("sdf-tr-run-a0"), what="the no-op training job")
    finally:
        noop.shutdown()
    assert status == "Completed"
    prefix = "runs/run/training/sdf-tr-run-a0/output/model/"
    assert fields["ModelArtifacts"]["S3ModelArtifacts"] == f"s3://data/{prefix}"
    listed = s3.list_objects_v2(Bucket="data", Prefix="runs/run/training/sdf-tr-run-a0/output/")["Contents"]
    keys = sorted(item["Key"].removeprefix("runs/run/training/sdf-tr-run-a0/output/") for item in listed)
    reports = ["loss.png", "samples.png", "training_summary.json"]
    assert keys == [f"data/{name}" for name in reports] + [f"model/{name}" for name in reports]
    summary = s3.get_object(Bucket="data", Key=f"{prefix}training_summary.json")["Body"].read()
    assert json.loads(summary) == {"final_loss": 0.1, "steps": 10, "noop": True}


def test_noop_dedup_job_writes_a_summary_that_found_no_duplicate(aws: None) -> None:
    """A no-op run's Find duplicates leaves what Build dataset index reads: summary.json in the contract's shape
    (docs/contracts.md "The dedup job"), at --output_uri, with no shard dropping anything."""
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket="data")
    config = DedupTask.model_validate(load_event("find_duplicates_task.json")).config.model_copy(
        update={"bucket": "data"}
    )
    request = dedup_job_request(
        job_name="sdf-dd-run-0123456789-r0-a0", config=config, run_hash="0123456789", image_uri="i", role_arn=ROLE
    )
    recorder = Recorder()
    noop = NoOpSageMaker("http://127.0.0.1:9", recorder, direct_s3=True)
    try:
        noop.run_processing_job(request)
        status, _fields = wait_for(lambda: recorder.final("sdf-dd-run-0123456789-r0-a0"), what="the no-op dedup job")
    finally:
        noop.shutdown()

    assert status == "Completed"
    prefix = f"runs/{config.run_id}/dataset/dedup/"
    listed = [item["Key"] for item in s3.list_objects_v2(Bucket="data", Prefix=prefix)["Contents"]]
    assert listed == [f"{prefix}summary.json"], "no shard has drops: no dropped/ file"
    summary = json.loads(s3.get_object(Bucket="data", Key=f"{prefix}summary.json")["Body"].read())
    assert summary == {
        "version": 1,
        "partitions": 64,
        "shards": {},
        "url_duplicates": 0,
        "image_duplicates": 0,
        "hashed_samples": 0,
        "unhashed_shards": [],
        "duration_s": 0.0,
        "peak_rss_mb": 0,
    }
