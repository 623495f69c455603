"""IAM SimulatePrincipalPolicy in the local cloud: answered by the evaluator that enforces calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError

from sdflow.local import patching
from sdflow.local.runtime import Runtime
from sdflow.local.services.iam import IamEnforcer
from tests.constants import ACCOUNT, REGION

BUCKET_ARN = "arn:aws:s3:::data"


@pytest.fixture
def iam(aws: None, tmp_path: Path) -> Iterator[object]:
    with patching.patched(Runtime(workdir=tmp_path, iam=IamEnforcer(REGION))):
        yield boto3.client("iam", region_name=REGION)


def _role(iam: object, statements: list[dict[str, object]]) -> str:
    arn = iam.create_role(RoleName="job", Path="/service/", AssumeRolePolicyDocument="{}")["Role"]["Arn"]  # type: ignore[attr-defined]
    document = json.dumps({"Version": "2012-10-17", "Statement": statements})
    iam.put_role_policy(RoleName="job", PolicyName="inline", PolicyDocument=document)  # type: ignore[attr-defined]
    return str(arn)


def test_simulate_principal_policy_role_decisions_match_its_policies(iam: object) -> None:
    arn = _role(
        iam,
        [
            {"Effect": "Allow", "Action": "s3:*", "Resource": f"{BUCKET_ARN}/*"},
            {"Effect": "Deny", "Action": "s3:DeleteObject", "Resource": "*"},
        ],
    )

    results = iam.simulate_principal_policy(  # type: ignore[attr-defined]
        PolicySourceArn=arn,
        ActionNames=["s3:GetObject", "s3:DeleteObject", "sagemaker:CreateTrainingJob"],
        ResourceArns=[f"{BUCKET_ARN}/key"],
    )["EvaluationResults"]

    decisions = {result["EvalActionName"]: result["EvalDecision"] for result in results}
    assert decisions == {
        "s3:GetObject": "allowed",
        "s3:DeleteObject": "explicitDeny",
        "sagemaker:CreateTrainingJob": "implicitDeny",
    }
    assert {result["EvalResourceName"] for result in results} == {f"{BUCKET_ARN}/key"}


def test_simulate_principal_policy_without_resources_evaluates_star(iam: object) -> None:
    arn = _role(iam, [{"Effect": "Allow", "Action": "logs:PutLogEvents", "Resource": "*"}])

    [result] = iam.simulate_principal_policy(PolicySourceArn=arn, ActionNames=["logs:PutLogEvents"])[  # type: ignore[attr-defined]
        "EvaluationResults"
    ]

    assert (result["EvalResourceName"], result["EvalDecision"]) == ("*", "allowed")


def test_simulate_principal_policy_unknown_role_is_no_such_entity(iam: object) -> None:
    with pytest.raises(ClientError) as missing:
        iam.simulate_principal_policy(  # type: ignore[attr-defined]
            PolicySourceArn=f"arn:aws:iam::{ACCOUNT}:role/nobody", ActionNames=["s3:GetObject"]
        )

    assert missing.value.response["Error"]["Code"] == "NoSuchEntity"
