"""Faults injected into runs on the strict local cloud, and what the run does about each.

Every test injects one fault through `cloud.faults` (a real SIGKILL, a real crashed Lambda
worker, a disabled rule: sdflow/local/faults.py), then asserts the run's outcome and that nothing
is left running: no processing or training job InProgress or Stopping, no endpoint changing, no
no-op job held. SageMaker jobs are no-ops (sdflow.local.sagemaker.noop): what is under test is
the run lifecycle around them. Each test records its recovery time in RECOVERY, printed at the end
of the module (the closing note's table comes from that print). The end of a run and the
reconciler's faults are in test_run_end_faults.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from sdflow import cli
from sdflow.local.cloud import LocalCloud
from sdflow.local.sagemaker.noop import NoOpSageMaker
from tests.constants import hold_for
from tests.e2e.clouds import CloudSpec
from tests.e2e.runs import (
    RecoveryTable,
    download_jobs,
    ended,
    jobs_named,
    notification,
    run_document,
    run_hash_of,
    settled,
    start_run,
    wait_for_job,
    wait_for_started_job,
)
from tests.helpers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SHARDS = 3
RECOVERY = RecoveryTable()


CLOUD = CloudSpec(dataset="faults", shards=SHARDS)


@pytest.fixture(scope="module", autouse=True)
def _recovery_table() -> Iterator[None]:
    yield
    RECOVERY.print()


# ---------------------------------------------------------------------------- SageMaker jobs


def test_download_job_killed_is_retried_and_run_succeeds(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> None:
    sagemaker.seconds_by_kind["processing"] = hold_for(3.0)
    arn = start_run(cloud, "kill-download")
    run_hash = run_hash_of(cloud, arn)
    victim = wait_for_job(cloud, "processing", run_hash)
    cloud.faults.kill_job("processing", victim)
    killed_at = time.monotonic()

    described = ended(cloud, arn)

    assert described["status"] == "SUCCEEDED", described.get("cause")
    jobs = download_jobs(cloud, run_hash)
    assert len(jobs) == SHARDS + 1, f"one retry for the killed shard: {jobs}"
    assert victim.replace("-a0", "-a1") in jobs
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record("SIGKILL of a download job", "shard retried, run SUCCEEDED", killed_at, leftovers)


def test_training_job_killed_fails_run_with_notification_and_nothing_left(
    cloud: LocalCloud, sagemaker: NoOpSageMaker
) -> None:
    sagemaker.seconds_by_kind["training"] = hold_for(30.0)
    arn = start_run(cloud, "kill-training")
    run_hash = run_hash_of(cloud, arn)
    victim = wait_for_job(cloud, "training", run_hash)
    cloud.faults.kill_job("training", victim)
    killed_at = time.monotonic()

    described = ended(cloud, arn)

    assert described["status"] == "FAILED"
    assert described["error"] == "TrainingJobFailed"
    assert "exit code 137" in described["cause"]
    message = notification(cloud, "kill-training")
    assert message["attributes"]["outcome"] == "failed"
    assert message["attributes"]["error"] == "TrainingJobFailed"
    assert "Train model" in message["message"]
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record("SIGKILL of a training job", "run FAILED (TrainingJobFailed), notified", killed_at, leftovers)


def test_stop_execution_during_training_stops_the_job_within_30_s(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> None:
    sagemaker.seconds_by_kind["training"] = hold_for(120.0)
    arn = start_run(cloud, "stop-training")
    run_hash = run_hash_of(cloud, arn)
    job = wait_for_started_job(cloud, "training", run_hash)

    cloud.client("stepfunctions").stop_execution(executionArn=arn, error="UserStopped", cause="changed my mind")
    stopped_at = time.monotonic()

    def job_stopped() -> bool:
        status = cloud.client("sagemaker").describe_training_job(TrainingJobName=job)["TrainingJobStatus"]
        return status == "Stopped"

    wait_for(job_stopped, timeout_s=30.0, what=f"training job {job} Stopped", interval_s=0.2)
    took = time.monotonic() - stopped_at
    assert took < 30.0
    message = notification(cloud, "stop-training")
    assert message["attributes"]["outcome"] in ("aborted", "failed")
    assert job in message["message"], "the notification says what was stopped"
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record("StopExecution during training", f"job Stopped after {took:.1f} s, notified", stopped_at, leftovers)


def test_stop_execution_during_evaluation_stops_the_evaluation_job(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> None:
    # Training is held while the evaluation's hold is set: on a loaded machine a no-op training
    # job could end, and the evaluation job start and end, before the test set it.
    sagemaker.seconds_by_kind["training"] = hold_for(3.0)
    arn = start_run(cloud, "stop-evaluation")
    run_hash = run_hash_of(cloud, arn)
    wait_for_job(cloud, "training", run_hash)  # every download has ended by now
    sagemaker.seconds_by_kind["processing"] = hold_for(120.0)  # the evaluation job runs long
    job = wait_for_started_job(cloud, "processing", "sdf-ev-", timeout_s=120.0)
    assert run_hash in job

    cloud.client("stepfunctions").stop_execution(executionArn=arn, error="UserStopped", cause="changed my mind")
    stopped_at = time.monotonic()

    def job_stopped() -> bool:
        status = cloud.client("sagemaker").describe_processing_job(ProcessingJobName=job)["ProcessingJobStatus"]
        return status == "Stopped"

    wait_for(job_stopped, timeout_s=30.0, what=f"evaluation job {job} Stopped", interval_s=0.2)
    message = notification(cloud, "stop-evaluation")
    assert f"1 evaluation job ({job})" in message["message"], "the notification says what was stopped"
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record("StopExecution during evaluation", "evaluation job Stopped, notified", stopped_at, leftovers)


# ---------------------------------------------------------------------------- Lambda


def test_lambda_worker_killed_mid_run_run_survives(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> None:
    sagemaker.job_seconds = hold_for(1.0)
    arn = start_run(cloud, "kill-worker")
    cloud.faults.kill_lambda_worker("JobEventsFunction", timeout_s=60.0)
    killed_at = time.monotonic()

    described = ended(cloud, arn)

    assert described["status"] == "SUCCEEDED", described.get("cause")
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record("a Lambda worker killed mid-run", "event redelivered, run SUCCEEDED", killed_at, leftovers)


def test_lambda_runtime_crash_in_every_task_is_retried_and_run_survives(
    cloud: LocalCloud, sagemaker: NoOpSageMaker
) -> None:
    crashes = {
        "ValidateRunFunction": "s3.PutObject",
        "StartDownloadFunction": "sagemaker.CreateProcessingJob",
        "BuildIndexFunction": "s3.PutObject",
        "StartTrainingFunction": "sagemaker.CreateTrainingJob",
        "StartEvaluationFunction": "sagemaker.CreateProcessingJob",
        "RegisterModelFunction": "sagemaker.CreateModelPackage",
        "DeployEndpointFunction": "sagemaker.CreateEndpoint",
    }
    claims = {function: cloud.faults.crash_lambda_after(function, call) for function, call in crashes.items()}
    # Jobs outlast the Retry's wait (at most 5 s for a download, 10 s for training) and the retried
    # starter's own start, as real ones do. Held in real seconds: the clock runs TIME_SCALE times
    # fast while nothing works, and a crashed worker's restart is not work, so on a loaded 2-core
    # machine a 20 s (clock) download once ended before its retry looked.
    sagemaker.seconds_by_kind.update(processing=hold_for(3.0), training=hold_for(3.0))
    document = run_document(cloud)
    document["endpoint"]["name"] = "sdflow-crash"  # a new endpoint: CreateEndpoint, not an update
    try:
        started = time.monotonic()
        arn = start_run(cloud, "crash-everywhere", document)
        described = ended(cloud, arn)
    finally:
        for function in crashes:
            cloud.faults.clear_lambda_crash(function)

    assert described["status"] == "SUCCEEDED", described.get("cause")
    assert {function: cloud.faults.crashes_done(path) for function, path in claims.items()} == dict.fromkeys(crashes, 1)
    run_hash = run_hash_of(cloud, arn)
    downloads = download_jobs(cloud, run_hash)
    assert len(downloads) == SHARDS, "the crashed starter's job was adopted"
    assert len(jobs_named(cloud, "training", run_hash)) == 1, "the crashed starter's job was adopted"
    model = json.loads(described["output"])["registry"]["model"]
    api = cloud.client("sagemaker")
    packages = api.list_model_packages(ModelPackageGroupName=model["model_package_group"])["ModelPackageSummaryList"]
    runs = [
        api.describe_model_package(ModelPackageName=p["ModelPackageArn"])["CustomerMetadataProperties"].get(
            "sdflow:execution"
        )
        for p in packages
    ]
    assert runs.count(arn) == 1, "the retried Register model found its package by ClientToken, adding no version"
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record("a Lambda runtime crash in every task", "each retried, run SUCCEEDED", started, leftovers)


def test_starter_crash_after_create_leaves_exactly_one_job(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> None:
    claims = cloud.faults.crash_lambda_after("StartTrainingFunction", "sagemaker.CreateTrainingJob")
    sagemaker.seconds_by_kind["training"] = 15.0  # still running when the Retry comes (at most 10 s)
    try:
        started = time.monotonic()
        arn = start_run(cloud, "crash-after-create")
        described = ended(cloud, arn)
    finally:
        cloud.faults.clear_lambda_crash("StartTrainingFunction")

    assert described["status"] == "SUCCEEDED", described.get("cause")
    assert cloud.faults.crashes_done(claims) == 1
    jobs = jobs_named(cloud, "training", run_hash_of(cloud, arn))
    assert len(jobs) == 1, jobs
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record("starter crash after CreateTrainingJob", "job adopted by the retry: 1 job", started, leftovers)


# ---------------------------------------------------------------------------- names, redrive, resume


def test_execution_name_reused_adopts_no_old_job(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> None:
    first = start_run(cloud, "reused")
    assert ended(cloud, first)["status"] == "SUCCEEDED"
    old_jobs = set(download_jobs(cloud, "sdf-dl-reused"))
    _forget_execution(first)  # Step Functions frees a name 90 days after its execution closed
    started = time.monotonic()

    second = start_run(cloud, "reused")
    described = ended(cloud, second)

    assert second == first
    assert described["status"] == "FAILED"
    assert described["error"] == "InvalidRunDocument"
    assert "reused" in described["cause"]
    assert set(download_jobs(cloud, "sdf-dl-reused")) == old_jobs, "nothing adopted, nothing started"
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record("an execution name reused", "refused at validation, no old job adopted", started, leftovers)


def _forget_execution(execution_arn: str) -> None:
    """What 90 days do: Step Functions no longer knows the closed execution, so its name is free."""
    from moto.stepfunctions.responses import get_backend

    from sdflow.local.cloud import ACCOUNT_ID, REGION

    for machine in get_backend(ACCOUNT_ID, REGION).state_machines:
        machine.executions = [e for e in machine.executions if e.execution_arn != execution_arn]


def test_redrive_after_training_failure_reruns_only_training(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> None:
    sagemaker.seconds_by_kind["training"] = hold_for(30.0)
    arn = start_run(cloud, "redrive-training")
    run_hash = run_hash_of(cloud, arn)
    cloud.faults.kill_job("training", wait_for_job(cloud, "training", run_hash))
    assert ended(cloud, arn)["status"] == "FAILED"
    downloads = download_jobs(cloud, run_hash)
    sagemaker.seconds_by_kind.clear()
    started = time.monotonic()

    cloud.client("stepfunctions").redrive_execution(executionArn=arn)
    described = ended(cloud, arn)

    assert described["status"] == "SUCCEEDED", described.get("cause")
    assert described.get("redriveCount") == 1
    assert download_jobs(cloud, run_hash) == downloads, "no shard downloaded again"
    training = jobs_named(cloud, "training", run_hash)
    assert len(training) == 2
    assert any("-r1-" in name for name in training), training
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record("training failed, then redrive-execution", "only Train model re-ran, SUCCEEDED", started, leftovers)


def test_redrive_after_shard_failure_reruns_only_the_failed_shard(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> None:
    sagemaker.seconds_by_kind["processing"] = hold_for(3.0)
    arn = start_run(cloud, "redrive-shard", run_document(cloud, tolerated_failure_percent=0))
    run_hash = run_hash_of(cloud, arn)
    first = wait_for_job(cloud, "processing", run_hash)
    shard_stem = first.rsplit("-a", 1)[0]
    cloud.faults.kill_job("processing", first)
    cloud.faults.kill_job("processing", wait_for_job(cloud, "processing", f"{shard_stem}-a1"))
    failed = ended(cloud, arn)
    assert failed["status"] == "FAILED"
    # Redrive once the failure's cleanup has run, as the notification invites: a cleanup still
    # retrying would stop the redrive's new jobs (issue "the second review", item 7).
    notification(cloud, "redrive-shard")
    assert settled(cloud, sagemaker) == []
    before = set(download_jobs(cloud, run_hash))
    sagemaker.seconds_by_kind.clear()
    started = time.monotonic()

    cloud.client("stepfunctions").redrive_execution(executionArn=arn)
    described = ended(cloud, arn)

    assert described["status"] == "SUCCEEDED", described.get("cause")
    new_jobs = set(download_jobs(cloud, run_hash)) - before
    assert len(new_jobs) == 1, f"only the failed shard downloads again: {sorted(new_jobs)}"
    assert next(iter(new_jobs)).split("-")[-3] == shard_stem.split("-")[-2]
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record(
        "a shard failed past tolerance, then redrive", "only that shard re-ran, SUCCEEDED", started, leftovers
    )


def test_resume_after_training_failure_starts_no_download_job(
    cloud: LocalCloud, sagemaker: NoOpSageMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    sagemaker.seconds_by_kind["training"] = hold_for(30.0)
    failed = start_run(cloud, "resume-me")
    cloud.faults.kill_job("training", wait_for_job(cloud, "training", run_hash_of(cloud, failed)))
    assert ended(cloud, failed)["status"] == "FAILED"
    sagemaker.seconds_by_kind.clear()
    for key, value in cloud.cli_env().items():
        monkeypatch.setenv(key, value)
    started = time.monotonic()

    assert cli.main(["resume", failed, "--name", "resumed"]) == 0
    resumed = failed.rsplit(":", 1)[0] + ":resumed"
    described = ended(cloud, resumed)

    assert described["status"] == "SUCCEEDED", described.get("cause")
    assert download_jobs(cloud, run_hash_of(cloud, resumed)) == [], "every shard reused"
    config = json.loads(described["output"])["config"]
    assert config["resume"]["from_execution_arn"] == failed
    assert config["resume"]["shards_reused"] == SHARDS
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record("training failed, then sdflow resume", "0 download jobs, run SUCCEEDED", started, leftovers)
