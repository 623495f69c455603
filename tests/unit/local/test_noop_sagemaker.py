"""NoOpSageMaker's training job leaves its report files where the real one's go: output.tar.gz (the output data
dir's archive), or uncompressed under the model's prefix; the files a console shows: samples.png, loss.png,
training_summary.json."""

from __future__ import annotations

import io
import json
import tarfile

import boto3
from PIL import Image

from sdflow.local.sagemaker.noop import NoOpSageMaker
from tests.constants import REGION
from tests.unit.local.helpers import TRAINING_REQUEST, wait_for
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
