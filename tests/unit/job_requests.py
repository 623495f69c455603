"""SageMaker requests in unit tests: botocore's validation, a task event's run hash, its jobs' names
and tags, the job statuses a test sets, its retries and redrives, the refusals."""

from __future__ import annotations

import copy
from typing import Any

import botocore.session
from botocore.exceptions import ClientError
from botocore.validate import validate_parameters
from moto.sagemaker.models import sagemaker_backends

from sdflow_common import aws, names, request_limits
from tests.constants import ACCOUNT, REGION
from tests.unit.helpers import AwsWorld

SAGEMAKER_MODEL = botocore.session.get_session().get_service_model("sagemaker")


def assert_valid_request(operation: str, request: dict[str, Any]) -> None:
    """botocore's own validation (wrong names, types, minimums, enums), then the maximums and
    patterns SageMaker checks on the server, as the local cloud enforces them."""
    shape = SAGEMAKER_MODEL.operation_model(operation).input_shape
    validate_parameters(request, shape)
    assert request_limits.problems(shape, request) == []


def run_hash(event: dict[str, Any]) -> str:
    return names.run_hash(event["execution_arn"], event["start_time"])


def download_name(event: dict[str, Any], attempt: int = 0, redrive: int = 0) -> str:
    return names.download_job_name(run_hash(event), event["run_id"], event["shard"]["shard_id"], redrive, attempt)


def training_name(event: dict[str, Any], redrive: int = 0, attempt: int = 0) -> str:
    return names.training_job_name(run_hash(event), event["config"]["run_id"], redrive, attempt)


def evaluation_name(event: dict[str, Any], redrive: int = 0, attempt: int = 0) -> str:
    return names.evaluation_job_name(run_hash(event), event["config"]["run_id"], redrive, attempt)


def processing_status(name: str, status: str | None = None) -> str:
    """moto completes jobs at once; a test that needs a running job says so."""
    job = sagemaker_backends[ACCOUNT][REGION].processing_jobs[name]
    if status is not None:
        job.processing_job_status = status
    return str(job.processing_job_status)


def training_status(name: str, status: str | None = None) -> str:
    job = sagemaker_backends[ACCOUNT][REGION].training_jobs[name]
    if status is not None:
        job.training_job_status = status
    return str(job.training_job_status)


def retry_of(event: dict[str, Any], attempt: int) -> dict[str, Any]:
    """The same task's next attempt: a new token, `$$.State.RetryCount` up."""
    return {**copy.deepcopy(event), "attempt": attempt, "token": f"{event['token']}-retry-{attempt}"}


def redrive_of(event: dict[str, Any], redrive: int, attempt: int = 0) -> dict[str, Any]:
    """The same task in a later redrive: a new token, `$$.Execution.RedriveCount` up, RetryCount anew."""
    return {
        **copy.deepcopy(event),
        "redrive_count": redrive,
        "attempt": attempt,
        "token": f"{event['token']}-redrive-{redrive}-{attempt}",
    }


def processing_job_names(world: AwsWorld, prefix: str = "") -> list[str]:
    summaries = world.sagemaker.list_processing_jobs()["ProcessingJobSummaries"]
    return sorted(job["ProcessingJobName"] for job in summaries if job["ProcessingJobName"].startswith(prefix))


def tags_of(world: AwsWorld, arn: str) -> dict[str, str]:
    return {tag["Key"]: tag["Value"] for tag in world.sagemaker.list_tags(ResourceArn=arn)["Tags"]}


def sagemaker_client() -> Any:
    """The cached client the functions use, so tests can patch single operations on it."""
    return aws.client("sagemaker")


def throttle(*_args: Any, **_kwargs: Any) -> None:
    raise ClientError({"Error": {"Code": "ThrottlingException", "Message": "Rate exceeded"}}, "Create")


def over_quota(limit: int, used: int, delta: int) -> Any:
    """SageMaker's ResourceLimitExceeded, worded as SageMaker words it."""
    message = (
        f"The account-level service limit 'ml.g5.12xlarge for training job usage' is {limit} Instances, with "
        f"current utilization of {used} Instances and a request delta of {delta} Instances. Please use AWS "
        "Service Quotas to request an increase for this quota."
    )

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise ClientError({"Error": {"Code": "ResourceLimitExceeded", "Message": message}}, "Create")

    return refuse
