"""CloudFormation: template resources created as the local runtime needs them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdflow.local import runtime as runtime_module
from sdflow.local.services import awslambda, cloudformation
from tests.constants import ACCOUNT, REGION
from tests.unit.local.helpers import (
    HANDLERS,
    MACHINE,
    MACHINE_ARN,
    ROLE,
    client,
    lambda_model,
    rule_with_target,
    stack,
    wait_for,
    zip_files,
)


def test_moto_gap_cloudformation_state_machine_invisible_to_executing_backend(aws: None) -> None:
    stack({"Machine": MACHINE})
    with pytest.raises(ClientError, match="StateMachineDoesNotExist"):
        client("stepfunctions").describe_state_machine(stateMachineArn=MACHINE_ARN)


def test_patch_cloudformation_state_machine_executes_with_substitutions(runtime: runtime_module.Runtime) -> None:
    stack({"Machine": MACHINE})
    sfn = client("stepfunctions")
    execution = sfn.start_execution(stateMachineArn=MACHINE_ARN, input="{}")["executionArn"]
    done = wait_for(
        lambda: (d := sfn.describe_execution(executionArn=execution))["status"] != "RUNNING" and d,
        what="the execution",
    )
    assert done["status"] == "SUCCEEDED"
    assert json.loads(done["output"]) == {"greeting": "substituted"}


def test_patch_cloudformation_state_machine_reads_definition_s3_location(runtime: runtime_module.Runtime) -> None:
    s3 = client("s3")
    s3.create_bucket(Bucket="artifacts")
    definition = MACHINE["Properties"]["DefinitionString"]
    s3.put_object(Bucket="artifacts", Key="sm.json", Body=definition.encode())
    properties = {k: v for k, v in MACHINE["Properties"].items() if k != "DefinitionString"}
    machine = {
        **MACHINE,
        "Properties": {**properties, "DefinitionS3Location": {"Bucket": "artifacts", "Key": "sm.json"}},
    }
    stack({"Machine": machine})
    described = client("stepfunctions").describe_state_machine(stateMachineArn=MACHINE_ARN)
    assert "substituted" in described["definition"]


BUCKET = {
    "Type": "AWS::S3::Bucket",
    "Properties": {
        "BucketName": "data",
        "NotificationConfiguration": {"EventBridgeConfiguration": {"EventBridgeEnabled": True}},
        "VersioningConfiguration": {"Status": "Enabled"},
    },
}


def _upload_events_seen() -> list[dict[str, Any]]:
    """Upload to the CloudFormation bucket; the S3 events an SQS-targeted rule then receives."""
    queue_url = client("sqs").create_queue(QueueName="s3-events")["QueueUrl"]
    rule_with_target({"Arn": f"arn:aws:sqs:{REGION}:{ACCOUNT}:s3-events"}, {"source": ["aws.s3"]})
    client("s3").put_object(Bucket="data", Key="manifests/run.json", Body=b"{}")
    return [json.loads(m["Body"]) for m in client("sqs").receive_message(QueueUrl=queue_url).get("Messages", [])]


def test_moto_gap_cloudformation_bucket_drops_eventbridge_and_versioning(aws: None) -> None:
    stack({"Bucket": BUCKET})
    assert "Status" not in client("s3").get_bucket_versioning(Bucket="data")
    assert _upload_events_seen() == []


def test_patch_cloudformation_bucket_honours_eventbridge_and_versioning(runtime: runtime_module.Runtime) -> None:
    stack({"Bucket": BUCKET})
    assert client("s3").get_bucket_versioning(Bucket="data")["Status"] == "Enabled"
    [event] = _upload_events_seen()
    assert event["detail"]["object"]["key"] == "manifests/run.json"
    assert event["detail"]["object"]["version-id"] not in (None, "null")


REPOSITORY = {"Type": "AWS::ECR::Repository", "Properties": {"ImageTagMutability": "IMMUTABLE"}}


def test_moto_gap_cloudformation_repository_generated_name_is_rejected(aws: None) -> None:
    with pytest.raises(ClientError, match="repositoryName"):
        stack({"TrainingRepository": REPOSITORY})


def test_patch_cloudformation_repository_gets_lower_case_name(runtime: runtime_module.Runtime) -> None:
    outputs = stack(
        {"TrainingRepository": REPOSITORY}, {"Uri": {"Value": {"Fn::GetAtt": ["TrainingRepository", "RepositoryUri"]}}}
    )
    name = outputs["Uri"].split("/", 1)[1]
    assert name == name.lower()
    assert name.startswith("s-trainingrepository-")


def _function_stack_resources() -> dict[str, Any]:
    s3 = client("s3")
    s3.create_bucket(Bucket="artifacts")
    s3.put_object(Bucket="artifacts", Key="fn.zip", Body=zip_files({"app.py": HANDLERS}))
    s3.put_object(Bucket="artifacts", Key="layer.zip", Body=zip_files({"python/common.py": "X = 1\n"}))
    return {
        "Layer": {
            "Type": "AWS::Lambda::LayerVersion",
            "Properties": {"LayerName": "common", "Content": {"S3Bucket": "artifacts", "S3Key": "layer.zip"}},
        },
        "Fn": {
            "Type": "AWS::Lambda::Function",
            "Properties": {
                "FunctionName": "fn",
                "Code": {"S3Bucket": "artifacts", "S3Key": "fn.zip"},
                "Handler": "app.lambda_handler",
                "Runtime": "python3.11",
                "Role": ROLE,
                "Layers": [{"Ref": "Layer"}],
                "DeadLetterConfig": {"TargetArn": f"arn:aws:sqs:{REGION}:{ACCOUNT}:dlq"},
                "Environment": {"Variables": {"GREETING": "from-template"}},
            },
        },
    }


def test_moto_gap_cloudformation_function_drops_layers(aws: None) -> None:
    stack(_function_stack_resources())
    assert not client("lambda").get_function_configuration(FunctionName="fn").get("Layers")


def test_patch_cloudformation_function_keeps_layers_and_runs_from_deployed_zip(runtime: runtime_module.Runtime) -> None:
    stack(_function_stack_resources())
    assert len(client("lambda").get_function_configuration(FunctionName="fn")["Layers"]) == 1
    assert lambda_model("fn").dead_letter_config == {"TargetArn": f"arn:aws:sqs:{REGION}:{ACCOUNT}:dlq"}
    spec = awslambda.function_spec(runtime, lambda_model("fn"))
    assert (spec.layer_dirs[0] / "common.py").exists(), "the layer's python/ folder goes on sys.path"
    answer = json.loads(client("lambda").invoke(FunctionName="fn", Payload=b"{}")["Payload"].read())
    assert answer["greeting"] == "from-template"


def test_patch_cloudformation_function_logs_to_its_logging_config_group(runtime: runtime_module.Runtime) -> None:
    resources = _function_stack_resources()
    resources["FnLogGroup"] = {
        "Type": "AWS::Logs::LogGroup",
        "Properties": {"LogGroupName": "/aws/lambda/s-Fn", "RetentionInDays": 14},
    }
    resources["Fn"]["Properties"]["LoggingConfig"] = {"LogGroup": {"Ref": "FnLogGroup"}}
    stack(resources)
    assert awslambda.function_spec(runtime, lambda_model("fn")).log_group == "/aws/lambda/s-Fn"
    (group,) = client("logs").describe_log_groups(logGroupNamePrefix="/aws/lambda/s-Fn")["logGroups"]
    assert group["retentionInDays"] == 14


def test_patch_cloudformation_function_without_logging_config_uses_the_default_group(
    runtime: runtime_module.Runtime,
) -> None:
    stack(_function_stack_resources())
    assert awslambda.function_spec(runtime, lambda_model("fn")).log_group == ""


QUEUE_STATEMENT = {
    "Effect": "Allow",
    "Principal": {"Service": "events.amazonaws.com"},
    "Action": "sqs:SendMessage",
    "Resource": f"arn:aws:sqs:{REGION}:{ACCOUNT}:dlq",
}
EXTRA_RESOURCES = {
    "Queue": {"Type": "AWS::SQS::Queue", "Properties": {"QueueName": "dlq"}},
    "QueuePolicy": {
        "Type": "AWS::SQS::QueuePolicy",
        "Properties": {
            "Queues": [{"Ref": "Queue"}],
            "PolicyDocument": {"Version": "2012-10-17", "Statement": [QUEUE_STATEMENT]},
        },
    },
    "Schedule": {
        "Type": "AWS::Scheduler::Schedule",
        "Properties": {
            "Name": "every10",
            "ScheduleExpression": "rate(10 minutes)",
            "FlexibleTimeWindow": {"Mode": "OFF"},
            "Target": {"Arn": f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:x", "RoleArn": ROLE},
        },
    },
}


def test_moto_gap_cloudformation_lacks_queue_policy_schedule_and_bucket_policy_models() -> None:
    from moto.cloudformation.parsing import resource_class_from_type

    for resource_type in cloudformation.EXTRA_CFN_MODELS:
        assert resource_class_from_type(resource_type) is None, resource_type


def test_patch_cloudformation_creates_queue_policy_and_schedule(runtime: runtime_module.Runtime) -> None:
    stack(EXTRA_RESOURCES)
    schedule = client("scheduler").get_schedule(Name="every10")
    assert schedule["ScheduleExpression"] == "rate(10 minutes)"
    queue_url = client("sqs").get_queue_url(QueueName="dlq")["QueueUrl"]
    policy = client("sqs").get_queue_attributes(QueueUrl=queue_url, AttributeNames=["Policy"])["Attributes"]
    assert json.loads(policy["Policy"])["Statement"] == [QUEUE_STATEMENT]


def test_patch_cloudformation_event_invoke_config_is_put_on_its_function(runtime: runtime_module.Runtime) -> None:
    """What SAM makes of a function's EventInvokeConfig: AWS::Lambda::EventInvokeConfig on $LATEST."""
    resources = _function_stack_resources()
    resources["FnEventInvokeConfig"] = {
        "Type": "AWS::Lambda::EventInvokeConfig",
        "Properties": {
            "FunctionName": {"Ref": "Fn"},
            "Qualifier": "$LATEST",
            "MaximumRetryAttempts": 0,
            "MaximumEventAgeInSeconds": 600,
            "DestinationConfig": {},
        },
    }
    stack(resources)
    config = client("lambda").get_function_event_invoke_config(FunctionName="fn")
    assert (config["MaximumRetryAttempts"], config["MaximumEventAgeInSeconds"]) == (0, 600)


# ------------------------------------------------------------------------------------ (d) Step Functions
