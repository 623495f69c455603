"""Faults around the end of a run and the events that carry it, on the strict local cloud: a
cleanup retried while the user redrives, a run's end event or a job's event lost (the reconciler
answers), an event delivered twice, a task outliving its timeout, an approval never given. As in
test_run_faults.py, SageMaker jobs are no-ops, each test asserts that nothing is left running, and
each records its recovery time in RECOVERY, printed at the end of the module."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from sdflow.local.cloud import LocalCloud
from sdflow.local.sagemaker.noop import NoOpSageMaker
from tests.constants import hold_for
from tests.e2e.clouds import CloudSpec
from tests.e2e.runs import (
    RecoveryTable,
    download_jobs,
    ended,
    function_log_lines,
    jobs_named,
    notification,
    run_document,
    run_hash_of,
    settled,
    start_run,
    started_job_from_log,
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


def test_redrive_inside_the_cleanup_retry_window_keeps_its_new_jobs(
    cloud: LocalCloud, sagemaker: NoOpSageMaker
) -> None:
    """Part of the cleanup fails (the training job's stop is throttled): notify publishes, raises,
    and Lambda retries it a minute or more later. The user redrives in that minute, as the
    notification invites; the redrive adopts the job still running, and the retried cleanup must not
    stop it (the run keeps its hash and its claims across redrives)."""
    clock = cloud.clock
    sagemaker.seconds_by_kind["training"] = hold_for(20.0)
    arn = start_run(cloud, "redrive-window")
    run_hash = run_hash_of(cloud, arn)
    first = wait_for_started_job(cloud, "training", run_hash)
    # Five calls: botocore retries a throttled call itself, four times in its default (legacy) mode.
    cloud.faults.fail_api_calls("sagemaker.StopTrainingJob", "ThrottlingException", "Rate exceeded", times=5)
    sfn = cloud.client("stepfunctions")
    with clock.busy():  # the clock at real speed: Lambda's retry comes a real minute later, not in 0.6 s
        sfn.stop_execution(executionArn=arn, error="UserStopped", cause="stopped to redrive")
        message = notification(cloud, "redrive-window")["message"]
        assert f"NOT cleaned up: training job {first} is still running" in message
        sfn.redrive_execution(executionArn=arn)
        # The redrive's Train model finds the job by its kept claim and adopts it (job_start).
        wait_for(
            lambda: any(
                "earlier attempt's job adopted" in line and first in line
                for line in function_log_lines(cloud, "StartTrainingFunction")
            ),
            timeout_s=30.0,
            what="the redrive's starter adopting the running job",
            interval_s=0.2,
        )
    started = time.monotonic()

    def retried() -> bool:  # the first cleanup logged "run cleaned up"; the retry logs either line
        lines = function_log_lines(cloud, "NotifyFunction")
        done = [line for line in lines if "run cleaned up" in line or "cleanup skipped" in line]
        return len(done) >= 2

    wait_for(retried, timeout_s=60.0, what="the notify retry's cleanup", interval_s=0.5)
    described = cloud.client("sagemaker").describe_training_job(TrainingJobName=first)
    assert described["TrainingJobStatus"] == "InProgress", "the retried cleanup stopped the redrive's job"
    assert ended(cloud, arn)["status"] == "SUCCEEDED"
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record(
        "a redrive inside the cleanup's retry window", "its (adopted) training job kept, SUCCEEDED", started, leftovers
    )


def test_redrive_before_a_retried_cleanup_its_earlier_downloads_are_stopped(
    cloud: LocalCloud, sagemaker: NoOpSageMaker
) -> None:
    """Issue 32 item 3: the run is stopped while its downloads run, its notify fails (reading the
    history is throttled) and Lambda retries it a minute later; the user redrives in that minute.
    The redrive re-runs the aborted Map children under `-r1` names and adopts no download, so the
    retried cleanup, though superseded, stops the `-r0` downloads: each shard is downloaded once."""
    clock = cloud.clock
    sagemaker.seconds_by_kind["processing"] = hold_for(25.0)
    arn = start_run(cloud, "redrive-downloads")
    run_hash = run_hash_of(cloud, arn)
    wait_for(
        lambda: len(jobs_named(cloud, "processing", f"{run_hash}-", "InProgress")) == SHARDS,
        timeout_s=60.0,
        what="every shard's download running",
        interval_s=0.2,
    )
    earlier = wait_for_started_job(cloud, "processing", f"-{run_hash}-")
    first_downloads = download_jobs(cloud, run_hash)
    # Enough for every attempt botocore makes in the first invocation; the retry's calls then pass.
    cloud.faults.fail_api_calls("states.GetExecutionHistory", "ThrottlingException", "Rate exceeded", times=5)
    sfn = cloud.client("stepfunctions")
    with clock.busy():  # real speed: Lambda's retry comes a real minute later
        sfn.stop_execution(executionArn=arn, error="UserStopped", cause="stopped to redrive")
        sfn.redrive_execution(executionArn=arn)
        started = time.monotonic()

        def statuses() -> dict[str, str]:
            api = cloud.client("sagemaker")
            return {
                name: api.describe_processing_job(ProcessingJobName=name)["ProcessingJobStatus"]
                for name in first_downloads
            }

        # Waited on by the jobs themselves: the module's other runs log "cleanup skipped" in the same function log.
        wait_for(
            lambda: set(statuses().values()) <= {"Stopping", "Stopped"},
            timeout_s=150.0,
            what="the retried, superseded cleanup stopping the earlier redrive's downloads",
            interval_s=0.5,
        )
    assert earlier in statuses()
    assert ended(cloud, arn)["status"] == "SUCCEEDED"
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record(
        "a redrive before a retried cleanup, downloads running",
        "the earlier downloads stopped, the redrive's kept, SUCCEEDED",
        started,
        leftovers,
    )


def test_run_end_event_lost_reconciler_notifies_and_cleans_up_within_its_period(
    cloud: LocalCloud, sagemaker: NoOpSageMaker
) -> None:
    """EventBridge carries Step Functions' status changes best effort: the end of a stopped run is
    never delivered. Nothing happens until the reconciler's next run, which hands notify the end:
    the training job is stopped and the user notified."""
    sagemaker.seconds_by_kind["training"] = hold_for(60.0)
    arn = start_run(cloud, "lost-end")
    cloud.faults.drop_end_event(arn)
    job = wait_for_started_job(cloud, "training", run_hash_of(cloud, arn))
    cloud.client("stepfunctions").stop_execution(executionArn=arn, error="UserStopped", cause="end event lost")
    assert ended(cloud, arn)["status"] == "ABORTED"
    cloud.wait_idle(30.0)
    assert not [m for m in cloud.sns_messages() if m["attributes"].get("run_id") == "lost-end"]
    described = cloud.client("sagemaker").describe_training_job(TrainingJobName=job)
    assert described["TrainingJobStatus"] == "InProgress", "without its end event nobody stopped it"
    started = time.monotonic()

    cloud.clock.advance(10 * 60 + 1)  # the reconciler's rate(10 minutes) comes round

    message = notification(cloud, "lost-end")["message"]
    assert "was STOPPED" in message
    assert f"1 training job ({job})" in message
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    wait_for(
        lambda: any(
            "notify invoked" in line and arn in line for line in function_log_lines(cloud, "ReconcilerFunction")
        ),
        timeout_s=30.0,
        what="the reconciler's log of the run it closed",
        interval_s=0.5,
    )
    RECOVERY.record(
        "the run's end event lost", "reconciler handed notify the end: stopped, notified", started, leftovers
    )


def test_succeeded_run_end_event_lost_reconciler_notifies_without_any_claim(
    cloud: LocalCloud, sagemaker: NoOpSageMaker
) -> None:
    """Issue 32 item 3: a run that succeeds holds no claim when it ends (the endpoint's claim was
    answered), so the claims never showed its lost end. The reconciler's pass lists the pipeline's
    recently ended executions (ListExecutions, authorized by the template's policy) and hands
    notify the end: the user hears of the success."""
    arn = start_run(cloud, "lost-success")
    cloud.faults.drop_end_event(arn)
    assert ended(cloud, arn)["status"] == "SUCCEEDED"
    cloud.wait_idle(30.0)
    assert not [m for m in cloud.sns_messages() if m["attributes"].get("run_id") == "lost-success"]
    started = time.monotonic()

    cloud.clock.advance(10 * 60 + 1)  # the reconciler's rate(10 minutes) comes round

    message = notification(cloud, "lost-success")
    assert "succeeded" in message["subject"]
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record(
        "a succeeded run's end event lost (no claim left)", "reconciler listed it, notify told", started, leftovers
    )


def test_account_with_long_job_history_run_stopped_cleanup_lists_no_job_at_awss_rate(
    cloud: LocalCloud, sagemaker: NoOpSageMaker
) -> None:
    """Issue 23 item 8: SageMaker keeps every job record, and its List* calls are throttled at about
    2 a second. With 5,000 jobs of earlier runs in the account and List* at that rate, a run is
    started, its downloads and training start, and it is stopped: the cleanup stops the training
    job from the run's claims. Neither the starters nor the cleanup list a single job."""
    cloud.faults.seed_job_history(5000)
    quotas = cloud.sagemaker_quotas
    quotas.set_list_rate(2.0, 10)
    try:
        sagemaker.seconds_by_kind["training"] = hold_for(60.0)
        listed_before = quotas.list_calls
        arn = start_run(cloud, "long-history")
        job = started_job_from_log(cloud, "sdf-tr-", run_hash_of(cloud, arn))
        started = time.monotonic()
        cloud.client("stepfunctions").stop_execution(executionArn=arn, error="UserStopped", cause="long history")
        message = notification(cloud, "long-history")["message"]
        assert f"1 training job ({job})" in message
        wait_for(
            lambda: (
                cloud.client("sagemaker").describe_training_job(TrainingJobName=job)["TrainingJobStatus"] == "Stopped"
            ),
            timeout_s=30.0,
            what=f"{job} Stopped",
            interval_s=0.2,
        )
        cloud.wait_idle(30.0)
        assert quotas.list_calls == listed_before, "the pipeline listed SageMaker jobs"
    finally:
        quotas.set_list_rate(*CLOUD.sagemaker_list_rate)
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record(
        "stopped, 5,000 jobs in the account's history", "stopped from the claims, 0 List calls", started, leftovers
    )


def test_redrive_of_evaluate_model_before_its_cleanup_adopts_the_running_evaluation_job(
    cloud: LocalCloud, sagemaker: NoOpSageMaker
) -> None:
    """The run is stopped during Evaluate model and redriven before any cleanup ran (here its end
    event is lost; a cleanup retried by Lambda, or one whose stop failed, leaves the same): the
    redrive's attempt 0 (`-r1-a0`) adopts the evaluation job still running instead of starting a
    second one beside it, and the run succeeds on that job's result."""
    sagemaker.seconds_by_kind["training"] = hold_for(3.0)
    arn = start_run(cloud, "redrive-evaluation")
    cloud.faults.drop_end_event(arn)
    run_hash = run_hash_of(cloud, arn)
    wait_for_job(cloud, "training", run_hash)  # every download has ended by now
    sagemaker.seconds_by_kind["processing"] = hold_for(20.0)
    job = wait_for_started_job(cloud, "processing", f"sdf-ev-redrive-evaluation-{run_hash}-r0-", timeout_s=120.0)
    sfn = cloud.client("stepfunctions")
    sfn.stop_execution(executionArn=arn, error="UserStopped", cause="stopped to redrive")
    assert ended(cloud, arn)["status"] == "ABORTED"
    started = time.monotonic()

    sfn.redrive_execution(executionArn=arn)

    assert ended(cloud, arn)["status"] == "SUCCEEDED"
    evaluations = [name for name in jobs_named(cloud, "processing", run_hash) if name.startswith("sdf-ev-")]
    assert evaluations == [job], "the redrive adopted the running job: one evaluation job"
    adopted = [line for line in function_log_lines(cloud, "StartEvaluationFunction") if "adopted" in line]
    assert any(job in line for line in adopted)
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record(
        "a redrive of Evaluate model before its cleanup", "its evaluation job adopted, SUCCEEDED", started, leftovers
    )


def test_lost_job_event_is_resolved_by_the_reconciler_within_one_period(
    cloud: LocalCloud, sagemaker: NoOpSageMaker
) -> None:
    events = cloud.client("events")
    rule = next(
        r["Name"] for r in events.list_rules()["Rules"] if "TrainingJobEnded" in r["Name"] or "Training" in r["Name"]
    )
    events.disable_rule(Name=rule)
    try:
        arn = start_run(cloud, "lost-event")
        run_hash = run_hash_of(cloud, arn)
        job = wait_for_job(cloud, "training", run_hash, status=None)  # a no-op job ends at once

        def completed() -> bool:
            described = cloud.client("sagemaker").describe_training_job(TrainingJobName=job)
            return described["TrainingJobStatus"] == "Completed"

        wait_for(completed, timeout_s=30.0, what=f"training job {job} Completed", interval_s=0.2)
        lost_at = time.monotonic()
        # The reconciler (every 10 minutes) describes a training job's claim every period, whatever
        # its deadline (reconciler.py, _is_due): one period on the clock answers the task from the
        # job's status. It may already have (the scaled clock runs a period in 6 s while idle).
        cloud.clock.advance(10 * 60)

        described = ended(cloud, arn)
    finally:
        events.enable_rule(Name=rule)

    assert described["status"] == "SUCCEEDED", described.get("cause")

    def reconciled() -> bool:
        lines = function_log_lines(cloud, "ReconcilerFunction")
        return any("missed event reconciled" in line and job in line for line in lines)

    wait_for(reconciled, timeout_s=30.0, what="the reconciler's resolution of the lost event", interval_s=0.5)
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record("training event lost (rule disabled)", "reconciler resolved it, run SUCCEEDED", lost_at, leftovers)


def test_job_event_delivered_twice_has_one_effect(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> None:
    sagemaker.seconds_by_kind["training"] = hold_for(2.0)
    arn = start_run(cloud, "twice")
    run_hash = run_hash_of(cloud, arn)
    wait_for_job(cloud, "training", run_hash)
    downloads = download_jobs(cloud, run_hash)
    started = time.monotonic()
    for job in downloads:
        cloud.faults.redeliver_sagemaker_event(job, status="Completed")

    described = ended(cloud, arn)

    assert described["status"] == "SUCCEEDED", described.get("cause")
    assert len(download_jobs(cloud, run_hash)) == SHARDS
    assert len(jobs_named(cloud, "training", run_hash)) == 1
    cloud.wait_idle(30.0)
    assert len([m for m in cloud.sns_messages() if m["attributes"].get("run_id") == "twice"]) == 1
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record("the same job event delivered twice", "one effect, run SUCCEEDED", started, leftovers)


def test_training_capacity_failure_is_retried_after_backoff_and_run_succeeds(
    cloud: LocalCloud, sagemaker: NoOpSageMaker
) -> None:
    """The definition's own Retry for TrainingCapacityUnavailable (300 s, FULL jitter) plays out."""
    cloud.faults.fail_next_training_jobs(1)
    started = time.monotonic()
    arn = start_run(cloud, "capacity")

    described = ended(cloud, arn)

    assert described["status"] == "SUCCEEDED", described.get("cause")
    run_hash = run_hash_of(cloud, arn)
    failed = jobs_named(cloud, "training", run_hash, "Failed")
    completed = jobs_named(cloud, "training", run_hash, "Completed")
    assert len(failed) == 1, failed
    assert [name.rsplit("-a", 1)[-1] for name in (failed[0], completed[0])] == ["0", "1"], (failed, completed)
    reason = cloud.client("sagemaker").describe_training_job(TrainingJobName=failed[0])["FailureReason"]
    assert reason.startswith("CapacityError: Unable to provision requested ML compute capacity")
    events = cloud.client("stepfunctions").get_execution_history(executionArn=arn, maxResults=1000)["events"]
    retried = [e for e in events if e["type"] == "TaskFailed"]
    assert [e["taskFailedEventDetails"]["error"] for e in retried] == ["TrainingCapacityUnavailable"]
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record("training capacity failure", "retried after the 300 s backoff, SUCCEEDED", started, leftovers)


def test_training_job_outliving_its_task_timeout_fails_run_and_is_stopped(
    cloud: LocalCloud, sagemaker: NoOpSageMaker
) -> None:
    sagemaker.seconds_by_kind["training"] = 30 * 86_400.0  # a job that never ends
    arn = start_run(cloud, "training-timeout", run_document(cloud))
    job = wait_for_job(cloud, "training", run_hash_of(cloud, arn))
    started = time.monotonic()

    assert cloud.clock.advance_to_next(what="TimeoutSeconds") is not None  # a day and an hour pass
    described = ended(cloud, arn)

    assert described["status"] == "FAILED"
    assert described["error"] == "States.Timeout"
    message = notification(cloud, "training-timeout")
    assert "Train model" in message["message"]
    assert "States.Timeout" in message["message"]
    # Stopped by whichever sees it first: the reconciler (the claim outlived its deadline) or the
    # failed run's cleanup; either way nothing runs to its MaxRuntime.
    status = cloud.client("sagemaker").describe_training_job(TrainingJobName=job)["TrainingJobStatus"]
    assert status == "Stopped"
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record("training outlived its task timeout", "States.Timeout, job stopped, notified", started, leftovers)


def test_manual_approval_never_given_times_out_without_deploy(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> None:
    document = run_document(cloud)
    document["approval"] = {"mode": "manual", "timeout_seconds": 3 * 86_400}
    document["endpoint"]["name"] = "sdflow-unapproved"
    arn = start_run(cloud, "approval-timeout", document)

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
    described = ended(cloud, arn)

    assert described["status"] == "FAILED"
    assert described["error"] == "States.Timeout"
    assert "Wait for approval" in notification(cloud, "approval-timeout")["message"]
    endpoints = cloud.client("sagemaker").list_endpoints(NameContains="sdflow-unapproved")["Endpoints"]
    assert endpoints == []
    leftovers = settled(cloud, sagemaker)
    assert leftovers == []
    RECOVERY.record("manual approval never given", "States.Timeout after 3 days, nothing deployed", started, leftovers)
