"""sdflow.sdk against a local cloud found the way a notebook finds `sdflow local up`: its state file.

SageMaker jobs are no-ops (sdflow.local.sagemaker.noop); what is under test is the SDK around a
real run: starting it, waiting, the summary, the endpoint, a failure and its resume."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sdflow import sdk
from sdflow.local.cloud import LocalCloud
from sdflow.local.sagemaker.noop import NoOpSageMaker
from sdflow.session import write_state
from sdflow_common import names
from tests.constants import hold_for
from tests.e2e.clouds import CloudSpec
from tests.helpers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SHARDS = 2
ENDPOINT = "sdflow-sdk"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CLOUD = CloudSpec(dataset="sdk", shards=SHARDS)


@pytest.fixture(scope="module")
def pipeline(cloud: LocalCloud, tmp_path_factory: pytest.TempPathFactory) -> Iterator[sdk.Pipeline]:
    state_dir = tmp_path_factory.mktemp("sdk-state")
    write_state(state_dir, cloud)  # what `sdflow local up` writes for other processes
    with pytest.MonkeyPatch.context() as env:
        env.delenv("AWS_ENDPOINT_URL", raising=False)
        yield sdk.Pipeline.connect(workdir=state_dir)


def _document(cloud: LocalCloud, **extra: Any) -> dict[str, Any]:
    return {
        "dataset": {"prefix": f"s3://{cloud.bucket}/datasets/sdk/"},
        "base_model_uri": f"s3://{cloud.bucket}/models/tiny/",
        "download": {"max_concurrency": SHARDS},
        "training": {"instance_type": "ml.m5.xlarge", "max_train_steps": 5},
        "endpoint": {"name": ENDPOINT, "instance_type": "ml.m5.large"},
        **extra,
    }


def _training_job(cloud: LocalCloud, run: sdk.Run) -> str:
    sfn, sagemaker = cloud.client("stepfunctions"), cloud.client("sagemaker")
    run_hash = names.run_hash(run.execution_arn, sfn.describe_execution(executionArn=run.execution_arn)["startDate"])

    def running() -> str | None:
        jobs = sagemaker.list_training_jobs(NameContains=run_hash, StatusEquals="InProgress")["TrainingJobSummaries"]
        return jobs[0]["TrainingJobName"] if jobs else None

    return str(wait_for(running, timeout_s=60, what=f"the training job of {run.name}", interval_s=0.1))


def test_sdk_connect_by_endpoint_env_alone_reads_the_local_stacks_outputs(
    cloud: LocalCloud, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in cloud.cli_env().items():  # what `sdflow local up` prints to export
        monkeypatch.setenv(key, value)

    connected = sdk.Pipeline.connect(workdir=tmp_path)  # no state file there: CloudFormation answers

    assert (connected.bucket, connected.state_machine_arn) == (cloud.bucket, cloud.state_machine_arn)
    assert connected.session.outputs["NotificationTopicArn"] == cloud.topic_arn


def test_sdk_run_via_upload_succeeds_and_its_endpoint_returns_png(cloud: LocalCloud, pipeline: sdk.Pipeline) -> None:
    assert pipeline.session.endpoint_url == cloud.endpoint_url

    run = pipeline.start(_document(cloud, run_name="sdk-ok"))
    summary = run.wait(progress=False, timeout_s=180, poll_s=0.5)

    assert summary.status == "SUCCEEDED", summary.cause
    assert summary.name == run.name
    assert run.name.startswith("sdk-ok-")
    assert (summary.shards_total, summary.shards_succeeded, summary.shards_failed) == (SHARDS, SHARDS, 0)
    assert summary.training_job_name is not None
    assert summary.training_job_name.startswith("sdf-tr-")
    assert summary.final_loss == pytest.approx(0.1)  # the no-op training job's train:loss
    assert summary.model_data_uri is not None
    assert summary.model_data_uri.endswith("/output/model/")
    assert summary.endpoint_name == ENDPOINT
    assert pipeline.run(run.name) == run
    assert run in pipeline.runs(limit=5)

    image = run.predictor().predict("a red circle")

    assert image.startswith(PNG_SIGNATURE)


def test_sdk_failed_run_raises_run_failed_then_resume_succeeds(
    cloud: LocalCloud, pipeline: sdk.Pipeline, sagemaker: NoOpSageMaker, capsys: pytest.CaptureFixture[str]
) -> None:
    sagemaker.seconds_by_kind["training"] = hold_for(30.0)
    run = pipeline.start(_document(cloud), via="api", name="sdk-fails")
    cloud.faults.kill_job("training", _training_job(cloud, run))

    with pytest.raises(sdk.RunFailed, match="run sdk-fails ended FAILED in Train model: TrainingJobFailed") as caught:
        run.wait(progress=False, timeout_s=180, poll_s=0.5)

    failed = caught.value.summary
    assert caught.value.error == "TrainingJobFailed"
    assert (failed.status, failed.failed_state, failed.shards_succeeded, failed.endpoint_name) == (
        "FAILED", "Train model", SHARDS, None,
    )  # fmt: skip
    with pytest.raises(sdk.NoEndpoint, match=r"run sdk-fails is FAILED \(TrainingJobFailed\)"):
        run.predictor()
    sagemaker.seconds_by_kind.clear()

    resumed = run.resume()
    summary = resumed.wait(progress=True, timeout_s=180, poll_s=0.5)

    assert resumed.name.startswith("sdk-fails-resume-")
    assert summary.status == "SUCCEEDED", summary.cause
    assert (summary.shards_reused, summary.shards_succeeded, summary.endpoint_name) == (SHARDS, SHARDS, ENDPOINT)
    assert f"{SHARDS}/{SHARDS}" in capsys.readouterr().err, "the bar counts the reused shards as done"
    assert resumed.predictor().predict("a red circle").startswith(PNG_SIGNATURE)
