"""IAM in the local cloud: the policy evaluator (cases from the IAM User Guide's evaluation
logic and condition-operator pages) and its enforcement on requests served by moto."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from sdflow.local import iam_resources, patching
from sdflow.local.iam_policy import Decision, PolicyError, PolicySet, arn_match
from sdflow.local.runtime import Runtime
from sdflow.local.services.iam import IamEnforcer
from tests.constants import ACCOUNT, REGION
from tests.helpers import wait_for

BUCKET = "iam-test-bucket"
TABLE_ARN = f"arn:aws:dynamodb:{REGION}:{ACCOUNT}:table/tokens"


def _policy(*statements: dict[str, Any]) -> PolicySet:
    return PolicySet.from_documents({"p": {"Version": "2012-10-17", "Statement": list(statements)}})


def _allow(action: Any, resource: Any, **extra: Any) -> dict[str, Any]:
    return {"Effect": "Allow", "Action": action, "Resource": resource, **extra}


# ------------------------------------------------------------------------------ the evaluator


def test_evaluate_no_statement_applies_implicit_deny() -> None:
    policy = _policy(_allow("s3:GetObject", f"arn:aws:s3:::{BUCKET}/runs/*"))
    assert policy.evaluate("s3:GetObject", f"arn:aws:s3:::{BUCKET}/manifests/a.json") is Decision.IMPLICIT_DENY
    assert policy.evaluate("s3:PutObject", f"arn:aws:s3:::{BUCKET}/runs/a") is Decision.IMPLICIT_DENY
    assert policy.evaluate("s3:GetObject", f"arn:aws:s3:::{BUCKET}/runs/a") is Decision.ALLOW


def test_evaluate_explicit_deny_wins_over_allow() -> None:
    policy = _policy(
        _allow("s3:*", "*"),
        {"Effect": "Deny", "Action": "s3:DeleteObject", "Resource": f"arn:aws:s3:::{BUCKET}/*"},
    )
    assert policy.evaluate("s3:DeleteObject", f"arn:aws:s3:::{BUCKET}/x") is Decision.EXPLICIT_DENY
    assert policy.evaluate("s3:GetObject", f"arn:aws:s3:::{BUCKET}/x") is Decision.ALLOW


def test_evaluate_action_names_case_insensitive_and_wildcards() -> None:
    policy = _policy(_allow(["states:SendTask*", "dynamodb:?etItem"], "*"))
    assert policy.evaluate("STATES:sendtasksuccess", "*") is Decision.ALLOW
    assert policy.evaluate("dynamodb:GetItem", TABLE_ARN) is Decision.ALLOW
    assert policy.evaluate("dynamodb:PutItem", TABLE_ARN) is Decision.IMPLICIT_DENY


def test_evaluate_not_action_and_not_resource_invert_the_match() -> None:
    policy = _policy(
        {"Effect": "Allow", "NotAction": "iam:*", "Resource": "*"},
        {"Effect": "Deny", "Action": "s3:*", "NotResource": f"arn:aws:s3:::{BUCKET}/*"},
    )
    assert policy.evaluate("iam:PassRole", "*") is Decision.IMPLICIT_DENY
    assert policy.evaluate("s3:GetObject", f"arn:aws:s3:::{BUCKET}/k") is Decision.ALLOW
    assert policy.evaluate("s3:GetObject", "arn:aws:s3:::other/k") is Decision.EXPLICIT_DENY


def test_arn_match_resource_part_spans_colons_other_segments_do_not() -> None:
    logs = f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:/aws/sagemaker/*"
    assert arn_match(logs, f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:/aws/sagemaker/Jobs:log-stream:a")
    assert arn_match("arn:aws:states:*:*:stateMachine:pipe", f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:pipe")
    # A Map Run child's state machine is not the parent's.
    parent = f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:pipe"
    assert not arn_match(parent, parent + "/Download")
    assert arn_match(parent + "/*", parent + "/Download")


def test_condition_string_equals_passed_to_service() -> None:
    role = f"arn:aws:iam::{ACCOUNT}:role/sm"
    policy = _policy(
        _allow("iam:PassRole", role, Condition={"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}})
    )
    assert policy.evaluate("iam:PassRole", role, {"iam:passedtoservice": ["sagemaker.amazonaws.com"]}) is Decision.ALLOW
    assert policy.evaluate("iam:PassRole", role, {"iam:passedtoservice": ["ec2.amazonaws.com"]}) is (
        Decision.IMPLICIT_DENY
    )
    # The key absent from the request: the condition is false (condition operators page).
    assert policy.evaluate("iam:PassRole", role, {}) is Decision.IMPLICIT_DENY


def test_condition_string_like_values_are_ored_and_key_names_case_insensitive() -> None:
    bucket = f"arn:aws:s3:::{BUCKET}"
    policy = _policy(_allow("s3:ListBucket", bucket, Condition={"StringLike": {"S3:Prefix": ["manifests/*", "x"]}}))
    assert policy.evaluate("s3:ListBucket", bucket, {"s3:prefix": ["manifests/a.json"]}) is Decision.ALLOW
    assert policy.evaluate("s3:ListBucket", bucket, {"s3:prefix": ["x"]}) is Decision.ALLOW
    assert policy.evaluate("s3:ListBucket", bucket, {"s3:prefix": ["runs/"]}) is Decision.IMPLICIT_DENY


def test_condition_negated_operator_absent_key_is_true_and_values_nored() -> None:
    policy = _policy(_allow("s3:GetObject", "*", Condition={"StringNotEquals": {"aws:RequestedRegion": ["a", "b"]}}))
    assert policy.evaluate("s3:GetObject", "*", {}) is Decision.ALLOW
    assert policy.evaluate("s3:GetObject", "*", {"aws:requestedregion": ["c"]}) is Decision.ALLOW
    assert policy.evaluate("s3:GetObject", "*", {"aws:requestedregion": ["b"]}) is Decision.IMPLICIT_DENY


def test_condition_if_exists_null_bool_numeric() -> None:
    if_exists = _policy(_allow("x:Y", "*", Condition={"StringEqualsIfExists": {"k:v": "1"}}))
    assert if_exists.evaluate("x:Y", "*", {}) is Decision.ALLOW
    assert if_exists.evaluate("x:Y", "*", {"k:v": ["2"]}) is Decision.IMPLICIT_DENY
    null = _policy(_allow("x:Y", "*", Condition={"Null": {"k:v": "true"}}))
    assert null.evaluate("x:Y", "*", {}) is Decision.ALLOW
    assert null.evaluate("x:Y", "*", {"k:v": ["1"]}) is Decision.IMPLICIT_DENY
    secure = _policy(
        {"Effect": "Deny", "Action": "s3:*", "Resource": "*", "Condition": {"Bool": {"aws:SecureTransport": False}}},
        _allow("s3:*", "*"),
    )
    assert secure.evaluate("s3:GetObject", "*", {"aws:securetransport": ["false"]}) is Decision.EXPLICIT_DENY
    assert secure.evaluate("s3:GetObject", "*", {"aws:securetransport": ["true"]}) is Decision.ALLOW
    numeric = _policy(_allow("x:Y", "*", Condition={"NumericLessThan": {"k:n": "10"}}))
    assert numeric.evaluate("x:Y", "*", {"k:n": ["9"]}) is Decision.ALLOW
    assert numeric.evaluate("x:Y", "*", {"k:n": ["10"]}) is Decision.IMPLICIT_DENY


def test_condition_for_any_value_and_for_all_values() -> None:
    any_value = _policy(_allow("x:Y", "*", Condition={"ForAnyValue:StringEquals": {"aws:TagKeys": ["a", "b"]}}))
    assert any_value.evaluate("x:Y", "*", {"aws:tagkeys": ["z", "b"]}) is Decision.ALLOW
    assert any_value.evaluate("x:Y", "*", {}) is Decision.IMPLICIT_DENY
    all_values = _policy(_allow("x:Y", "*", Condition={"ForAllValues:StringEquals": {"aws:TagKeys": ["a", "b"]}}))
    assert all_values.evaluate("x:Y", "*", {"aws:tagkeys": ["a", "b"]}) is Decision.ALLOW
    assert all_values.evaluate("x:Y", "*", {"aws:tagkeys": ["a", "z"]}) is Decision.IMPLICIT_DENY
    assert all_values.evaluate("x:Y", "*", {}) is Decision.ALLOW  # absent key: ForAllValues is true


@pytest.mark.parametrize(
    ("statement", "names"),
    [
        (
            {"Effect": "Allow", "Action": "s3:*", "Resource": "*", "Condition": {"IpAddress": {"aws:SourceIp": "1"}}},
            "IpAddress",
        ),
        ({"Effect": "Allow", "Action": "s3:*"}, "Resource"),
        ({"Effect": "Permit", "Action": "s3:*", "Resource": "*"}, "Effect"),
        ({"Effect": "Allow", "Principal": "*", "Action": "s3:*", "Resource": "*"}, "Principal"),
        ({"Effect": "Allow", "Action": "s3:*", "Resource": "arn:aws:s3:::${aws:username}/*"}, "policy variables"),
    ],
)
def test_parse_unsupported_or_invalid_statement_names_the_element(statement: dict[str, Any], names: str) -> None:
    with pytest.raises(PolicyError, match=names.replace("$", r"\$")):
        PolicySet.from_documents({"p": {"Statement": [statement]}})


# ------------------------------------------------------------------------------ resource ARNs


def test_checks_sagemaker_create_passes_role_and_tags() -> None:
    role = f"arn:aws:iam::{ACCOUNT}:role/sm"
    params = {"ProcessingJobName": "SDF-dl-1", "RoleArn": role, "Tags": [{"Key": "k", "Value": "v"}]}
    checks = iam_resources.checks(None, "sagemaker", "CreateProcessingJob", params, REGION, ACCOUNT)
    job = f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:processing-job/sdf-dl-1"
    assert [(c.action, c.resource) for c in checks or []] == [
        ("sagemaker:CreateProcessingJob", job),
        ("iam:PassRole", role),
        ("sagemaker:AddTags", job),
    ]
    assert (checks or [])[1].context["iam:passedtoservice"] == ["sagemaker.amazonaws.com"]


def test_checks_sagemaker_update_endpoint_with_rollback_alarms_needs_describe_alarms_on_each() -> None:
    params = {
        "EndpointName": "sdflow-cats",
        "EndpointConfigName": "cfg",
        "DeploymentConfig": {"AutoRollbackConfiguration": {"Alarms": [{"AlarmName": "errors"}, {"AlarmName": "p99"}]}},
    }
    checks = iam_resources.checks(None, "sagemaker", "UpdateEndpoint", params, REGION, ACCOUNT)
    assert [(c.action, c.resource) for c in checks or []][1:] == [
        ("cloudwatch:DescribeAlarms", f"arn:aws:cloudwatch:{REGION}:{ACCOUNT}:alarm:errors"),
        ("cloudwatch:DescribeAlarms", f"arn:aws:cloudwatch:{REGION}:{ACCOUNT}:alarm:p99"),
    ]


@pytest.mark.parametrize(
    ("operation", "params", "resource"),
    [
        ("CreateModelPackageGroup", {"ModelPackageGroupName": "SDF-cats"}, "model-package-group/sdf-cats"),
        ("CreateModelPackage", {"ModelPackageGroupName": "sdf-cats"}, "model-package/sdf-cats"),
        (
            "UpdateModelPackage",
            {"ModelPackageArn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:model-package/sdf-cats/3"},
            "model-package/sdf-cats/3",
        ),
        ("DescribeModelPackage", {"ModelPackageName": "plain"}, "model-package/plain"),
    ],
)
def test_checks_sagemaker_model_registry_names_the_group_or_package_arn(
    operation: str, params: dict[str, Any], resource: str
) -> None:
    checks = iam_resources.checks(None, "sagemaker", operation, params, REGION, ACCOUNT)

    assert [(c.action, c.resource) for c in checks or []][:1] == [
        (f"sagemaker:{operation}", f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:{resource}")
    ]


def test_checks_lambda_dynamodb_logs_cloudwatch_resources() -> None:
    def one(service: str, operation: str, params: dict[str, Any]) -> tuple[str, str]:
        found = iam_resources.checks(None, service, operation, params, REGION, ACCOUNT)
        assert found is not None
        assert len(found) == 1
        return found[0].action, found[0].resource

    assert one("lambda", "Invoke", {"FunctionName": "fn", "Qualifier": "3"}) == (
        "lambda:InvokeFunction",
        f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:fn:3",
    )
    assert one("dynamodb", "Query", {"TableName": "tokens", "IndexName": "by-age"}) == (
        "dynamodb:Query",
        f"{TABLE_ARN}/index/by-age",
    )
    assert one("logs", "PutLogEvents", {"logGroupName": "/aws/sagemaker/J", "logStreamName": "s"}) == (
        "logs:PutLogEvents",
        f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:/aws/sagemaker/J:log-stream:s",
    )
    metric = iam_resources.checks(None, "cloudwatch", "PutMetricData", {"Namespace": "sdflow"}, REGION, ACCOUNT)
    assert metric is not None
    assert metric[0].context["cloudwatch:namespace"] == ["sdflow"]
    assert iam_resources.checks(None, "ec2", "RunInstances", {}, REGION, ACCOUNT) is None


# ------------------------------------------------------------------------------ enforcement through moto


@pytest.fixture
def enforced(aws: None, tmp_path: Path) -> Iterator[Runtime]:
    runtime = Runtime(workdir=tmp_path, iam=IamEnforcer(REGION))
    with patching.patched(runtime):
        yield runtime


def _as_role(runtime: Runtime, statements: list[dict[str, Any]], name: str = "fn") -> dict[str, Any]:
    iam = boto3.client("iam", region_name=REGION)
    arn = iam.create_role(RoleName=name, AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    document = {"Version": "2012-10-17", "Statement": statements}
    iam.put_role_policy(RoleName=name, PolicyName="inline", PolicyDocument=json.dumps(document))
    keys = runtime.iam.credentials_for_role(arn, "my-function")
    return {
        "region_name": REGION,
        "aws_access_key_id": keys["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": keys["AWS_SECRET_ACCESS_KEY"],
        "aws_session_token": keys["AWS_SESSION_TOKEN"],
    }


def test_enforce_s3_get_object_outside_role_access_denied(enforced: Runtime) -> None:
    admin = boto3.client("s3", region_name=REGION)
    admin.create_bucket(Bucket=BUCKET)
    for key in ("runs/a", "manifests/a"):
        admin.put_object(Bucket=BUCKET, Key=key, Body=b"1")
    s3 = boto3.client("s3", **_as_role(enforced, [_allow("s3:GetObject", f"arn:aws:s3:::{BUCKET}/runs/*")]))

    assert s3.get_object(Bucket=BUCKET, Key="runs/a")["Body"].read() == b"1"
    with pytest.raises(ClientError) as denied:
        s3.get_object(Bucket=BUCKET, Key="manifests/a")
    error = denied.value.response["Error"]
    assert (error["Code"], denied.value.response["ResponseMetadata"]["HTTPStatusCode"]) == ("AccessDenied", 403)
    assert error["Message"] == (
        f"User: arn:aws:sts::{ACCOUNT}:assumed-role/fn/my-function is not authorized to perform: s3:GetObject "
        f"on resource: arn:aws:s3:::{BUCKET}/manifests/a because no identity-based policy allows the "
        "s3:GetObject action"
    )
    assert admin.get_object(Bucket=BUCKET, Key="manifests/a")["Body"].read() == b"1"  # the user is admin


def test_enforce_json_and_query_services_answer_their_own_error_codes(enforced: Runtime) -> None:
    keys = _as_role(enforced, [_allow("dynamodb:GetItem", "arn:aws:dynamodb:*:*:table/other")])
    with pytest.raises(ClientError) as dynamodb:
        boto3.client("dynamodb", **keys).get_item(TableName="tokens", Key={"k": {"S": "v"}})
    assert dynamodb.value.response["Error"]["Code"] == "AccessDeniedException"
    assert dynamodb.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
    topic = f"arn:aws:sns:{REGION}:{ACCOUNT}:t"
    with pytest.raises(ClientError) as sns:
        boto3.client("sns", **keys).publish(TopicArn=topic, Message="x")
    assert sns.value.response["Error"]["Code"] == "AuthorizationError"
    assert sns.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    identity = boto3.client("sts", **keys).get_caller_identity()  # needs no permission
    assert identity["Arn"] == f"arn:aws:sts::{ACCOUNT}:assumed-role/fn/my-function"


def test_enforce_put_metric_data_namespace_condition(enforced: Runtime) -> None:
    condition = {"StringLike": {"cloudwatch:namespace": "/aws/sagemaker/*"}}
    cloudwatch = boto3.client(
        "cloudwatch", **_as_role(enforced, [_allow("cloudwatch:PutMetricData", "*", Condition=condition)])
    )
    cloudwatch.put_metric_data(Namespace="/aws/sagemaker/Jobs", MetricData=[{"MetricName": "m", "Value": 1.0}])
    with pytest.raises(ClientError) as denied:
        cloudwatch.put_metric_data(Namespace="sdflow", MetricData=[{"MetricName": "m", "Value": 1.0}])
    assert denied.value.response["Error"]["Code"] == "AccessDenied"


def test_enforce_policy_change_takes_effect_on_next_call(enforced: Runtime) -> None:
    boto3.client("s3", region_name=REGION).create_bucket(Bucket=BUCKET)
    keys = _as_role(enforced, [_allow("s3:ListBucket", f"arn:aws:s3:::{BUCKET}")])
    s3 = boto3.client("s3", **keys)
    s3.list_objects_v2(Bucket=BUCKET)
    deny = {"Effect": "Deny", "Action": "s3:ListBucket", "Resource": "*"}
    boto3.client("iam", region_name=REGION).put_role_policy(
        RoleName="fn", PolicyName="deny", PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [deny]})
    )
    with pytest.raises(ClientError) as denied:
        s3.list_objects_v2(Bucket=BUCKET)
    assert "with an explicit deny" in denied.value.response["Error"]["Message"]


def test_api_calls_counted_by_service_and_operation(enforced: Runtime) -> None:
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket=BUCKET)
    s3.put_object(Bucket=BUCKET, Key="a", Body=b"1")
    s3.put_object(Bucket=BUCKET, Key="b", Body=b"1")
    boto3.client("stepfunctions", region_name=REGION).list_state_machines()
    assert enforced.api_calls[("s3", "PutObject")] == 2
    assert enforced.api_calls[("states", "ListStateMachines")] == 1


def test_without_enforcer_role_credentials_are_not_evaluated(aws: None, tmp_path: Path) -> None:
    runtime = Runtime(workdir=tmp_path)
    with patching.patched(runtime):
        enforcer = IamEnforcer(REGION)
        runtime.iam = enforcer
        keys = _as_role(runtime, [_allow("s3:GetObject", "arn:aws:s3:::elsewhere/*")])
        runtime.iam = None
        boto3.client("s3", region_name=REGION).create_bucket(Bucket=BUCKET)
        boto3.client("s3", **keys).list_objects_v2(Bucket=BUCKET)  # not allowed, but IAM is off
        assert runtime.api_calls[("s3", "ListBucket")] == 1


def _token_from_map_child(sfn: Any, sqs: Any) -> tuple[str, str]:
    """An execution whose Distributed Map child (Label "Download") waits on a task token."""
    queue_url = sqs.create_queue(QueueName="tokens")["QueueUrl"]
    wait = {
        "Type": "Task",
        "Resource": "arn:aws:states:::sqs:sendMessage.waitForTaskToken",
        "Parameters": {"QueueUrl": queue_url, "MessageBody": {"token.$": "$$.Task.Token"}},
        "End": True,
    }
    download = {
        "Type": "Map",
        "Label": "Download",
        "ItemsPath": "$.items",
        "ItemProcessor": {
            "ProcessorConfig": {"Mode": "DISTRIBUTED", "ExecutionType": "STANDARD"},
            "StartAt": "Wait",
            "States": {"Wait": wait},
        },
        "ResultPath": None,
        "End": True,
    }
    definition = json.dumps({"StartAt": "Download", "States": {"Download": download}})
    role = f"arn:aws:iam::{ACCOUNT}:role/test"
    machine = sfn.create_state_machine(name="pipeline", definition=definition, roleArn=role)["stateMachineArn"]
    execution = sfn.start_execution(stateMachineArn=machine, input=json.dumps({"items": [1]}))["executionArn"]
    message = wait_for(
        lambda: sqs.receive_message(QueueUrl=queue_url).get("Messages"), timeout_s=20, what="token", interval_s=0.05
    )
    return execution, json.loads(message[0]["Body"])["token"]


def test_enforce_send_task_success_map_child_token_needs_child_state_machine_arn(enforced: Runtime) -> None:
    sfn, sqs = boto3.client("stepfunctions", region_name=REGION), boto3.client("sqs", region_name=REGION)
    execution, token = _token_from_map_child(sfn, sqs)
    parent = f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:pipeline"
    keys = _as_role(enforced, [_allow(["states:SendTaskSuccess", "states:SendTaskFailure"], parent)])

    with pytest.raises(ClientError) as denied:
        boto3.client("stepfunctions", **keys).send_task_success(taskToken=token, output="{}")
    assert denied.value.response["Error"]["Code"] == "AccessDeniedException"
    assert f"states:SendTaskSuccess on resource: {parent}/Download " in denied.value.response["Error"]["Message"]

    child = {"Effect": "Allow", "Action": "states:SendTaskSuccess", "Resource": f"{parent}/*"}
    boto3.client("iam", region_name=REGION).put_role_policy(
        RoleName="fn", PolicyName="children", PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [child]})
    )
    boto3.client("stepfunctions", **keys).send_task_success(taskToken=token, output="{}")
    status = wait_for(
        lambda: (s := sfn.describe_execution(executionArn=execution)["status"]) != "RUNNING" and s,
        timeout_s=20,
        what="the execution to end",
        interval_s=0.05,
    )
    assert status == "SUCCEEDED"
