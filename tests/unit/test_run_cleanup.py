"""Nothing left running: a failed, stopped or timed-out run's jobs are stopped, its endpoint
deployment rolled back (now, or by job_events when the endpoint settles), its claims released."""

from __future__ import annotations

from typing import Any

import pytest

from sdflow_common import names, rollback, run_cleanup
from sdflow_common.job_events import EndpointDetail, TaskResolver
from sdflow_common.token_store import TokenStore
from tests.constants import ACCOUNT, REGION
from tests.unit.sagemaker_fake import FakeSageMakerClient, client_error

EXECUTION_ARN = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:sdflow-pipeline-test:cats-v1-abc"
OTHER_ARN = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:sdflow-pipeline-test:dogs-v2-xyz"
START_MS = 1795341600000
RUN_HASH = names.run_hash(EXECUTION_ARN, START_MS)
# The same execution name used again 90 days later: another run.
OLD_RUN_HASH = names.run_hash(EXECUTION_ARN, START_MS - 91 * 86_400_000)
ENDPOINT = "sdflow-cats"
OURS = names.deployment_name(ENDPOINT, RUN_HASH, 0, 0)
# What a cleanup that found nothing running says: the kinds it looked at, no more.
NOTHING_RUNNING = (
    "None of this run's download jobs, dedup jobs, evaluation jobs, training jobs or endpoint deployments "
    "was still running when checked."
)


def _download(shard: str, run_hash: str = RUN_HASH, attempt: int = 0) -> str:
    return names.download_job_name(run_hash, "cats-v1-abc", shard, 0, attempt)


def _training(run_hash: str = RUN_HASH, attempt: int = 0) -> str:
    return names.training_job_name(run_hash, "cats-v1-abc", 0, attempt)


@pytest.fixture
def sagemaker() -> FakeSageMakerClient:
    return FakeSageMakerClient()


def _claim(
    store: TokenStore, name: str, kind: Any, context: dict[str, str] | None = None, arn: str = EXECUTION_ARN
) -> str:
    token = f"token-{name}"
    store.claim(name, token, arn, kind, context, timeout_seconds=3600)
    return token


class FakeStepFunctions:
    """send_task_* answer as for a task whose execution ended; describe_execution its status."""

    def __init__(self, status: str, redrive_count: int = 0) -> None:
        self.status = status
        self.redrive_count = redrive_count
        self.sent: list[str] = []

    def send_task_success(self, **params: Any) -> None:
        self.sent.append("success")
        raise client_error("TaskTimedOut", "Task Timed Out", "SendTaskSuccess")

    def send_task_failure(self, **params: Any) -> None:
        self.sent.append("failure")
        raise client_error("TaskTimedOut", "Task Timed Out", "SendTaskFailure")

    def describe_execution(self, executionArn: str) -> dict[str, Any]:
        return {"executionArn": executionArn, "status": self.status, "redriveCount": self.redrive_count}


def _clean(
    sagemaker: FakeSageMakerClient,
    store: TokenStore,
    sfn: FakeStepFunctions | None = None,
    redrive_count: int = 0,
    training_jobs: list[str] | None = None,
) -> run_cleanup.CleanupReport:
    return run_cleanup.clean_up_run(
        EXECUTION_ARN,
        START_MS,
        sagemaker=sagemaker,
        store=store,
        sfn=sfn or FakeStepFunctions("FAILED", redrive_count),
        redrive_count=redrive_count,
        training_jobs=training_jobs or [],
    )


# ---------------------------------------------------------------------------- a redrive since the end


@pytest.mark.parametrize(("status", "redrive_count"), [("RUNNING", 1), ("FAILED", 1), ("RUNNING", 0)])
def test_clean_up_run_redriven_since_the_end_touches_nothing(
    sagemaker: FakeSageMakerClient, store: TokenStore, status: str, redrive_count: int
) -> None:
    """The end of attempt 0 is cleaned up (a retried cleanup) after the user redrove the run: the
    redrive's jobs and claims share the run's hash and are left alone."""
    redriven_job = _training(attempt=1)
    sagemaker.add_job("training", redriven_job)
    sagemaker.add_job("processing", _download("00001"))
    _claim(store, redriven_job, "training")

    report = _clean(sagemaker, store, FakeStepFunctions(status, redrive_count), redrive_count=0)

    assert sagemaker.jobs["training"][redriven_job] == "InProgress"
    assert sagemaker.jobs["processing"][_download("00001")] == "InProgress"
    assert sagemaker.called("ListTrainingJobs") == []
    assert sagemaker.called("ListProcessingJobs") == []
    assert store.get(redriven_job) is not None
    assert report.errors == []
    assert report.lines()[0].startswith("Nothing stopped: the run ")
    assert report.lines()[0].endswith("what runs now is the redrive's.")


def test_clean_up_run_end_of_the_latest_redrive_is_cleaned_up(
    sagemaker: FakeSageMakerClient, store: TokenStore
) -> None:
    job = _training(attempt=1)
    sagemaker.add_job("training", job)
    _claim(store, job, "training")

    report = _clean(sagemaker, store, FakeStepFunctions("FAILED", 1), redrive_count=1)

    assert report.stopped == {"training job": [job]}


def _download_of_redrive(shard: str, redrive: int) -> str:
    return names.download_job_name(RUN_HASH, "cats-v1-abc", shard, redrive, 0)


def test_clean_up_run_superseded_stops_the_downloads_an_earlier_redrive_left_running(
    sagemaker: FakeSageMakerClient, store: TokenStore
) -> None:
    """Issue 32 item 3: the run was redriven before its cleanup ran. A redrive re-runs a failed Map
    child under a new name (`-r1`) and adopts no download across redrives, so the `-r0` downloads
    still running download the same shards a second time, until their MaxRuntime: they are stopped.
    The redrive's own jobs, and the training job it may adopt, are left alone."""
    earlier, ended, redrives = _download("00001"), _download("00002"), _download_of_redrive("00001", 1)
    for name in (earlier, redrives, _training()):
        _claimed_job(sagemaker, store, name)
    _claimed_job(sagemaker, store, ended, status="Completed")

    report = _clean(sagemaker, store, FakeStepFunctions("RUNNING", 1), redrive_count=0)

    assert sagemaker.jobs["processing"][earlier] == "Stopping"
    assert store.get(earlier) is None
    assert sagemaker.jobs["processing"][redrives] == "InProgress"
    assert store.get(redrives) is not None
    assert sagemaker.jobs["training"][_training()] == "InProgress"
    assert store.get(_training()) is not None
    assert sagemaker.jobs["processing"][ended] == "Completed"
    assert report.errors == []
    assert report.lines() == [
        f"Stopped: 1 download job ({earlier}) an earlier redrive left running; the rest was left to the "
        "redrive: the run was redriven (redrive 1) after this end."
    ]


def test_clean_up_run_claim_taken_over_after_the_read_its_job_is_not_stopped(
    sagemaker: FakeSageMakerClient, store: TokenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32 item 3, the cleanup-versus-redrive race: a redrive's training task adopts the
    job the ended run left running by taking over its claim (job_control.earlier_redrives), here
    between the cleanup's read of the claims and its stop. The claim is deleted only while it
    holds the token that was read, and the job stopped only when that delete succeeded."""
    adopted = _training()
    _claimed_job(sagemaker, store, adopted)
    sagemaker.warm_pools[adopted] = [1800, None]
    read = list(store.for_execution(EXECUTION_ARN))
    store.claim(adopted, "token-of-the-redrive", EXECUTION_ARN, "training", timeout_seconds=3600)
    monkeypatch.setattr(store, "for_execution", lambda *args, **kwargs: iter(read))

    report = _clean(sagemaker, store)

    assert sagemaker.jobs["training"][adopted] == "InProgress"
    assert sagemaker.called("StopTrainingJob") == []
    assert sagemaker.called("UpdateTrainingJob") == [], "its warm pool is the redrive's too"
    assert store.get(adopted).task_token == "token-of-the-redrive"  # type: ignore[union-attr]
    assert report.stopped == {}
    assert report.errors == []


# ---------------------------------------------------------------------------- jobs


def _claimed_job(sagemaker: FakeSageMakerClient, store: TokenStore, name: str, status: str = "InProgress") -> None:
    """A job as a starter leaves it: claimed, then created."""
    if name.startswith(names.TRAINING_PREFIX):
        _claim(store, name, "training")
        sagemaker.add_job("training", name, status=status)
        return
    kinds = {names.EVALUATION_PREFIX: "evaluation", names.DEDUP_PREFIX: "dedup"}
    _claim(store, name, kinds.get(name[: len(names.DEDUP_PREFIX)], "download"))
    sagemaker.add_job("processing", name, status=status)


def test_clean_up_run_claimed_jobs_of_the_run_are_stopped_and_no_other(
    sagemaker: FakeSageMakerClient, store: TokenStore
) -> None:
    ours = [_download(f"0000{i}") for i in range(3)]
    for name in ours:
        _claimed_job(sagemaker, store, name)
    _claimed_job(sagemaker, store, _download("00009"), status="Completed")
    _claimed_job(sagemaker, store, _training())
    # The same execution name, started 91 days earlier: another run, whose claims live on here.
    _claimed_job(sagemaker, store, _download("00001", run_hash=OLD_RUN_HASH))
    sagemaker.add_job("training", _training(run_hash=OLD_RUN_HASH))

    report = _clean(sagemaker, store)

    assert report.stopped == {"download job": ours, "training job": [_training()]}
    assert sagemaker.jobs["processing"][_download("00001", run_hash=OLD_RUN_HASH)] == "InProgress"
    assert sagemaker.jobs["training"][_training(run_hash=OLD_RUN_HASH)] == "InProgress"
    assert sagemaker.jobs["processing"][_download("00009")] == "Completed"
    assert report.lines()[0] == f"Stopped: 3 download jobs ({', '.join(ours)}); 1 training job ({_training()})"
    assert report.errors == []


def test_clean_up_run_jobs_found_from_the_claims_without_any_list_call(
    sagemaker: FakeSageMakerClient, store: TokenStore
) -> None:
    """Issue 23 item 8: SageMaker's List* calls grow with every job the account ever ran and are
    throttled at low rates; the cleanup stops the claimed names, one Stop each, and lists nothing."""
    evaluation = names.evaluation_job_name(RUN_HASH, "cats-v1-abc", 0, 0)
    dedup = names.dedup_job_name(RUN_HASH, "cats-v1-abc", 0, 1)
    _claimed_job(sagemaker, store, evaluation)
    _claimed_job(sagemaker, store, dedup)
    _claimed_job(sagemaker, store, _download("00001"))
    for i in range(230):
        sagemaker.add_job("processing", _download(f"{i:05d}", run_hash=OLD_RUN_HASH), status="Completed")

    report = _clean(sagemaker, store)

    assert report.stopped == {
        "download job": [_download("00001")],
        "dedup job": [dedup],
        "evaluation job": [evaluation],
    }
    assert sagemaker.jobs["processing"][evaluation] == "Stopping"
    assert sagemaker.jobs["processing"][dedup] == "Stopping"
    assert f"1 evaluation job ({evaluation})" in report.lines()[0]
    assert f"1 dedup job ({dedup})" in report.lines()[0]
    assert store.get(dedup) is None, "the stopped job's claim is released"
    assert sagemaker.called("ListProcessingJobs") == []
    assert sagemaker.called("ListTrainingJobs") == []
    assert len(sagemaker.called("StopProcessingJob")) == 3


def test_clean_up_run_many_claimed_jobs_every_one_is_stopped(sagemaker: FakeSageMakerClient, store: TokenStore) -> None:
    for i in range(230):
        _claimed_job(sagemaker, store, _download(f"{i:05d}"))

    report = _clean(sagemaker, store)

    assert len(report.stopped["download job"]) == 230
    assert set(sagemaker.jobs["processing"].values()) == {"Stopping"}
    assert "and 220 more" in report.lines()[0]
    assert report.claims_deleted == 230


def test_clean_up_run_job_ended_before_its_stop_is_neither_stopped_nor_an_error(
    sagemaker: FakeSageMakerClient, store: TokenStore
) -> None:
    _claimed_job(sagemaker, store, _training())
    sagemaker.ends_before_stop.add(_training())

    report = _clean(sagemaker, store)

    assert report.stopped == {}
    assert report.errors == []
    assert report.lines() == [NOTHING_RUNNING]


def test_clean_up_run_one_stop_throttled_the_others_are_stopped_and_the_error_reported(
    sagemaker: FakeSageMakerClient, store: TokenStore
) -> None:
    first, second = _download("00001"), _download("00002")
    _claimed_job(sagemaker, store, first)
    _claimed_job(sagemaker, store, second)
    sagemaker.fail_next(
        "StopProcessingJob", first, client_error("ThrottlingException", "Rate exceeded", "StopProcessingJob")
    )

    report = _clean(sagemaker, store)

    assert report.stopped == {"download job": [second]}
    [error] = report.errors
    assert first in error
    assert "Rate exceeded" in error
    assert f"aws sagemaker stop-processing-job --processing-job-name {first}" in error
    assert any(line.startswith("NOT cleaned up:") for line in report.lines())


def test_clean_up_run_stop_failed_keeps_that_job_claim_and_deletes_the_others(
    sagemaker: FakeSageMakerClient, store: TokenStore
) -> None:
    """A redrive finds a job the ended run left running by its claim (job_control.earlier_redrives):
    a job still running must keep it."""
    stuck, stopped = _training(), _download("00001")
    for kind, name in (("training", stuck), ("processing", stopped)):
        sagemaker.add_job(kind, name)
    _claim(store, stuck, "training")
    _claim(store, stopped, "download")
    sagemaker.fail_next(
        "StopTrainingJob", stuck, client_error("ThrottlingException", "Rate exceeded", "StopTrainingJob")
    )

    report = _clean(sagemaker, store)

    assert store.get(stuck) is not None
    assert store.get(stopped) is None
    assert report.claims_deleted == 1


def test_clean_up_run_twice_second_time_nothing_is_left(sagemaker: FakeSageMakerClient, store: TokenStore) -> None:
    sagemaker.add_job("training", _training())
    _claim(store, _training(), "training")

    _clean(sagemaker, store)
    sagemaker.jobs["training"][_training()] = "Stopped"
    again = _clean(sagemaker, store)

    assert again.stopped == {}
    assert again.errors == []
    assert again.claims_deleted == 0
    assert again.lines() == [NOTHING_RUNNING]


def test_clean_up_run_claims_unreadable_says_nothing_was_checked_and_how_to_look(
    sagemaker: FakeSageMakerClient, store: TokenStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    _claimed_job(sagemaker, store, _training())

    def throttled(*args: Any, **kwargs: Any) -> Any:
        raise client_error("ProvisionedThroughputExceededException", "Rate exceeded", "Scan")

    monkeypatch.setattr(store, "for_execution", throttled)

    lines = _clean(sagemaker, store).lines()

    # Nothing was looked at: the message must not say none was running.
    [line] = lines
    assert line.startswith("NOT cleaned up: could not read the run's task-token claims")
    assert f"aws sagemaker list-processing-jobs --name-contains {RUN_HASH} --status-equals InProgress" in line
    assert sagemaker.jobs["training"][_training()] == "InProgress"


# ---------------------------------------------------------------------------- warm pools


def test_clean_up_run_training_job_with_a_warm_pool_stopped_then_its_warm_pool_ended(
    sagemaker: FakeSageMakerClient, store: TokenStore
) -> None:
    """Issue 32 item 3: a training job started with KeepAlivePeriodInSeconds keeps its instances
    (billed) after it is stopped (SageMaker developer guide, "Warm pool creation": a warm pool is
    retained when the job is stopped after the cluster started). The cleanup sets the retention
    to 0 (UpdateTrainingJob), which ends it."""
    _claimed_job(sagemaker, store, _training())
    sagemaker.warm_pools[_training()] = [1800, None]

    report = _clean(sagemaker, store)

    assert sagemaker.called("UpdateTrainingJob") == [
        {"TrainingJobName": _training(), "ResourceConfig": {"KeepAlivePeriodInSeconds": 0}}
    ]
    assert report.warm_pools_ended == [_training()]
    assert f"Ended the warm pool of training job {_training()} (KeepAlivePeriodInSeconds 0)." in report.lines()


def test_clean_up_run_completed_training_job_named_by_the_run_has_its_available_warm_pool_ended(
    sagemaker: FakeSageMakerClient, store: TokenStore
) -> None:
    """The run failed after training (at evaluation): the training job's claim went when it
    completed, so the run's state names it (notify passes it), and its warm pool is ended."""
    sagemaker.add_job("training", _training(), status="Completed")
    sagemaker.warm_pools[_training()] = [3600, "Available"]

    report = _clean(sagemaker, store, training_jobs=[_training()])

    assert sagemaker.warm_pools[_training()] == [0, "Terminated"]
    assert report.warm_pools_ended == [_training()]
    assert report.errors == []


@pytest.mark.parametrize("warm_pool", [None, [1800, "Reused"], [1800, "Terminated"], [0, None]])
def test_clean_up_run_training_job_without_a_live_warm_pool_is_not_updated(
    sagemaker: FakeSageMakerClient, store: TokenStore, warm_pool: list[Any] | None
) -> None:
    """No warm pool asked for, one another job reused (it is that job's now) or one already over:
    nothing to end."""
    sagemaker.add_job("training", _training(), status="Completed")
    if warm_pool is not None:
        sagemaker.warm_pools[_training()] = warm_pool

    report = _clean(sagemaker, store, training_jobs=[_training()])

    assert sagemaker.called("UpdateTrainingJob") == []
    assert report.warm_pools_ended == []


def test_clean_up_run_warm_pool_update_refused_is_reported_with_the_command(
    sagemaker: FakeSageMakerClient, store: TokenStore
) -> None:
    sagemaker.add_job("training", _training(), status="Completed")
    sagemaker.warm_pools[_training()] = [3600, "Available"]
    sagemaker.fail_next(
        "UpdateTrainingJob", _training(), client_error("ThrottlingException", "Rate exceeded", "UpdateTrainingJob")
    )

    report = _clean(sagemaker, store, training_jobs=[_training()])

    [error] = report.errors
    assert "Rate exceeded" in error
    assert (
        f"aws sagemaker update-training-job --training-job-name {_training()} "
        "--resource-config KeepAlivePeriodInSeconds=0" in error
    )


# ---------------------------------------------------------------------------- claims and endpoints


def test_clean_up_run_claims_of_the_run_are_deleted_and_other_runs_kept(
    sagemaker: FakeSageMakerClient, store: TokenStore
) -> None:
    _claim(store, _download("00001"), "download")
    _claim(store, _training(), "training")
    other = names.training_job_name(names.run_hash(OTHER_ARN, START_MS), "dogs-v2-xyz", 0, 0)
    _claim(store, other, "training", arn=OTHER_ARN)

    report = _clean(sagemaker, store)

    assert report.claims_deleted == 2
    assert store.get(_download("00001")) is None
    assert store.get(_training()) is None
    assert store.get(other) is not None


def test_clean_up_run_endpoint_the_run_created_is_deleted(sagemaker: FakeSageMakerClient, store: TokenStore) -> None:
    sagemaker.add_endpoint(ENDPOINT, "InService", OURS)
    _claim(store, ENDPOINT, "endpoint", {"endpoint_config_name": OURS, "action": "create"})

    report = _clean(sagemaker, store)

    assert ENDPOINT not in sagemaker.endpoints
    assert f"endpoint {ENDPOINT} deleted (this run had created it)" in report.lines()
    assert store.get(ENDPOINT) is None


def test_clean_up_run_endpoint_still_creating_is_marked_for_rollback_and_claim_kept(
    sagemaker: FakeSageMakerClient, store: TokenStore
) -> None:
    sagemaker.add_endpoint(ENDPOINT, "Creating", OURS)
    _claim(store, ENDPOINT, "endpoint", {"endpoint_config_name": OURS, "action": "create"})

    report = _clean(sagemaker, store)

    assert sagemaker.called("DeleteEndpoint") == []
    held = store.get(ENDPOINT)
    assert held is not None
    assert rollback.is_requested(held)
    assert f"endpoint {ENDPOINT} is Creating; it will be deleted when it settles" in report.lines()
    assert report.errors == []


def test_clean_up_run_endpoint_the_run_updated_goes_back_to_its_previous_config(
    sagemaker: FakeSageMakerClient, store: TokenStore
) -> None:
    sagemaker.add_endpoint(ENDPOINT, "InService", OURS)
    context = {"endpoint_config_name": OURS, "action": "update", rollback.PREVIOUS_CONFIG_KEY: "sdflow-cats-old"}
    _claim(store, ENDPOINT, "endpoint", context)

    report = _clean(sagemaker, store)

    assert sagemaker.called("UpdateEndpoint") == [{"EndpointName": ENDPOINT, "EndpointConfigName": "sdflow-cats-old"}]
    assert f"endpoint {ENDPOINT} rolled back to config sdflow-cats-old" in report.lines()
    assert store.get(ENDPOINT) is None


def test_clean_up_run_update_sagemaker_already_rolled_back_leaves_the_endpoint_alone(
    sagemaker: FakeSageMakerClient, store: TokenStore
) -> None:
    sagemaker.add_endpoint(ENDPOINT, "InService", "sdflow-cats-old")
    context = {"endpoint_config_name": OURS, "action": "update", rollback.PREVIOUS_CONFIG_KEY: "sdflow-cats-old"}
    _claim(store, ENDPOINT, "endpoint", context)

    report = _clean(sagemaker, store)

    assert sagemaker.called("UpdateEndpoint") == []
    assert sagemaker.called("DeleteEndpoint") == []
    assert report.lines() == [NOTHING_RUNNING]
    assert store.get(ENDPOINT) is None


def test_clean_up_run_update_without_previous_config_is_reported_for_a_person(
    sagemaker: FakeSageMakerClient, store: TokenStore
) -> None:
    sagemaker.add_endpoint(ENDPOINT, "InService", OURS)
    _claim(store, ENDPOINT, "endpoint", {"endpoint_config_name": OURS, "action": "update"})

    report = _clean(sagemaker, store)

    assert sagemaker.called("UpdateEndpoint") == []
    [error] = report.errors
    assert "previous config is unknown" in error
    assert f"update-endpoint --endpoint-name {ENDPOINT}" in error


def test_clean_up_run_endpoint_of_another_deployment_is_not_touched(
    sagemaker: FakeSageMakerClient, store: TokenStore
) -> None:
    sagemaker.add_endpoint(ENDPOINT, "InService", "someone-elses-config")
    _claim(store, ENDPOINT, "endpoint", {"endpoint_config_name": OURS, "action": "create"})

    report = _clean(sagemaker, store)

    assert ENDPOINT in sagemaker.endpoints
    assert report.lines() == [NOTHING_RUNNING]


# ---------------------------------------------------------------------------- job_events finishes a deferred rollback


def _endpoint_event(status: str = "IN_SERVICE") -> EndpointDetail:
    return EndpointDetail.model_validate({"EndpointName": ENDPOINT, "EndpointStatus": status})


def test_job_events_requested_rollback_endpoint_settles_it_is_deleted_without_answering_the_task(
    sagemaker: FakeSageMakerClient, store: TokenStore
) -> None:
    sagemaker.add_endpoint(ENDPOINT, "Creating", OURS)
    _claim(store, ENDPOINT, "endpoint", {"endpoint_config_name": OURS, "action": "create"})
    _clean(sagemaker, store)
    sagemaker.endpoints[ENDPOINT]["EndpointStatus"] = "InService"
    sfn = FakeStepFunctions("FAILED")

    resolution = TaskResolver(store, sfn, sagemaker).resolve(_endpoint_event())

    assert resolution.outcome == "rolled_back"
    assert ENDPOINT not in sagemaker.endpoints
    assert sfn.sent == []
    assert store.get(ENDPOINT) is None


def test_job_events_stale_token_of_a_failed_run_rolls_the_update_back(
    sagemaker: FakeSageMakerClient, store: TokenStore
) -> None:
    sagemaker.add_endpoint(ENDPOINT, "InService", OURS)
    context = {"endpoint_config_name": OURS, "action": "update", rollback.PREVIOUS_CONFIG_KEY: "sdflow-cats-old"}
    _claim(store, ENDPOINT, "endpoint", context)

    resolution = TaskResolver(store, FakeStepFunctions("TIMED_OUT"), sagemaker).resolve(_endpoint_event())

    assert resolution.outcome == "rolled_back"
    assert sagemaker.called("UpdateEndpoint") == [{"EndpointName": ENDPOINT, "EndpointConfigName": "sdflow-cats-old"}]
    assert store.get(ENDPOINT) is None


def test_job_events_stale_token_of_a_run_still_running_leaves_the_endpoint(
    sagemaker: FakeSageMakerClient, store: TokenStore
) -> None:
    sagemaker.add_endpoint(ENDPOINT, "InService", OURS)
    _claim(store, ENDPOINT, "endpoint", {"endpoint_config_name": OURS, "action": "create"})

    resolution = TaskResolver(store, FakeStepFunctions("RUNNING"), sagemaker).resolve(_endpoint_event())

    assert resolution.outcome == "stale_token"
    assert ENDPOINT in sagemaker.endpoints
    assert store.get(ENDPOINT) is None


def test_job_events_requested_rollback_endpoint_still_updating_waits_for_the_next_event(
    sagemaker: FakeSageMakerClient, store: TokenStore
) -> None:
    sagemaker.add_endpoint(ENDPOINT, "Updating", "sdflow-cats-old", pending=OURS)
    context = {"endpoint_config_name": OURS, "action": "update", rollback.PREVIOUS_CONFIG_KEY: "sdflow-cats-old"}
    _claim(store, ENDPOINT, "endpoint", context)
    _clean(sagemaker, store)

    # A late IN_SERVICE event from before the update: the endpoint is still Updating.
    resolution = TaskResolver(store, FakeStepFunctions("FAILED"), sagemaker).resolve(_endpoint_event())

    assert resolution.outcome == "ignored"
    held = store.get(ENDPOINT)
    assert held is not None
    assert rollback.is_requested(held)
    assert sagemaker.called("UpdateEndpoint") == []

    sagemaker.add_endpoint(ENDPOINT, "InService", OURS)
    settled = TaskResolver(store, FakeStepFunctions("FAILED"), sagemaker).resolve(_endpoint_event())

    assert settled.outcome == "rolled_back"
    assert sagemaker.called("UpdateEndpoint") == [{"EndpointName": ENDPOINT, "EndpointConfigName": "sdflow-cats-old"}]
