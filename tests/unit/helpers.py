"""What unit tests share besides fixtures: the stack's names, the mocked account's handles, a Lambda context, events."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3

from tests.constants import ACCOUNT, REGION

DATA_BUCKET = "sdflow-data-test"
TOKEN_TABLE = "sdflow-tokens-test"
IDEMPOTENCY_TABLE = "sdflow-idempotency-test"
STATE_MACHINE_NAME = "sdflow-pipeline-test"
STATE_MACHINE_ARN = f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:{STATE_MACHINE_NAME}"
SAGEMAKER_ROLE_ARN = f"arn:aws:iam::{ACCOUNT}:role/sdflow-sagemaker-test"
TRAINING_IMAGE_URI = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/sdflow-training:latest"
ACCELERATE_IMAGE_URI = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/sdflow-training:latest-accelerate"
EVENTS_DIR = Path(__file__).resolve().parents[2] / "events"

# The execution the events/ payloads belong to (execution:sdflow-pipeline-test:pokemon-sd15-v2-…).
EVENTS_PIPELINE = "sdflow-pipeline-test"
EVENTS_RUN_NAME = "pokemon-sd15-v2-7f3a9c2e41"


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


def create_table(name: str, hash_key: str) -> None:
    """An on-demand table keyed by one string attribute, as the template's tables are."""
    boto3.client("dynamodb", region_name=REGION).create_table(
        TableName=name,
        KeySchema=[{"AttributeName": hash_key, "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": hash_key, "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )


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
