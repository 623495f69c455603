"""The local SageMaker's jobs in CloudWatch, read back through the public APIs as on AWS: each host's
output in /aws/sagemaker/TrainingJobs or /aws/sagemaker/ProcessingJobs, stream
`<job>/algo-N-<epoch seconds>`; the MetricDefinitions values in the /aws/sagemaker/TrainingJobs
namespace with the TrainingJobName dimension, at the line's time (sdflow/local/sagemaker/job_logs.py)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest

from sdflow.local.sagemaker import engine as sagemaker_module
from sdflow.local.sagemaker.engine import LocalSageMaker
from sdflow.local.sagemaker.job_logs import JobLogs
from sdflow.local.services.logs import CloudWatchSink
from tests.constants import ACCOUNT, REGION
from tests.unit.local.helpers import PROCESSING_REQUEST, TRAINING_REQUEST, client, fake_training_image, wait_for
from tests.unit.local.recorders import Recorder

S3_ENDPOINT = f"https://s3.{REGION}.amazonaws.com"

# Each host says who it is, logs two losses (a blank line between) and a line on stderr.
TRAIN = """#!/usr/bin/env python3
import os, sys
host = os.environ["SM_CURRENT_HOST"]
loss = 0.5 if host == "algo-1" else 0.75
print(f"hello from {host}", flush=True)
print(f"step=1 loss={loss}", flush=True)
print("", flush=True)
print(f"step=2 loss={loss / 2}", flush=True)
print(f"warning on {host}", file=sys.stderr, flush=True)
"""
DOWNLOAD = """#!/usr/bin/env python3
import sys
print("downloading shard 00000", flush=True)
print("shard 00000: 3 of 3 images", file=sys.stderr, flush=True)
"""


@pytest.fixture
def local_sagemaker(
    aws: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[LocalSageMaker, Recorder]]:
    monkeypatch.setattr(sagemaker_module, "free_port", lambda: 65000)  # no socket in unit tests
    boto3.client("s3", region_name=REGION).create_bucket(Bucket="data")
    image = fake_training_image(tmp_path, {"train": TRAIN, "download": DOWNLOAD})
    recorder = Recorder()
    sm = LocalSageMaker(tmp_path / "sm", S3_ENDPOINT, recorder, training_image_dir=image, stop_grace_s=0.5)
    yield sm, recorder
    sm.shutdown()


def _streams(group: str, job: str) -> dict[str, list[dict[str, Any]]]:
    """Every stream of the job in the group, with its events (the job's name is the stream prefix)."""
    logs = client("logs")
    described = logs.describe_log_streams(logGroupName=group, logStreamNamePrefix=f"{job}/")["logStreams"]
    return {
        s["logStreamName"]: logs.get_log_events(
            logGroupName=group, logStreamName=s["logStreamName"], startFromHead=True
        )["events"]
        for s in described
    }


def _run(sm: LocalSageMaker, recorder: Recorder, kind: str, request: dict[str, Any], name: str) -> tuple[int, int]:
    """Runs the job to its end; returns the epoch seconds it started and ended within."""
    started = int(time.time())
    getattr(sm, f"run_{kind}_job")(request)
    status, fields = wait_for(lambda: recorder.final(name), what=f"the {kind} job to end")
    assert status == "Completed", fields
    return started, int(time.time())


def test_training_job_host_lines_in_training_jobs_group_one_stream_per_host(
    local_sagemaker: tuple[LocalSageMaker, Recorder],
) -> None:
    sm, recorder = local_sagemaker
    request = {**TRAINING_REQUEST, "TrainingJobName": "t-logs"}  # two instances
    started, ended = _run(sm, recorder, "training", request, "t-logs")

    streams = _streams("/aws/sagemaker/TrainingJobs", "t-logs")
    assert len(streams) == 2
    by_host = {}
    for name, events in streams.items():
        match = re.fullmatch(r"t-logs/(algo-[12])-(\d+)", name)
        assert match, name
        assert started <= int(match.group(2)) <= ended, "the stream is named after the host's start"
        by_host[match.group(1)] = [e["message"] for e in events]
    # stdout and stderr in order, blank lines dropped (PutLogEvents takes no empty message).
    assert by_host == {
        "algo-1": ["hello from algo-1", "step=1 loss=0.5", "step=2 loss=0.25", "warning on algo-1"],
        "algo-2": ["hello from algo-2", "step=1 loss=0.75", "step=2 loss=0.375", "warning on algo-2"],
    }
    # The work folder's copy, which the CLI reads, stays.
    assert "step=1 loss=0.5" in (sm.workdir / "jobs" / "t-logs" / "algo-1.log").read_text()


def test_processing_job_lines_in_processing_jobs_group(local_sagemaker: tuple[LocalSageMaker, Recorder]) -> None:
    sm, recorder = local_sagemaker
    request = {**PROCESSING_REQUEST, "ProcessingJobName": "p-logs"}
    started, ended = _run(sm, recorder, "processing", request, "p-logs")

    [(name, events)] = _streams("/aws/sagemaker/ProcessingJobs", "p-logs").items()
    match = re.fullmatch(r"p-logs/algo-1-(\d+)", name)
    assert match, name
    assert started <= int(match.group(1)) <= ended
    assert [e["message"] for e in events] == ["downloading shard 00000", "shard 00000: 3 of 3 images"]
    groups = [g["logGroupName"] for g in client("logs").describe_log_groups()["logGroups"]]
    assert groups == ["/aws/sagemaker/ProcessingJobs"], "created on first use, as SageMaker does"


def test_training_metric_definitions_published_with_job_dimension_at_line_time(
    local_sagemaker: tuple[LocalSageMaker, Recorder],
) -> None:
    sm, recorder = local_sagemaker
    request = {**TRAINING_REQUEST, "TrainingJobName": "t-metrics"}  # train:loss = loss=([0-9.]+)
    _run(sm, recorder, "training", request, "t-metrics")
    cloudwatch = client("cloudwatch")
    dimensions = [{"Name": "TrainingJobName", "Value": "t-metrics"}]

    [metric] = cloudwatch.list_metrics(Namespace="/aws/sagemaker/TrainingJobs")["Metrics"]
    assert metric == {"Namespace": "/aws/sagemaker/TrainingJobs", "MetricName": "train:loss", "Dimensions": dimensions}

    now = datetime.now(UTC)
    [point] = cloudwatch.get_metric_statistics(
        Namespace="/aws/sagemaker/TrainingJobs",
        MetricName="train:loss",
        Dimensions=dimensions,
        StartTime=now - timedelta(minutes=5),
        EndTime=now + timedelta(minutes=1),
        Period=300,
        Statistics=["SampleCount", "Minimum", "Maximum"],
    )["Datapoints"]
    # Both hosts' lines are parsed, as SageMaker parses every instance's log.
    assert (point["SampleCount"], point["Minimum"], point["Maximum"]) == (4.0, 0.25, 0.75)
    # The datapoint starts at the first value, whose time is its log line's.
    first_loss = min(
        e["timestamp"]
        for events in _streams("/aws/sagemaker/TrainingJobs", "t-metrics").values()
        for e in events
        if "loss=" in e["message"]
    )
    assert point["Timestamp"].timestamp() * 1000 == pytest.approx(first_loss, abs=1)

    data = cloudwatch.get_metric_data(
        MetricDataQueries=[
            {
                "Id": "loss",
                "MetricStat": {
                    "Metric": {
                        "Namespace": "/aws/sagemaker/TrainingJobs",
                        "MetricName": "train:loss",
                        "Dimensions": dimensions,
                    },
                    "Period": 600,
                    "Stat": "Minimum",
                },
            }
        ],
        StartTime=now - timedelta(minutes=5),
        EndTime=now + timedelta(minutes=1),
    )["MetricDataResults"]
    assert data[0]["Values"] == [0.25]


def test_job_logs_with_a_shared_sink_leave_it_open(aws: None) -> None:
    """The local cloud may hand its functions' sink over: the jobs write through it and do not close it."""
    sink = CloudWatchSink(ACCOUNT, REGION, flush_interval_s=60)
    try:
        job_logs = JobLogs(ACCOUNT, REGION, sink)
        job_logs.host_lines("processing", "p-shared", "algo-1")("one line")
        job_logs.close()  # flushes, leaves the sink running
        [(_name, events)] = _streams("/aws/sagemaker/ProcessingJobs", "p-shared").items()
        assert [e["message"] for e in events] == ["one line"]
        assert sink._flusher.is_alive()
    finally:
        sink.close()
