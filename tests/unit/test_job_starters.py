"""start_download / start_training: claim first, one job per attempt (deploy_endpoint: test_deploy_endpoint.py)."""

from __future__ import annotations

import copy
from typing import Any

# The X-Ray SDK opens its UDP emitter's socket on first import (Tracer() triggers it); import it
# here, at collection, before the unit fixtures block sockets.
import aws_xray_sdk.core  # noqa: F401
import pytest
from botocore.exceptions import ClientError, ReadTimeoutError
from moto.sagemaker.models import sagemaker_backends
from pydantic import ValidationError

from sdflow_common import aws, sagemaker_jobs
from sdflow_common.errors import (
    DownloadJobFailed,
    JobNameTaken,
    RunEnded,
    SageMakerQuotaExceeded,
    SageMakerThrottled,
    TrainingJobFailed,
)
from sdflow_common.run_document import DownloadOptions
from sdflow_common.token_store import TokenStore
from tests.constants import ACCOUNT, REGION
from tests.helpers import load_function_module
from tests.unit.helpers import (
    EVENTS_PIPELINE,
    EVENTS_RUN_NAME,
    SAGEMAKER_ROLE_ARN,
    TRAINING_IMAGE_URI,
    AwsWorld,
    FakeLambdaContext,
    load_event,
)
from tests.unit.job_requests import (
    download_name,
    over_quota,
    processing_job_names,
    processing_status,
    retry_of,
    run_hash,
    sagemaker_client,
    tags_of,
    throttle,
    training_name,
)

PIPELINE = EVENTS_PIPELINE
RUN_NAME = EVENTS_RUN_NAME


@pytest.fixture(autouse=True)
def running_execution(events_execution: str) -> str:
    return events_execution


# ---------------------------------------------------------------------------- download


def test_start_download_creates_named_job_and_claims_token(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    event = load_event("start_download_task.json")
    result = load_function_module("start_download").lambda_handler(event, context)
    expected = download_name(event)
    assert run_hash(event) in expected
    assert result == {"resource_name": expected, "created": True}
    assert processing_job_names(mocked_aws) == [expected]
    job = mocked_aws.sagemaker.describe_processing_job(ProcessingJobName=expected)
    assert job["AppSpecification"]["ContainerEntrypoint"] == ["download"]
    # the container writes the shard to its output_uri itself (no ProcessingOutput)
    arguments = job["AppSpecification"]["ContainerArguments"]
    assert arguments[arguments.index("--output_uri") + 1] == event["shard"]["output_uri"]
    assert arguments[arguments.index("--holdout_rate") + 1] == "0.05"  # the run's $.config.holdout_rate
    assert "ProcessingOutputConfig" not in job
    assert tags_of(mocked_aws, job["ProcessingJobArn"]) == {
        "sdflow:execution": event["run_id"],
        "sdflow:run": run_hash(event),
        "sdflow:shard": "00001",
    }
    record = store.get(expected)
    assert record is not None
    assert record.task_token == event["token"]
    assert record.kind == "download"
    assert record.context["shard_id"] == "00001"
    assert record.deadline - record.created_at == event["timeout_seconds"]


def test_start_download_task_without_holdout_rate_passes_zero(mocked_aws: AwsWorld, context: FakeLambdaContext) -> None:
    """A task from a state machine deployed before the held-out split: no split."""
    event = load_event("start_download_task.json")
    del event["holdout_rate"]
    load_function_module("start_download").lambda_handler(event, context)
    job = mocked_aws.sagemaker.describe_processing_job(ProcessingJobName=download_name(event))
    arguments = job["AppSpecification"]["ContainerArguments"]
    assert arguments[arguments.index("--holdout_rate") + 1] == "0.0"


def test_start_download_reinvoked_same_attempt_creates_one_job(
    mocked_aws: AwsWorld, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler = load_function_module("start_download").lambda_handler
    event = load_event("start_download_task.json")
    handler(event, context)
    calls: list[str] = []
    original = sagemaker_client().create_processing_job
    monkeypatch.setattr(
        sagemaker_client(),
        "create_processing_job",
        lambda **kw: calls.append(kw["ProcessingJobName"]) or original(**kw),
    )
    second = handler(copy.deepcopy(event), context)
    assert second["created"] is False
    assert calls == []
    assert len(processing_job_names(mocked_aws)) == 1


def test_start_download_retry_after_failed_attempt_creates_distinct_job(
    mocked_aws: AwsWorld, context: FakeLambdaContext
) -> None:
    handler = load_function_module("start_download").lambda_handler
    first = load_event("start_download_task.json")
    name_0 = handler(first, context)["resource_name"]
    processing_status(name_0, "Failed")
    name_1 = handler(retry_of(first, 1), context)["resource_name"]
    assert name_0 != name_1
    assert name_1.endswith("-r0-a1")
    assert processing_job_names(mocked_aws) == sorted([name_0, name_1])


def test_start_download_redrive_counts_of_parent_and_child_are_summed(
    mocked_aws: AwsWorld, context: FakeLambdaContext
) -> None:
    event = {**load_event("start_download_task.json"), "redrive_count": 1, "child_redrive_count": 2}
    result = load_function_module("start_download").lambda_handler(event, context)
    assert result["resource_name"] == download_name(event, redrive=3)


def test_start_download_starter_died_after_create_retry_adopts_the_running_job(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    handler = load_function_module("start_download").lambda_handler
    first = load_event("start_download_task.json")
    # Attempt 0 created its job, then its Lambda died (Runtime.ExitError): the state retries.
    handler(first, context)
    processing_status(download_name(first), "InProgress")
    retry = retry_of(first, 1)
    result = handler(retry, context)
    assert result == {"resource_name": download_name(first), "created": False, "adopted": True}
    assert processing_job_names(mocked_aws) == [download_name(first)], "exactly one job for the task"
    record = store.get(download_name(first))
    assert record is not None
    assert record.task_token == retry["token"], "the job's event must answer the live attempt"
    assert store.get(download_name(first, attempt=1)) is None


def test_start_download_two_earlier_attempts_running_adopts_newest_stops_the_other(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    handler = load_function_module("start_download").lambda_handler
    first = load_event("start_download_task.json")
    handler(first, context)
    processing_status(download_name(first), "InProgress")
    # A job of attempt 1 that some earlier bug left beside attempt 0's, claimed by nobody.
    mocked_aws.sagemaker.create_processing_job(**stray_request(first, attempt=1))
    processing_status(download_name(first, attempt=1), "InProgress")
    result = handler(retry_of(first, 2), context)
    assert result["resource_name"] == download_name(first, attempt=1)
    assert sagemaker_backends[ACCOUNT][REGION].processing_jobs[download_name(first)].processing_job_status == "Stopped"
    assert len(processing_job_names(mocked_aws)) == 2, "no third job"


def test_start_download_retry_cannot_describe_earlier_attempt_raises_throttled_without_a_job(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sagemaker_client(), "describe_processing_job", throttle)
    event = retry_of(load_event("start_download_task.json"), 1)
    with pytest.raises(SageMakerThrottled, match="DescribeProcessingJob"):
        load_function_module("start_download").lambda_handler(event, context)
    assert processing_job_names(mocked_aws) == [], "no second job while the first may still run"
    assert store.get(download_name(event, attempt=1)) is None


def test_start_download_retry_finds_earlier_attempts_by_name_without_listing_jobs(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 23 item 8: SageMaker's List* calls grow with every job the account ran and are throttled
    at low rates; a retry reads the earlier attempts' claims in one BatchGetItem and describes only
    the claimed names and the previous attempt's. Here attempt 1 adopted attempt 0's job and died,
    attempts 2 to 4 were refused by the quota: attempt 5 still finds the job under its own name."""
    handler = load_function_module("start_download").lambda_handler
    first = load_event("start_download_task.json")
    handler(first, context)
    processing_status(download_name(first), "InProgress")
    handler(retry_of(first, 1), context)  # adopts attempt 0's job: the claim moves to attempt 1
    calls: list[str] = []
    sagemaker_client().meta.events.register("before-call.sagemaker.*", lambda model, **_kw: calls.append(model.name))
    monkeypatch.setattr(sagemaker_client(), "list_processing_jobs", throttle)

    result = handler(retry_of(first, 5), context)

    assert result == {"resource_name": download_name(first), "created": False, "adopted": True}
    assert sorted(calls) == ["DescribeProcessingJob", "DescribeProcessingJob"], "the claimed a0 and the previous a4"
    assert processing_job_names(mocked_aws) == [download_name(first)]


def stray_request(event: dict[str, Any], attempt: int, run: str | None = None) -> dict[str, Any]:
    return sagemaker_jobs.processing_job_request(
        job_name=download_name(event, attempt=attempt),
        run_id=event["run_id"],
        run_hash=run or run_hash(event),
        shard_id=event["shard"]["shard_id"],
        parquet_uri=event["shard"]["parquet_uri"],
        output_uri=event["shard"]["output_uri"],
        options=DownloadOptions(),
        url_column="URL",
        caption_column="TEXT",
        image_uri=TRAINING_IMAGE_URI,
        role_arn=SAGEMAKER_ROLE_ARN,
    )


@pytest.fixture
def unique_job_names(mocked_aws: AwsWorld, monkeypatch: pytest.MonkeyPatch) -> None:
    """SageMaker refuses a second job of one name; moto 5.2.5 replaces the first. The refusal as
    SageMaker words it (for training jobs: "Training job names must be unique within an AWS
    account and region, and a training job with this name already exists (<arn>)")."""
    original = sagemaker_client().create_processing_job

    def create(**request: Any) -> Any:
        existing = sagemaker_backends[ACCOUNT][REGION].processing_jobs.get(request["ProcessingJobName"])
        if existing is not None:
            message = (
                "Processing job names must be unique within an AWS account and region, and a processing job "
                f"with this name already exists ({existing.arn})"
            )
            raise ClientError({"Error": {"Code": "ResourceInUse", "Message": message}}, "CreateProcessingJob")
        return original(**request)

    monkeypatch.setattr(sagemaker_client(), "create_processing_job", create)


@pytest.mark.usefixtures("unique_job_names")
def test_start_download_existing_job_of_this_run_is_adopted_for_a_new_claim(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    event = load_event("start_download_task.json")
    # The job exists, its claim is gone (resolved, or expired): the name is this run's all the same.
    mocked_aws.sagemaker.create_processing_job(**stray_request(event, attempt=0))
    result = load_function_module("start_download").lambda_handler(event, context)
    assert result == {"resource_name": download_name(event), "created": False}
    assert store.get(download_name(event)).task_token == event["token"]  # type: ignore[union-attr]


@pytest.mark.usefixtures("unique_job_names")
def test_start_download_existing_job_of_another_run_raises_job_name_taken(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    event = load_event("start_download_task.json")
    mocked_aws.sagemaker.create_processing_job(**stray_request(event, attempt=0, run="0123456789"))
    with pytest.raises(JobNameTaken, match=r"belongs to run 0123456789.*new execution name"):
        load_function_module("start_download").lambda_handler(event, context)
    assert store.get(download_name(event)) is None, "another run's job must not answer this task"


def test_start_download_run_stopped_during_create_stops_the_job(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, running_execution: str
) -> None:
    # StopExecution landed while the starter ran: the run-ended cleanup may have listed the run's
    # jobs before this one existed, so the starter must stop it itself.
    mocked_aws.sfn.stop_execution(executionArn=running_execution)
    event = load_event("start_download_task.json")
    with pytest.raises(RunEnded, match=r"ABORTED.*the job was stopped"):
        load_function_module("start_download").lambda_handler(event, context)
    job = mocked_aws.sagemaker.describe_processing_job(ProcessingJobName=download_name(event))
    assert job["ProcessingJobStatus"] == "Stopped"
    assert store.get(download_name(event)) is None


def test_start_download_run_status_throttled_keeps_the_job_for_the_retry_to_adopt(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler = load_function_module("start_download").lambda_handler
    sfn = aws.client("stepfunctions")
    real = sfn.describe_execution
    monkeypatch.setattr(sfn, "describe_execution", throttle)
    event = load_event("start_download_task.json")
    with pytest.raises(SageMakerThrottled, match="the retry adopts the job"):
        handler(event, context)
    processing_status(download_name(event), "InProgress")
    monkeypatch.setattr(sfn, "describe_execution", real)
    assert handler(retry_of(event, 1), context)["adopted"] is True
    assert processing_job_names(mocked_aws) == [download_name(event)]


def test_start_download_run_status_unreadable_stops_the_job_and_fails_the_step(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    def denied(**_kwargs: Any) -> None:
        raise ClientError({"Error": {"Code": "AccessDeniedException", "Message": "no"}}, "DescribeExecution")

    monkeypatch.setattr(aws.client("stepfunctions"), "describe_execution", denied)
    stops: list[str] = []
    monkeypatch.setattr(sagemaker_client(), "stop_processing_job", lambda **kw: stops.append(kw["ProcessingJobName"]))
    event = load_event("start_download_task.json")
    with pytest.raises(DownloadJobFailed, match="AccessDeniedException"):
        load_function_module("start_download").lambda_handler(event, context)
    assert stops == [download_name(event)]
    assert store.get(download_name(event)) is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("start_time", "last tuesday", "start_time"),
        ("timeout_seconds", 0, "timeout_seconds"),
        ("holdout_rate", 1.5, "holdout_rate"),
    ],
)
def test_start_download_bad_payload_field_is_named(
    mocked_aws: AwsWorld, context: FakeLambdaContext, field: str, value: Any, message: str
) -> None:
    event = {**load_event("start_download_task.json"), field: value}
    with pytest.raises(ValidationError, match=message):
        load_function_module("start_download").lambda_handler(event, context)


def test_start_download_payload_without_start_time_is_refused(mocked_aws: AwsWorld, context: FakeLambdaContext) -> None:
    event = load_event("start_download_task.json")
    del event["start_time"]
    with pytest.raises(ValidationError, match="start_time"):
        load_function_module("start_download").lambda_handler(event, context)


def test_start_download_throttled_raises_and_releases_claim(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sagemaker_client(), "create_processing_job", throttle)
    event = load_event("start_download_task.json")
    with pytest.raises(SageMakerThrottled, match="Rate exceeded"):
        load_function_module("start_download").lambda_handler(event, context)
    assert store.get(download_name(event)) is None
    assert processing_job_names(mocked_aws) == []


def test_start_download_create_timed_out_keeps_claim_so_the_job_is_found(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Create whose answer never came (a read timeout) may have created the job: the claim stays,
    so the run's cleanup (driven from the claims) and the next attempt find it by its name."""
    original = sagemaker_client().create_processing_job

    def created_then_timed_out(**request: Any) -> None:
        original(**request)
        raise ReadTimeoutError(endpoint_url="https://api.sagemaker")

    monkeypatch.setattr(sagemaker_client(), "create_processing_job", created_then_timed_out)
    event = load_event("start_download_task.json")
    with pytest.raises(ReadTimeoutError):
        load_function_module("start_download").lambda_handler(event, context)
    record = store.get(download_name(event))
    assert record is not None
    assert record.task_token == event["token"]
    monkeypatch.setattr(sagemaker_client(), "create_processing_job", original)
    processing_status(download_name(event), "InProgress")
    result = load_function_module("start_download").lambda_handler(retry_of(event, 1), context)
    assert result == {"resource_name": download_name(event), "created": False, "adopted": True}
    assert processing_job_names(mocked_aws) == [download_name(event)]


def test_start_download_refused_request_raises_download_job_failed(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(**_kwargs: Any) -> None:
        raise ClientError(
            {"Error": {"Code": "ValidationException", "Message": "Role cannot be assumed"}}, "CreateProcessingJob"
        )

    monkeypatch.setattr(sagemaker_client(), "create_processing_job", refuse)
    event = load_event("start_download_task.json")
    with pytest.raises(DownloadJobFailed, match="Role cannot be assumed"):
        load_function_module("start_download").lambda_handler(event, context)
    assert store.get(download_name(event)) is None


def test_start_download_missing_role_setting_names_variable(
    mocked_aws: AwsWorld, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SAGEMAKER_ROLE_ARN")
    with pytest.raises(RuntimeError, match="SAGEMAKER_ROLE_ARN"):
        load_function_module("start_download").lambda_handler(load_event("start_download_task.json"), context)


# ---------------------------------------------------------------------------- training


def test_start_training_retry_adopts_running_job_of_dead_starter(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    handler = load_function_module("start_training").lambda_handler
    event = load_event("start_training_task.json")
    handler(event, context)
    sagemaker_backends[ACCOUNT][REGION].training_jobs[training_name(event)].training_job_status = "InProgress"
    retry = retry_of(event, 1)
    assert handler(retry, context) == {"resource_name": training_name(event), "created": False, "adopted": True}
    jobs = mocked_aws.sagemaker.list_training_jobs()["TrainingJobSummaries"]
    assert [job["TrainingJobName"] for job in jobs] == [training_name(event)], "one job shares the checkpoints"
    assert store.get(training_name(event)).task_token == retry["token"]  # type: ignore[union-attr]


def test_start_training_creates_job_with_run_options(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    event = load_event("start_training_task.json")
    result = load_function_module("start_training").lambda_handler(event, context)
    expected = training_name(event)
    assert result == {"resource_name": expected, "created": True}
    job = mocked_aws.sagemaker.describe_training_job(TrainingJobName=expected)
    assert job["AlgorithmSpecification"]["TrainingImage"] == TRAINING_IMAGE_URI
    assert job["ResourceConfig"]["InstanceCount"] == event["config"]["run"]["training"]["instance_count"]
    assert job["HyperParameters"]["max_train_steps"] == str(event["config"]["run"]["training"]["max_train_steps"])
    assert job["EnableManagedSpotTraining"] is True
    # Per job: a retry's or a redrive's job never overwrites this one's checkpoints.
    bucket, run_id = event["config"]["bucket"], event["config"]["run_id"]
    assert job["CheckpointConfig"]["S3Uri"] == f"s3://{bucket}/runs/{run_id}/checkpoints/{expected}/"
    assert tags_of(mocked_aws, job["TrainingJobArn"])["sdflow:run"] == run_hash(event)
    record = store.get(expected)
    assert record is not None
    assert record.kind == "training"
    assert record.context["output_path"].endswith(f"runs/{event['config']['run_id']}/training/")


def test_start_training_throttled_raises_and_releases_claim(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sagemaker_client(), "create_training_job", throttle)
    event = load_event("start_training_task.json")
    with pytest.raises(SageMakerThrottled):
        load_function_module("start_training").lambda_handler(event, context)
    assert store.get(training_name(event)) is None


def test_start_training_quota_in_use_raises_quota_exceeded_and_releases_claim(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sagemaker_client(), "create_training_job", over_quota(limit=2, used=2, delta=1))
    event = load_event("start_training_task.json")
    with pytest.raises(SageMakerQuotaExceeded, match="ResourceLimitExceeded") as raised:
        load_function_module("start_training").lambda_handler(event, context)
    assert not isinstance(raised.value, SageMakerThrottled), "a quota gets its own, longer Retry"
    assert store.get(training_name(event)) is None


def test_start_training_request_above_quota_fails_at_once_with_advice(
    mocked_aws: AwsWorld, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sagemaker_client(), "create_training_job", over_quota(limit=0, used=0, delta=1))
    with pytest.raises(TrainingJobFailed, match="request an increase in the Service Quotas console"):
        load_function_module("start_training").lambda_handler(load_event("start_training_task.json"), context)


def test_start_download_quota_in_use_raises_quota_exceeded(
    mocked_aws: AwsWorld, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sagemaker_client(), "create_processing_job", over_quota(limit=4, used=4, delta=1))
    with pytest.raises(SageMakerQuotaExceeded):
        load_function_module("start_download").lambda_handler(load_event("start_download_task.json"), context)


def test_start_training_other_error_raises_training_job_failed(
    mocked_aws: AwsWorld, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(**_kwargs: Any) -> None:
        raise ClientError({"Error": {"Code": "ValidationException", "Message": "bad image"}}, "CreateTrainingJob")

    monkeypatch.setattr(sagemaker_client(), "create_training_job", refuse)
    with pytest.raises(TrainingJobFailed, match="bad image"):
        load_function_module("start_training").lambda_handler(load_event("start_training_task.json"), context)
