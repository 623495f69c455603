"""SageMaker requests in unit tests: botocore's validation, a task event's run hash and a job's tags, the refusals."""

from __future__ import annotations

from typing import Any

import botocore.session
from botocore.exceptions import ClientError
from botocore.validate import validate_parameters

from sdflow.local.sagemaker import limits
from sdflow_common import aws, names
from tests.unit.helpers import AwsWorld

SAGEMAKER_MODEL = botocore.session.get_session().get_service_model("sagemaker")


def assert_valid_request(operation: str, request: dict[str, Any]) -> None:
    """botocore's own validation (wrong names, types, minimums, enums), then the maximums and
    patterns SageMaker checks on the server, as the local cloud enforces them."""
    shape = SAGEMAKER_MODEL.operation_model(operation).input_shape
    validate_parameters(request, shape)
    assert limits.problems(shape, request) == []


def run_hash(event: dict[str, Any]) -> str:
    return names.run_hash(event["execution_arn"], event["start_time"])


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
