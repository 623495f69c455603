"""Unit-test fixtures: no sockets, AWS mocked by moto, the template's environment set."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aws_xray_sdk.core  # noqa: F401 - its global recorder opens a UDP socket at import: do it before sockets are disabled
import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws

from sdflow_common import aws

REGION = "us-east-1"
ACCOUNT = "123456789012"
DATA_BUCKET = "sdflow-data-test"
TOKEN_TABLE = "sdflow-tokens-test"
IDEMPOTENCY_TABLE = "sdflow-idempotency-test"
STATE_MACHINE_NAME = "sdflow-pipeline-test"
STATE_MACHINE_ARN = f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:{STATE_MACHINE_NAME}"
SAGEMAKER_ROLE_ARN = f"arn:aws:iam::{ACCOUNT}:role/sdflow-sagemaker-test"
TRAINING_IMAGE_URI = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/sdflow-training:latest"
EVENTS_DIR = Path(__file__).resolve().parents[2] / "events"


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
        "IDEMPOTENCY_TABLE": IDEMPOTENCY_TABLE,
        "STATE_MACHINE_ARN": STATE_MACHINE_ARN,
        "SAGEMAKER_ROLE_ARN": SAGEMAKER_ROLE_ARN,
        "TRAINING_IMAGE_URI": TRAINING_IMAGE_URI,
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


@dataclass
class AwsWorld:
    """Handles on the mocked account that most tests need."""

    s3: Any
    sfn: Any
    ddb: Any
    sns: Any
    sagemaker: Any
    topic_arn: str

    def put_json(self, key: str, body: Any, bucket: str = DATA_BUCKET) -> dict[str, Any]:
        return self.s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(body).encode())

    def get_json(self, key: str, bucket: str = DATA_BUCKET) -> Any:
        return json.loads(self.s3.get_object(Bucket=bucket, Key=key)["Body"].read())


def _deny_service_quotas() -> None:
    """moto 5.2.5 lists no SageMaker quotas (in process, ListServiceQuotas raises
    NotImplementedError), so the functions' cached client answers as a role without
    servicequotas permissions would; tests/unit/test_quotas.py stubs real listings."""

    def deny(model: Any, **_: Any) -> None:
        error = {"Code": "AccessDeniedException", "Message": "not authorized to perform servicequotas actions"}
        raise ClientError({"Error": error}, model.name)

    aws.client("service-quotas").meta.events.register("before-call.service-quotas", deny)


def create_table(name: str, hash_key: str) -> None:
    """An on-demand table keyed by one string attribute, as the template's tables are."""
    boto3.client("dynamodb", region_name=REGION).create_table(
        TableName=name,
        KeySchema=[{"AttributeName": hash_key, "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": hash_key, "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )


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


@dataclass
class FakeLambdaContext:
    """The parts of a Lambda context that Powertools and the handlers read."""

    function_name: str = "sdflow-test"
    memory_limit_in_mb: int = 512
    invoked_function_arn: str = f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:sdflow-test"
    aws_request_id: str = "7f1c2a9e-0000-4000-8000-000000000000"

    def get_remaining_time_in_millis(self) -> int:
        return 60_000


def load_event(name: str) -> dict[str, Any]:
    """An event from events/, the same file `sam local invoke -e` uses."""
    return json.loads((EVENTS_DIR / name).read_text())


# The execution the events/ payloads belong to (execution:sdflow-pipeline-test:pokemon-sd15-v2-…).
EVENTS_PIPELINE = "sdflow-pipeline-test"
EVENTS_RUN_NAME = "pokemon-sd15-v2-7f3a9c2e41"


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
