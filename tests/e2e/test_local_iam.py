"""IAM through the real local cloud: a deployed function's handler calls S3 with its own role's
credentials over HTTP, and the template's policy decides, as on AWS."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from sdflow.local.cloud import LocalCloud

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# A handler that reads the object the event names and says what S3 answered.
READER = """
import os
import boto3
from botocore.exceptions import ClientError

def lambda_handler(event, context):
    s3 = boto3.client("s3")
    try:
        body = s3.get_object(Bucket=os.environ["DATA_BUCKET"], Key=event["key"])["Body"].read().decode()
        return {"body": body}
    except ClientError as error:
        return {"code": error.response["Error"]["Code"], "message": error.response["Error"]["Message"],
                "status": error.response["ResponseMetadata"]["HTTPStatusCode"]}
"""


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCloud]:
    with LocalCloud(tmp_path_factory.mktemp("iam-cloud"), sagemaker_factory=None) as running:
        s3 = running.client("s3")
        s3.put_object(Bucket=running.bucket, Key="runs/r1/shards.json", Body=b"runs")
        s3.put_object(Bucket=running.bucket, Key="manifests/run.json", Body=b"manifest")
        yield running


def test_function_role_without_get_object_on_key_access_denied(cloud: LocalCloud, tmp_path: Path) -> None:
    # BuildIndexFunction's role may read runs/* only (template.yaml); its code is replaced by READER.
    name = cloud.function_name("BuildIndexFunction")
    (tmp_path / "app.py").write_text(READER)
    assert cloud.runtime is not None
    cloud.runtime.register_code(name, tmp_path)
    lam = cloud.client("lambda")

    def invoke(key: str) -> dict[str, object]:
        answer = lam.invoke(FunctionName=name, Payload=json.dumps({"key": key}).encode())
        return dict(json.loads(answer["Payload"].read()))

    assert invoke("runs/r1/shards.json") == {"body": "runs"}
    denied = invoke("manifests/run.json")
    assert (denied["code"], denied["status"]) == ("AccessDenied", 403)
    assert "assumed-role/sdflow-local-BuildIndexFunctionRole-" in str(denied["message"])
    resource = f"arn:aws:s3:::{cloud.bucket}/manifests/run.json"
    assert f"/{name} is not authorized to perform: s3:GetObject on resource: {resource}" in str(denied["message"])
    # The user (the CLI's credentials) administers the account.
    assert cloud.client("s3").get_object(Bucket=cloud.bucket, Key="manifests/run.json")["Body"].read() == b"manifest"
    assert cloud.runtime.api_calls[("s3", "GetObject")] >= 3
    assert cloud.runtime.api_calls[("lambda", "Invoke")] >= 2
