"""Faults injected into runs on the strict local cloud, and what the run does about each.

Every test injects one fault through `cloud.faults` (a real SIGKILL, a real crashed Lambda
worker, a disabled rule: sdflow/local/faults.py), then asserts the run's outcome and that nothing
is left running: no processing or training job InProgress or Stopping, no endpoint changing, no
no-op job held. SageMaker jobs are no-ops (sdflow.local.sagemaker.noop): what is under test is
the run lifecycle around them. Each test records its recovery time in RECOVERY, printed at the end
of the module (the closing note's table comes from that print)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sdflow import cli
from sdflow.local.cloud import LocalCloud
from sdflow.local.sagemaker.noop import NoOpSageMaker
from sdflow_common import names
from tests.constants import hold_for
from tests.e2e.clouds import CloudSpec
from tests.helpers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SHARDS = 3
RECOVERY: dict[str, str] = {}


CLOUD = CloudSpec(dataset="faults", shards=SHARDS)


@pytest.fixture(scope="module", autouse=True)
def _recovery_table() -> Iterator[None]:
    yield
    if RECOVERY:
        print("\nfault | outcome | time to recover | leftovers")
        for line in RECOVERY.values():
            print(line)


def _document(cloud: LocalCloud, **download: Any) -> dict[str, Any]:
    return {
        "dataset": {"prefix": f"s3://{cloud.bucket}/datasets/faults/"},
        "base_model_uri": f"s3://{cloud.bucket}/models/tiny/",
        "download": {"max_concurrency": 3, **download},
        "training": {"instance_type": "ml.m5.xlarge"},
        "endpoint": {"name": "sdflow-faults", "instance_type": "ml.m5.large"},
    }


def _start(cloud: LocalCloud, name: str, document: Any | None = None) -> str:
    return str(
        cloud.client("stepfunctions").start_execution(
            stateMachineArn=cloud.state_machine_arn, name=name, input=json.dumps(document or _document(cloud))
        )["executionArn"]
    )


def _ended(cloud: LocalCloud, arn: str, timeout_s: float = 180.0) -> dict[str, Any]:
    sfn = cloud.client("stepfunctions")

    def done() -> dict[str, Any] | None:
        described = sfn.describe_execution(executionArn=arn)
        return described if described["status"] != "RUNNING" else None

    return dict(wait_for(done, timeout_s=timeout_s, what=f"execution {arn} to end", interval_s=0.2))


def _run_hash(cloud: LocalCloud, arn: str) -> str:
    described = cloud.client("stepfunctions").describe_execution(executionArn=arn)
    return names.run_hash(arn, described["startDate"])


def _jobs(cloud: LocalCloud, kind: str, contains: str, status: str | None = None) -> list[str]:
    sagemaker = cloud.client("sagemaker")
    call = sagemaker.list_processing_jobs if kind == "processing" else sagemaker.list_training_jobs
    key = "ProcessingJobSummaries" if kind == "processing" else "TrainingJobSummaries"
    name_key = "ProcessingJobName" if kind == "processing" else "TrainingJobName"
    found: list[str] = []
    kwargs: dict[str, Any] = {"NameContains": contains, "MaxResults": 100}
    if status:
        kwargs["StatusEquals"] = status
    while True:
        page = call(**kwargs)
        found.extend(job[name_key] for job in page[key])
        if not page.get("NextToken"):
            return found
        kwargs["NextToken"] = page["NextToken"]


def _downloads(cloud: LocalCloud, contains: str) -> list[str]:
    """The run's download jobs (its processing jobs less the evaluation job, `sdf-ev-…`)."""
    return [name for name in _jobs(cloud, "processing", contains) if name.startswith(names.DOWNLOAD_PREFIX + "-")]


def _wait_for_job(
    cloud: LocalCloud, kind: str, contains: str, timeout_s: float = 60.0, status: str | None = "InProgress"
) -> str:
    def running() -> str | None:
        jobs = _jobs(cloud, kind, contains, status)
        return jobs[0] if jobs else None

    return str(wait_for(running, timeout_s=timeout_s, what=f"a {kind} job named *{contains}*", interval_s=0.1))


def _leftovers(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> list[str]:
    """Whatever still runs or bills: jobs InProgress or Stopping, endpoints changing, held no-op jobs."""
    left = [
        f"{kind} job {name} {status}"
        for kind in ("processing", "training")
        for status in ("InProgress", "Stopping")
        for name in _jobs(cloud, kind, "sdf-", status)
    ]
    endpoints = cloud.client("sagemaker").list_endpoints()["Endpoints"]
    left += [
        f"endpoint {e['EndpointName']} {e['EndpointStatus']}"
        for e in endpoints
        if e["EndpointStatus"] in ("Creating", "Updating", "RollingBack", "SystemUpdating")
    ]
    if sagemaker.running:
        left.append(f"{sagemaker.running} no-op job(s) held")
    return left


def _settled(cloud: LocalCloud, sagemaker: NoOpSageMaker, timeout_s: float = 45.0) -> list[str]:
    """Leftovers once the run's end has been handled (the notify function runs on its status event)."""
    with contextlib.suppress(AssertionError):  # the caller asserts on what is left
        wait_for(lambda: not _leftovers(cloud, sagemaker), timeout_s=timeout_s, what="nothing left", interval_s=0.5)
    cloud.wait_idle(30.0)
    return _leftovers(cloud, sagemaker)


def _notification(cloud: LocalCloud, execution_name: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """The run's notification as the local SNS records it: subject, message, attributes."""

    def find() -> dict[str, Any] | None:
        mine = [m for m in cloud.sns_messages() if m["attributes"].get("run_id") == execution_name]
        return mine[-1] if mine else None

    return dict(wait_for(find, timeout_s=timeout_s, what=f"the notification of {execution_name}", interval_s=0.2))


def _record(fault: str, outcome: str, started: float, leftovers: list[str]) -> None:
    RECOVERY[fault] = f"{fault} | {outcome} | {time.monotonic() - started:.1f} s | {len(leftovers)}"


# ---------------------------------------------------------------------------- SageMaker jobs


def test_download_job_killed_is_retried_and_run_succeeds(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> None:
    sagemaker.seconds_by_kind["processing"] = hold_for(3.0)
    arn = _start(cloud, "kill-download")
    run_hash = _run_hash(cloud, arn)
    victim = _wait_for_job(cloud, "processing", run_hash)
    cloud.faults.kill_job("processing", victim)
    killed_at = time.monotonic()

    described = _ended(cloud, arn)

    assert described["status"] == "SUCCEEDED", described.get("cause")
    jobs = _downloads(cloud, run_hash)
    assert len(jobs) == SHARDS + 1, f"one retry for the killed shard: {jobs}"
    assert victim.replace("-a0", "-a1") in jobs
    leftovers = _settled(cloud, sagemaker)
    assert leftovers == []
    _record("SIGKILL of a download job", "shard retried, run SUCCEEDED", killed_at, leftovers)


def test_training_job_killed_fails_run_with_notification_and_nothing_left(
    cloud: LocalCloud, sagemaker: NoOpSageMaker
) -> None:
    sagemaker.seconds_by_kind["training"] = hold_for(30.0)
    arn = _start(cloud, "kill-training")
    run_hash = _run_hash(cloud, arn)
    victim = _wait_for_job(cloud, "training", run_hash)
    cloud.faults.kill_job("training", victim)
    killed_at = time.monotonic()

    described = _ended(cloud, arn)

    assert described["status"] == "FAILED"
    assert described["error"] == "TrainingJobFailed"
    assert "exit code 137" in described["cause"]
    message = _notification(cloud, "kill-training")
    assert message["attributes"]["outcome"] == "failed"
    assert message["attributes"]["error"] == "TrainingJobFailed"
    assert "Train model" in message["message"]
    leftovers = _settled(cloud, sagemaker)
    assert leftovers == []
    _record("SIGKILL of a training job", "run FAILED (TrainingJobFailed), notified", killed_at, leftovers)


def test_stop_execution_during_training_stops_the_job_within_30_s(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> None:
    sagemaker.seconds_by_kind["training"] = hold_for(120.0)
    arn = _start(cloud, "stop-training")
    run_hash = _run_hash(cloud, arn)
    job = _wait_for_job(cloud, "training", run_hash)

    cloud.client("stepfunctions").stop_execution(executionArn=arn, error="UserStopped", cause="changed my mind")
    stopped_at = time.monotonic()

    def job_stopped() -> bool:
        status = cloud.client("sagemaker").describe_training_job(TrainingJobName=job)["TrainingJobStatus"]
        return status == "Stopped"

    wait_for(job_stopped, timeout_s=30.0, what=f"training job {job} Stopped", interval_s=0.2)
    took = time.monotonic() - stopped_at
    assert took < 30.0
    message = _notification(cloud, "stop-training")
    assert message["attributes"]["outcome"] in ("aborted", "failed")
    assert job in message["message"], "the notification says what was stopped"
    leftovers = _settled(cloud, sagemaker)
    assert leftovers == []
    _record("StopExecution during training", f"job Stopped after {took:.1f} s, notified", stopped_at, leftovers)


def test_stop_execution_during_evaluation_stops_the_evaluation_job(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> None:
    arn = _start(cloud, "stop-evaluation")
    run_hash = _run_hash(cloud, arn)
    _wait_for_job(cloud, "training", run_hash, status=None)  # every download has ended by now
    sagemaker.seconds_by_kind["processing"] = hold_for(120.0)  # the evaluation job runs long
    job = _wait_for_job(cloud, "processing", "sdf-ev-", timeout_s=120.0)
    assert run_hash in job

    cloud.client("stepfunctions").stop_execution(executionArn=arn, error="UserStopped", cause="changed my mind")
    stopped_at = time.monotonic()

    def job_stopped() -> bool:
        status = cloud.client("sagemaker").describe_processing_job(ProcessingJobName=job)["ProcessingJobStatus"]
        return status == "Stopped"

    wait_for(job_stopped, timeout_s=30.0, what=f"evaluation job {job} Stopped", interval_s=0.2)
    message = _notification(cloud, "stop-evaluation")
    assert f"1 evaluation job ({job})" in message["message"], "the notification says what was stopped"
    leftovers = _settled(cloud, sagemaker)
    assert leftovers == []
    _record("StopExecution during evaluation", "evaluation job Stopped, notified", stopped_at, leftovers)


def _function_log_lines(cloud: LocalCloud, function: str) -> list[str]:
    """A function's log lines in CloudWatch Logs (they arrive in batches: callers wait for theirs)."""
    logs = cloud.client("logs")
    groups = logs.describe_log_groups(logGroupNamePrefix="/aws/lambda/")["logGroups"]
    group = next(g["logGroupName"] for g in groups if function in g["logGroupName"])
    pages = logs.get_paginator("filter_log_events").paginate(logGroupName=group)
    return [e["message"] for page in pages for e in page["events"]]


def test_redrive_inside_the_cleanup_retry_window_keeps_its_new_jobs(
    cloud: LocalCloud, sagemaker: NoOpSageMaker
) -> None:
    """Part of the cleanup fails: notify publishes, raises, and Lambda retries it a minute or more
    later. The user redrives in that minute, as the notification invites; the retried cleanup must
    not stop the redrive's new training job (the run keeps its hash across redrives)."""
    clock = cloud.clock
    sagemaker.seconds_by_kind["training"] = hold_for(20.0)
    arn = _start(cloud, "redrive-window")
    run_hash = _run_hash(cloud, arn)
    first = _wait_for_job(cloud, "training", run_hash)
    # Five calls: botocore retries a throttled call itself, four times in its default (legacy) mode.
    cloud.faults.fail_api_calls("sagemaker.ListProcessingJobs", "ThrottlingException", "Rate exceeded", times=5)
    sfn = cloud.client("stepfunctions")
    with clock.busy():  # the clock at real speed: Lambda's retry comes a real minute later, not in 0.6 s
        sfn.stop_execution(executionArn=arn, error="UserStopped", cause="stopped to redrive")
        message = _notification(cloud, "redrive-window")["message"]
        assert "NOT cleaned up: could not list the run's download jobs and evaluation jobs" in message
        assert f"1 training job ({first})" in message
        sfn.redrive_execution(executionArn=arn)
        second = _wait_for_job(cloud, "training", f"{run_hash}-r1-")
    started = time.monotonic()

    def retried() -> bool:  # the first cleanup logged "run cleaned up"; the retry logs either line
        lines = _function_log_lines(cloud, "NotifyFunction")
        done = [line for line in lines if "run cleaned up" in line or "cleanup skipped" in line]
        return len(done) >= 2

    wait_for(retried, timeout_s=60.0, what="the notify retry's cleanup", interval_s=0.5)
    described = cloud.client("sagemaker").describe_training_job(TrainingJobName=second)
    assert described["TrainingJobStatus"] == "InProgress", "the retried cleanup left the redrive's job running"
    assert _ended(cloud, arn)["status"] == "SUCCEEDED"
    leftovers = _settled(cloud, sagemaker)
    assert leftovers == []
    _record("a redrive inside the cleanup's retry window", "its training job kept, SUCCEEDED", started, leftovers)


def test_run_end_event_lost_reconciler_notifies_and_cleans_up_within_its_period(
    cloud: LocalCloud, sagemaker: NoOpSageMaker
) -> None:
    """EventBridge carries Step Functions' status changes best effort: the end of a stopped run is
    never delivered. Nothing happens until the reconciler's next run, which hands notify the end:
    the training job is stopped and the user notified."""
    sagemaker.seconds_by_kind["training"] = hold_for(60.0)
    arn = _start(cloud, "lost-end")
    cloud.faults.drop_end_event(arn)
    job = _wait_for_job(cloud, "training", _run_hash(cloud, arn))
    cloud.client("stepfunctions").stop_execution(executionArn=arn, error="UserStopped", cause="end event lost")
    assert _ended(cloud, arn)["status"] == "ABORTED"
    cloud.wait_idle(30.0)
    assert not [m for m in cloud.sns_messages() if m["attributes"].get("run_id") == "lost-end"]
    described = cloud.client("sagemaker").describe_training_job(TrainingJobName=job)
    assert described["TrainingJobStatus"] == "InProgress", "without its end event nobody stopped it"
    started = time.monotonic()

    cloud.clock.advance(10 * 60 + 1)  # the reconciler's rate(10 minutes) comes round

    message = _notification(cloud, "lost-end")["message"]
    assert "was STOPPED" in message
    assert f"1 training job ({job})" in message
    leftovers = _settled(cloud, sagemaker)
    assert leftovers == []
    wait_for(
        lambda: any(
            "notify invoked" in line and arn in line for line in _function_log_lines(cloud, "ReconcilerFunction")
        ),
        timeout_s=30.0,
        what="the reconciler's log of the run it closed",
        interval_s=0.5,
    )
    _record("the run's end event lost", "reconciler handed notify the end: stopped, notified", started, leftovers)


def test_lost_job_event_is_resolved_by_the_reconciler_after_the_deadline(
    cloud: LocalCloud, sagemaker: NoOpSageMaker
) -> None:
    events = cloud.client("events")
    rule = next(
        r["Name"] for r in events.list_rules()["Rules"] if "TrainingJobEnded" in r["Name"] or "Training" in r["Name"]
    )
    events.disable_rule(Name=rule)
    try:
        arn = _start(cloud, "lost-event")
        run_hash = _run_hash(cloud, arn)
        job = _wait_for_job(cloud, "training", run_hash, status=None)  # a no-op job ends at once

        def completed() -> bool:
            described = cloud.client("sagemaker").describe_training_job(TrainingJobName=job)
            return described["TrainingJobStatus"] == "Completed"

        wait_for(completed, timeout_s=30.0, what=f"training job {job} Completed", interval_s=0.2)
        lost_at = time.monotonic()
        # Time passes, on the clock: the reconciler (every 10 minutes) looks at the claim once its
        # deadline (the task's timeout, a day here) is within ReconcileLeadMinutes (20), and
        # answers the task from the job's status before the task times out.
        table = cloud.outputs.get("TokenTableName") or _token_table(cloud)
        claim = cloud.client("dynamodb").get_item(TableName=table, Key={"resource_name": {"S": job}})["Item"]
        cloud.clock.advance(int(claim["deadline"]["N"]) - cloud.clock.time() - 15 * 60)

        described = _ended(cloud, arn)
    finally:
        events.enable_rule(Name=rule)

    assert described["status"] == "SUCCEEDED", described.get("cause")
    logs = cloud.client("logs")
    group = next(
        g["logGroupName"]
        for g in logs.describe_log_groups(logGroupNamePrefix="/aws/lambda/")["logGroups"]
        if "ReconcilerFunction" in g["logGroupName"]
    )

    def reconciled() -> bool:  # the function's log lines reach CloudWatch in batches
        pages = logs.get_paginator("filter_log_events").paginate(logGroupName=group)
        lines = [e["message"] for page in pages for e in page["events"]]
        return any("missed event reconciled" in line and job in line for line in lines)

    wait_for(reconciled, timeout_s=30.0, what="the reconciler's resolution of the lost event", interval_s=0.5)
    leftovers = _settled(cloud, sagemaker)
    assert leftovers == []
    _record("training event lost (rule disabled)", "reconciler resolved it, run SUCCEEDED", lost_at, leftovers)


def _token_table(cloud: LocalCloud) -> str:
    tables = cloud.client("dynamodb").list_tables()["TableNames"]
    return next(name for name in tables if "TokenTable" in name)


def test_job_event_delivered_twice_has_one_effect(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> None:
    sagemaker.seconds_by_kind["training"] = hold_for(2.0)
    arn = _start(cloud, "twice")
    run_hash = _run_hash(cloud, arn)
    _wait_for_job(cloud, "training", run_hash)
    downloads = _downloads(cloud, run_hash)
    started = time.monotonic()
    for job in downloads:
        cloud.faults.redeliver_sagemaker_event(job, status="Completed")

    described = _ended(cloud, arn)

    assert described["status"] == "SUCCEEDED", described.get("cause")
    assert len(_downloads(cloud, run_hash)) == SHARDS
    assert len(_jobs(cloud, "training", run_hash)) == 1
    cloud.wait_idle(30.0)
    assert len([m for m in cloud.sns_messages() if m["attributes"].get("run_id") == "twice"]) == 1
    leftovers = _settled(cloud, sagemaker)
    assert leftovers == []
    _record("the same job event delivered twice", "one effect, run SUCCEEDED", started, leftovers)


def test_training_capacity_failure_is_retried_after_backoff_and_run_succeeds(
    cloud: LocalCloud, sagemaker: NoOpSageMaker
) -> None:
    """The definition's own Retry for TrainingCapacityUnavailable (300 s, FULL jitter) plays out."""
    cloud.faults.fail_next_training_jobs(1)
    started = time.monotonic()
    arn = _start(cloud, "capacity")

    described = _ended(cloud, arn)

    assert described["status"] == "SUCCEEDED", described.get("cause")
    run_hash = _run_hash(cloud, arn)
    failed = _jobs(cloud, "training", run_hash, "Failed")
    completed = _jobs(cloud, "training", run_hash, "Completed")
    assert len(failed) == 1, failed
    assert [name.rsplit("-a", 1)[-1] for name in (failed[0], completed[0])] == ["0", "1"], (failed, completed)
    reason = cloud.client("sagemaker").describe_training_job(TrainingJobName=failed[0])["FailureReason"]
    assert reason.startswith("CapacityError: Unable to provision requested ML compute capacity")
    events = cloud.client("stepfunctions").get_execution_history(executionArn=arn, maxResults=1000)["events"]
    retried = [e for e in events if e["type"] == "TaskFailed"]
    assert [e["taskFailedEventDetails"]["error"] for e in retried] == ["TrainingCapacityUnavailable"]
    leftovers = _settled(cloud, sagemaker)
    assert leftovers == []
    _record("training capacity failure", "retried after the 300 s backoff, SUCCEEDED", started, leftovers)


def test_training_job_outliving_its_task_timeout_fails_run_and_is_stopped(
    cloud: LocalCloud, sagemaker: NoOpSageMaker
) -> None:
    sagemaker.seconds_by_kind["training"] = 30 * 86_400.0  # a job that never ends
    arn = _start(cloud, "training-timeout", _document(cloud))
    job = _wait_for_job(cloud, "training", _run_hash(cloud, arn))
    started = time.monotonic()

    assert cloud.clock.advance_to_next(what="TimeoutSeconds") is not None  # a day and an hour pass
    described = _ended(cloud, arn)

    assert described["status"] == "FAILED"
    assert described["error"] == "States.Timeout"
    message = _notification(cloud, "training-timeout")
    assert "Train model" in message["message"]
    assert "States.Timeout" in message["message"]
    # Stopped by whichever sees it first: the reconciler (the claim outlived its deadline) or the
    # failed run's cleanup; either way nothing runs to its MaxRuntime.
    status = cloud.client("sagemaker").describe_training_job(TrainingJobName=job)["TrainingJobStatus"]
    assert status == "Stopped"
    leftovers = _settled(cloud, sagemaker)
    assert leftovers == []
    _record("training outlived its task timeout", "States.Timeout, job stopped, notified", started, leftovers)


def test_manual_approval_never_given_times_out_without_deploy(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> None:
    document = _document(cloud)
    document["approval"] = {"mode": "manual", "timeout_seconds": 3 * 86_400}
    document["endpoint"]["name"] = "sdflow-unapproved"
    arn = _start(cloud, "approval-timeout", document)

    def waiting_for_approval() -> bool:
        events = cloud.client("stepfunctions").get_execution_history(executionArn=arn, reverseOrder=True)["events"]
        entered = [e for e in events if e["type"] == "TaskStateEntered"]
        return bool(entered) and entered[0]["stateEnteredEventDetails"]["name"] == "Wait for approval"

    wait_for(waiting_for_approval, timeout_s=60.0, what="Wait for approval", interval_s=0.2)
    started = time.monotonic()
    wait_for(
        lambda: cloud.clock.advance_to_next(what="TimeoutSeconds"),
        timeout_s=10.0,
        what="the approval's timeout",
        interval_s=0.05,
    )  # three days pass and nobody decides
    described = _ended(cloud, arn)

    assert described["status"] == "FAILED"
    assert described["error"] == "States.Timeout"
    assert "Wait for approval" in _notification(cloud, "approval-timeout")["message"]
    endpoints = cloud.client("sagemaker").list_endpoints(NameContains="sdflow-unapproved")["Endpoints"]
    assert endpoints == []
    leftovers = _settled(cloud, sagemaker)
    assert leftovers == []
    _record("manual approval never given", "States.Timeout after 3 days, nothing deployed", started, leftovers)


# ---------------------------------------------------------------------------- Lambda


def test_lambda_worker_killed_mid_run_run_survives(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> None:
    sagemaker.job_seconds = hold_for(1.0)
    arn = _start(cloud, "kill-worker")
    cloud.faults.kill_lambda_worker("JobEventsFunction", timeout_s=60.0)
    killed_at = time.monotonic()

    described = _ended(cloud, arn)

    assert described["status"] == "SUCCEEDED", described.get("cause")
    leftovers = _settled(cloud, sagemaker)
    assert leftovers == []
    _record("a Lambda worker killed mid-run", "event redelivered, run SUCCEEDED", killed_at, leftovers)


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
    # Jobs outlast the Retry's wait (at most 5 s for a download, 10 s for training), as real ones do.
    sagemaker.seconds_by_kind.update(processing=8.0, training=15.0)
    document = _document(cloud)
    document["endpoint"]["name"] = "sdflow-crash"  # a new endpoint: CreateEndpoint, not an update
    try:
        started = time.monotonic()
        arn = _start(cloud, "crash-everywhere", document)
        described = _ended(cloud, arn)
    finally:
        for function in crashes:
            cloud.faults.clear_lambda_crash(function)

    assert described["status"] == "SUCCEEDED", described.get("cause")
    assert {function: cloud.faults.crashes_done(path) for function, path in claims.items()} == dict.fromkeys(crashes, 1)
    run_hash = _run_hash(cloud, arn)
    downloads = _downloads(cloud, run_hash)
    assert len(downloads) == SHARDS, "the crashed starter's job was adopted"
    assert len(_jobs(cloud, "training", run_hash)) == 1, "the crashed starter's job was adopted"
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
    leftovers = _settled(cloud, sagemaker)
    assert leftovers == []
    _record("a Lambda runtime crash in every task", "each retried, run SUCCEEDED", started, leftovers)


def test_starter_crash_after_create_leaves_exactly_one_job(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> None:
    claims = cloud.faults.crash_lambda_after("StartTrainingFunction", "sagemaker.CreateTrainingJob")
    sagemaker.seconds_by_kind["training"] = 15.0  # still running when the Retry comes (at most 10 s)
    try:
        started = time.monotonic()
        arn = _start(cloud, "crash-after-create")
        described = _ended(cloud, arn)
    finally:
        cloud.faults.clear_lambda_crash("StartTrainingFunction")

    assert described["status"] == "SUCCEEDED", described.get("cause")
    assert cloud.faults.crashes_done(claims) == 1
    jobs = _jobs(cloud, "training", _run_hash(cloud, arn))
    assert len(jobs) == 1, jobs
    leftovers = _settled(cloud, sagemaker)
    assert leftovers == []
    _record("starter crash after CreateTrainingJob", "job adopted by the retry: 1 job", started, leftovers)


# ---------------------------------------------------------------------------- names, redrive, resume


def test_execution_name_reused_adopts_no_old_job(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> None:
    first = _start(cloud, "reused")
    assert _ended(cloud, first)["status"] == "SUCCEEDED"
    old_jobs = set(_downloads(cloud, "sdf-dl-reused"))
    _forget_execution(first)  # Step Functions frees a name 90 days after its execution closed
    started = time.monotonic()

    second = _start(cloud, "reused")
    described = _ended(cloud, second)

    assert second == first
    assert described["status"] == "FAILED"
    assert described["error"] == "InvalidRunDocument"
    assert "reused" in described["cause"]
    assert set(_downloads(cloud, "sdf-dl-reused")) == old_jobs, "nothing adopted, nothing started"
    leftovers = _settled(cloud, sagemaker)
    assert leftovers == []
    _record("an execution name reused", "refused at validation, no old job adopted", started, leftovers)


def _forget_execution(execution_arn: str) -> None:
    """What 90 days do: Step Functions no longer knows the closed execution, so its name is free."""
    from moto.stepfunctions.responses import get_backend

    from sdflow.local.cloud import ACCOUNT_ID, REGION

    for machine in get_backend(ACCOUNT_ID, REGION).state_machines:
        machine.executions = [e for e in machine.executions if e.execution_arn != execution_arn]


def test_redrive_after_training_failure_reruns_only_training(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> None:
    sagemaker.seconds_by_kind["training"] = hold_for(30.0)
    arn = _start(cloud, "redrive-training")
    run_hash = _run_hash(cloud, arn)
    cloud.faults.kill_job("training", _wait_for_job(cloud, "training", run_hash))
    assert _ended(cloud, arn)["status"] == "FAILED"
    downloads = _downloads(cloud, run_hash)
    sagemaker.seconds_by_kind.clear()
    started = time.monotonic()

    cloud.client("stepfunctions").redrive_execution(executionArn=arn)
    described = _ended(cloud, arn)

    assert described["status"] == "SUCCEEDED", described.get("cause")
    assert described.get("redriveCount") == 1
    assert _downloads(cloud, run_hash) == downloads, "no shard downloaded again"
    training = _jobs(cloud, "training", run_hash)
    assert len(training) == 2
    assert any("-r1-" in name for name in training), training
    leftovers = _settled(cloud, sagemaker)
    assert leftovers == []
    _record("training failed, then redrive-execution", "only Train model re-ran, SUCCEEDED", started, leftovers)


def test_redrive_after_shard_failure_reruns_only_the_failed_shard(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> None:
    sagemaker.seconds_by_kind["processing"] = hold_for(3.0)
    arn = _start(cloud, "redrive-shard", _document(cloud, tolerated_failure_percent=0))
    run_hash = _run_hash(cloud, arn)
    first = _wait_for_job(cloud, "processing", run_hash)
    shard_stem = first.rsplit("-a", 1)[0]
    cloud.faults.kill_job("processing", first)
    cloud.faults.kill_job("processing", _wait_for_job(cloud, "processing", f"{shard_stem}-a1"))
    failed = _ended(cloud, arn)
    assert failed["status"] == "FAILED"
    # Redrive once the failure's cleanup has run, as the notification invites: a cleanup still
    # retrying would stop the redrive's new jobs (issue "the second review", item 7).
    _notification(cloud, "redrive-shard")
    assert _settled(cloud, sagemaker) == []
    before = set(_downloads(cloud, run_hash))
    sagemaker.seconds_by_kind.clear()
    started = time.monotonic()

    cloud.client("stepfunctions").redrive_execution(executionArn=arn)
    described = _ended(cloud, arn)

    assert described["status"] == "SUCCEEDED", described.get("cause")
    new_jobs = set(_downloads(cloud, run_hash)) - before
    assert len(new_jobs) == 1, f"only the failed shard downloads again: {sorted(new_jobs)}"
    assert next(iter(new_jobs)).split("-")[-3] == shard_stem.split("-")[-2]
    leftovers = _settled(cloud, sagemaker)
    assert leftovers == []
    _record("a shard failed past tolerance, then redrive", "only that shard re-ran, SUCCEEDED", started, leftovers)


def test_resume_after_training_failure_starts_no_download_job(
    cloud: LocalCloud, sagemaker: NoOpSageMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    sagemaker.seconds_by_kind["training"] = hold_for(30.0)
    failed = _start(cloud, "resume-me")
    cloud.faults.kill_job("training", _wait_for_job(cloud, "training", _run_hash(cloud, failed)))
    assert _ended(cloud, failed)["status"] == "FAILED"
    sagemaker.seconds_by_kind.clear()
    for key, value in cloud.cli_env().items():
        monkeypatch.setenv(key, value)
    started = time.monotonic()

    assert cli.main(["resume", failed, "--name", "resumed"]) == 0
    resumed = failed.rsplit(":", 1)[0] + ":resumed"
    described = _ended(cloud, resumed)

    assert described["status"] == "SUCCEEDED", described.get("cause")
    assert _downloads(cloud, _run_hash(cloud, resumed)) == [], "every shard reused"
    config = json.loads(described["output"])["config"]
    assert config["resume"]["from_execution_arn"] == failed
    assert config["resume"]["shards_reused"] == SHARDS
    leftovers = _settled(cloud, sagemaker)
    assert leftovers == []
    _record("training failed, then sdflow resume", "0 download jobs, run SUCCEEDED", started, leftovers)
