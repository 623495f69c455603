"""Unit-test fixtures: no sockets, AWS mocked by moto, the template's environment set."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aws_xray_sdk.core  # noqa: F401 - its global recorder opens a UDP socket at import: do it before sockets are disabled
import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws

from sdflow_common import aws
from sdflow_common.token_store import TokenStore
from tests.constants import ACCOUNT, REGION
from tests.unit.helpers import (
    ACCELERATE_IMAGE_URI,
    DATA_BUCKET,
    EVENTS_PIPELINE,
    EVENTS_RUN_NAME,
    IDEMPOTENCY_TABLE,
    SAGEMAKER_ROLE_ARN,
    STATE_MACHINE_ARN,
    TOKEN_TABLE,
    TRAINING_IMAGE_URI,
    AwsWorld,
    FakeLambdaContext,
    create_table,
)
from tests.unit.pipeline_harness import Pipeline, pipeline_on_local_stepfunctions


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/unit/" in str(item.fspath) and "lint" not in item.keywords:
            item.add_marker(pytest.mark.unit)


@pytest.fixture(autouse=True)
def _no_network(request: pytest.FixtureRequest) -> Iterator[None]:
    """Unit tests never open a socket (pytest-socket); lint tests run external tools."""
    if "lint" in request.keywords:
        yield
        return
    import pytest_socket

    pytest_socket.disable_socket(allow_unix_socket=True)
    yield
    pytest_socket.enable_socket()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment template.yaml gives the functions, with fake credentials."""
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        "DATA_BUCKET": DATA_BUCKET,
        "TOKEN_TABLE": TOKEN_TABLE,
        "NOTIFY_FUNCTION": "sdflow-test-NotifyFunction",
        "IDEMPOTENCY_TABLE": IDEMPOTENCY_TABLE,
        "STATE_MACHINE_ARN": STATE_MACHINE_ARN,
        "SAGEMAKER_ROLE_ARN": SAGEMAKER_ROLE_ARN,
        "TRAINING_IMAGE_URI": TRAINING_IMAGE_URI,
        "ACCELERATE_IMAGE_URI": ACCELERATE_IMAGE_URI,
        "MAX_SHARDS": "50",
        "POWERTOOLS_SERVICE_NAME": "sdflow-test",
        "POWERTOOLS_METRICS_NAMESPACE": "sdflow-test",
        "POWERTOOLS_TRACE_DISABLED": "1",
        "POWERTOOLS_DEV": "0",
        "POWERTOOLS_LOG_LEVEL": "INFO",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def _deny_service_quotas() -> None:
    """moto 5.2.5 lists no SageMaker quotas (in process, ListServiceQuotas raises
    NotImplementedError), so the functions' cached client answers as a role without
    servicequotas permissions would; tests/unit/test_quotas.py stubs real listings."""

    def deny(model: Any, **_: Any) -> None:
        error = {"Code": "AccessDeniedException", "Message": "not authorized to perform servicequotas actions"}
        raise ClientError({"Error": error}, model.name)

    aws.client("service-quotas").meta.events.register("before-call.service-quotas", deny)


@pytest.fixture
def mocked_aws(aws_env: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[AwsWorld]:
    """A moto account holding the stack's bucket, token table, idempotency table and topic."""
    with mock_aws():
        aws.reset_clients()
        s3 = boto3.client("s3", region_name=REGION)
        s3.create_bucket(Bucket=DATA_BUCKET)
        ddb = boto3.client("dynamodb", region_name=REGION)
        create_table(TOKEN_TABLE, "resource_name")
        create_table(IDEMPOTENCY_TABLE, "id")
        sns = boto3.client("sns", region_name=REGION)
        topic_arn = sns.create_topic(Name="sdflow-notifications-test")["TopicArn"]
        _deny_service_quotas()
        monkeypatch.setenv("TOPIC_ARN", topic_arn)
        yield AwsWorld(
            s3=s3,
            sfn=boto3.client("stepfunctions", region_name=REGION),
            ddb=ddb,
            sns=sns,
            sagemaker=boto3.client("sagemaker", region_name=REGION),
            topic_arn=topic_arn,
        )
        aws.reset_clients()


@pytest.fixture
def intake_world(mocked_aws: AwsWorld) -> AwsWorld:
    """The moto account holding a base model's model_index.json at models/tiny-sd/ (the intake checks read it)."""
    mocked_aws.put_json("models/tiny-sd/model_index.json", {"_class_name": "StableDiffusionPipeline"})
    return mocked_aws


@pytest.fixture
def store(mocked_aws: AwsWorld) -> TokenStore:
    """The stack's token table in the moto account (tests/unit/test_token_store.py has its own, on a clock)."""
    return TokenStore(TOKEN_TABLE)


@pytest.fixture
def context() -> FakeLambdaContext:
    return FakeLambdaContext()


@pytest.fixture
def events_execution(mocked_aws: AwsWorld) -> str:
    """The run the events/ payloads name, RUNNING in moto (moto leaves a started execution
    RUNNING), so the starters' DescribeExecution check passes unless a test stops it."""
    machine = mocked_aws.sfn.create_state_machine(
        name=EVENTS_PIPELINE,
        definition='{"StartAt": "Wait", "States": {"Wait": {"Type": "Pass", "End": true}}}',
        roleArn=f"arn:aws:iam::{ACCOUNT}:role/sdflow-states",
    )["stateMachineArn"]
    return str(mocked_aws.sfn.start_execution(stateMachineArn=machine, name=EVENTS_RUN_NAME)["executionArn"])


@pytest.fixture
def pipeline(aws_env: None, tmp_path: Path) -> Iterator[Pipeline]:
    """The pipeline definition on the local cloud's Step Functions, the functions played by doubles
    (tests/unit/pipeline_harness.py)."""
    with pipeline_on_local_stepfunctions(tmp_path) as harness:
        yield harness
