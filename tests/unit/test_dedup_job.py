"""Find duplicates: the deduplication block, the dedup job's name and CreateProcessingJob request (contract §3),
and its starter, claimed, adopted and stopped like the evaluation's (issue 33)."""

from __future__ import annotations

import copy
from typing import Any

# The X-Ray SDK opens its UDP emitter's socket on first import (Tracer() triggers it); import it
# here, at collection, before the unit fixtures block sockets.
import aws_xray_sdk.core  # noqa: F401
import pytest
from botocore.exceptions import ClientError

from sdflow_common import dedup_job, names, notify, sagemaker_jobs
from sdflow_common.dedup_job import DedupTask, dedup_job_request
from sdflow_common.errors import DedupJobFailed, InvalidRunDocument, RunEnded
from sdflow_common.run_document import RunDocument, parse_run_document, problems_of
from sdflow_common.token_store import TokenStore
from tests.helpers import load_function_module
from tests.unit.helpers import (
    DATA_BUCKET,
    SAGEMAKER_ROLE_ARN,
    TRAINING_IMAGE_URI,
    AwsWorld,
    FakeLambdaContext,
    load_event,
)
from tests.unit.job_requests import (
    assert_valid_request,
    processing_job_names,
    processing_status,
    redrive_of,
    retry_of,
    run_hash,
    sagemaker_client,
    tags_of,
)

DOCUMENT = {"dataset": {"prefix": f"s3://{DATA_BUCKET}/datasets/cats/"}, "base_model_uri": f"s3://{DATA_BUCKET}/m/"}


@pytest.fixture(autouse=True)
def running_execution(events_execution: str) -> str:
    return events_execution


def task_event(**block: Any) -> dict[str, Any]:
    event = copy.deepcopy(load_event("find_duplicates_task.json"))
    event["config"]["run"]["deduplication"] |= block
    return event


def dedup_name(event: dict[str, Any], redrive: int = 0, attempt: int = 0) -> str:
    return names.dedup_job_name(run_hash(event), event["config"]["run_id"], redrive, attempt)


def start(event: dict[str, Any], context: FakeLambdaContext) -> Any:
    return load_function_module("find_duplicates").lambda_handler(event, context)


def flag(arguments: list[str], name: str) -> str:
    return arguments[arguments.index(name) + 1]


# ---------------------------------------------------------------------------- the block and the name


def test_deduplication_block_defaults_are_the_contracts() -> None:
    options = RunDocument.model_validate(DOCUMENT).deduplication

    assert options.model_dump() == {
        "enabled": True,
        "instance_type": "ml.m5.2xlarge",
        "volume_size_gb": 50,
        "processes": 8,
        "max_runtime_seconds": 3600,
    }


@pytest.mark.parametrize(
    ("block", "field"),
    [
        ({"instance_type": "m5.2xlarge"}, "deduplication.instance_type"),
        ({"volume_size_gb": 0}, "deduplication.volume_size_gb"),
        ({"volume_size_gb": 16385}, "deduplication.volume_size_gb"),
        ({"processes": 0}, "deduplication.processes"),
        ({"max_runtime_seconds": 59}, "deduplication.max_runtime_seconds"),
        ({"partitions": 64}, "deduplication.partitions"),
    ],
)
def test_deduplication_block_bad_value_is_refused_naming_the_field(block: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRunDocument) as caught:
        parse_run_document(DOCUMENT | {"deduplication": block})

    assert field in {problem["field"] for problem in problems_of(caught.value)}


def test_deduplication_task_timeout_covers_the_jobs_runtime() -> None:
    run = RunDocument.model_validate(DOCUMENT | {"deduplication": {"max_runtime_seconds": 7200}})

    assert sagemaker_jobs.task_timeouts(run)["dedup"] == 7200 + sagemaker_jobs.DEDUP_TASK_MARGIN_SECONDS


def test_dedup_job_name_fits_with_the_widest_counters_and_keeps_its_task_key() -> None:
    long_run_id = "a-very-long-run-name-that-goes-on-and-on-" + "x" * 38
    hash_ = names.run_hash(f"arn:aws:states:us-east-1:123456789012:execution:p:{long_run_id}", 1795452483123)
    first, widest = names.dedup_job_name(hash_, long_run_id, 0, 0), names.dedup_job_name(hash_, long_run_id, 1000, 1000)

    for name in (first, widest):
        assert name.startswith(f"{names.DEDUP_PREFIX}-")
        assert len(name) <= names.MAX_NAME_LENGTH, name
        assert names.NAME_PATTERN.match(name), name
        assert f"-{hash_}-" in name
    assert names.task_key(first) == names.task_key(widest)
    assert names.task_key(first) != names.task_key(names.evaluation_job_name(hash_, long_run_id, 0, 0))


# ---------------------------------------------------------------------------- the request


def test_dedup_request_arguments_resources_and_tags_are_the_contracts() -> None:
    event = task_event(instance_type="ml.m5.4xlarge", volume_size_gb=120, processes=16, max_runtime_seconds=5400)
    task = DedupTask.model_validate(event)
    config = task.config

    made = dedup_job_request(
        job_name="sdf-dd-x-r0-a0",
        config=config,
        run_hash="abc",
        image_uri=TRAINING_IMAGE_URI,
        role_arn=SAGEMAKER_ROLE_ARN,
    )

    assert_valid_request("CreateProcessingJob", made)
    app = made["AppSpecification"]
    assert (app["ImageUri"], app["ContainerEntrypoint"]) == (TRAINING_IMAGE_URI, ["dedup"])
    arguments = app["ContainerArguments"]
    assert flag(arguments, "--shards_manifest") == f"s3://{config.bucket}/{config.shard_list_key}"
    assert flag(arguments, "--shards_manifest").endswith(f"runs/{config.run_id}/shards.json")
    assert flag(arguments, "--output_uri") == f"s3://{config.bucket}/runs/{config.run_id}/dataset/dedup/"
    assert flag(arguments, "--processes") == "16"
    assert flag(arguments, "--partitions") == "64"
    assert made["ProcessingResources"]["ClusterConfig"] == {
        "InstanceCount": 1,
        "InstanceType": "ml.m5.4xlarge",
        "VolumeSizeInGB": 120,
    }
    assert made["StoppingCondition"] == {"MaxRuntimeInSeconds": 5400}
    # It reads shards.json and the hash files and writes its outputs through S3 itself.
    assert "ProcessingInputs" not in made
    assert "ProcessingOutputConfig" not in made
    assert made["NetworkConfig"] == {"EnableNetworkIsolation": False}
    assert {tag["Key"]: tag["Value"] for tag in made["Tags"]} == {
        "sdflow:execution": config.run_id,
        "sdflow:run": "abc",
        "sdflow:step": "dedup",
    }


def test_dedup_request_document_fields_point_at_the_values_they_name() -> None:
    config = DedupTask.model_validate(task_event(processes=13)).config
    made = dedup_job_request(job_name="sdf-dd-x-r0-a0", config=config, run_hash="abc", image_uri="i", role_arn="r")
    fields = dict(dedup_job.DOCUMENT_FIELDS)

    # AWS numbers ContainerArguments' members from 1.
    [argument_path] = [path for path in fields if path.startswith("appSpecification.containerArguments.")]
    position = int(argument_path.split(".")[2])
    assert made["AppSpecification"]["ContainerArguments"][position - 1] == "13"
    assert fields[argument_path] == "deduplication.processes"


# ---------------------------------------------------------------------------- the starter


def test_find_duplicates_creates_the_named_job_and_claims_its_token(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    event = task_event()

    result = start(event, context)

    expected = dedup_name(event)
    assert result == {"resource_name": expected, "created": True}
    assert processing_job_names(mocked_aws) == [expected]
    job = mocked_aws.sagemaker.describe_processing_job(ProcessingJobName=expected)
    assert job["AppSpecification"]["ImageUri"] == TRAINING_IMAGE_URI
    assert job["RoleArn"] == SAGEMAKER_ROLE_ARN
    assert tags_of(mocked_aws, job["ProcessingJobArn"])["sdflow:run"] == run_hash(event)
    record = store.get(expected)
    assert record is not None
    assert (record.kind, record.task_token) == ("dedup", event["token"])
    run_id = event["config"]["run_id"]
    assert record.context["summary_uri"] == f"s3://{DATA_BUCKET}/runs/{run_id}/dataset/dedup/summary.json"
    assert record.deadline - record.created_at == event["timeout_seconds"]


def test_find_duplicates_reinvoked_same_attempt_creates_one_job(
    mocked_aws: AwsWorld, context: FakeLambdaContext
) -> None:
    event = task_event()
    start(event, context)

    again = start(event, context)

    assert again == {"resource_name": dedup_name(event), "created": False}
    assert processing_job_names(mocked_aws) == [dedup_name(event)]


def test_find_duplicates_retry_adopts_the_job_its_dead_starter_left_running(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    event = task_event()
    start(event, context)
    processing_status(dedup_name(event), "InProgress")
    retry = retry_of(event, 1)

    result = start(retry, context)

    assert result == {"resource_name": dedup_name(event), "created": False, "adopted": True}
    assert processing_job_names(mocked_aws, "sdf-dd-") == [dedup_name(event)]
    record = store.get(dedup_name(event))
    assert record is not None
    assert record.task_token == retry["token"]


def test_find_duplicates_redrive_adopts_the_job_the_ended_run_left_running(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    event = task_event()
    start(event, context)
    processing_status(dedup_name(event), "InProgress")
    redrive = redrive_of(event, 1)

    result = start(redrive, context)

    assert result == {"resource_name": dedup_name(event), "created": False, "adopted": True}
    assert processing_job_names(mocked_aws, "sdf-dd-") == [dedup_name(event)], "exactly one dedup job"
    assert store.get(dedup_name(event, redrive=1)) is None


def test_find_duplicates_run_stopped_during_create_stops_the_job(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, running_execution: str
) -> None:
    mocked_aws.sfn.stop_execution(executionArn=running_execution)
    event = task_event()

    with pytest.raises(RunEnded, match=r"ABORTED.*the job was stopped"):
        start(event, context)

    job = mocked_aws.sagemaker.describe_processing_job(ProcessingJobName=dedup_name(event))
    assert job["ProcessingJobStatus"] == "Stopped"
    assert store.get(dedup_name(event)) is None


def test_find_duplicates_refused_request_raises_dedup_job_failed_and_releases_the_claim(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(**_kwargs: Any) -> None:
        raise ClientError({"Error": {"Code": "ValidationException", "Message": "bad image"}}, "CreateProcessingJob")

    monkeypatch.setattr(sagemaker_client(), "create_processing_job", refuse)
    event = task_event()

    with pytest.raises(DedupJobFailed, match="SageMaker refused CreateProcessingJob"):
        start(event, context)

    assert store.get(dedup_name(event)) is None


def test_failed_step_after_find_duplicates_is_build_dataset_index() -> None:
    """The notification's fallback when the history names no state: $.dedup written, no $.dataset yet."""
    config = load_event("find_duplicates_task.json")["config"]
    dedup = {"job_name": "sdf-dd-x-r0-a0", "summary_uri": "s3://b/runs/x/dataset/dedup/summary.json"}

    assert notify.failed_step({"config": config, "dedup": dedup}) == "Build dataset index"
    assert notify.failed_step({"config": config}) == "Download shards / Build dataset index"
