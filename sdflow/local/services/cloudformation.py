"""CloudFormation: the template's resources created the way the local runtime needs them."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from sdflow.local.patching import Patch, replace, wrap
from sdflow.local.runtime import PatchError

log = logging.getLogger(__name__)


def state_machine_create_from_cloudformation_json(
    cls: Any, resource_name: str, cloudformation_json: dict[str, Any], account_id: str, region_name: str, **kwargs: Any
) -> Any:
    """Replaces moto/stepfunctions/models.py StateMachine.create_from_cloudformation_json.

    moto always creates into the non-executing `stepfunctions_backends`, so with
    execute_state_machine=True the machine is invisible to StartExecution; it also ignores
    DefinitionSubstitutions, the Definition object and DefinitionS3Location. This creates the
    machine in the backend the API uses, with the substituted definition.
    LoggingConfiguration is left out on purpose: moto would write every history event to its
    CloudWatch Logs over HTTP, which costs more than the local runtime's whole orchestration."""
    from moto.stepfunctions.responses import get_backend

    properties = cloudformation_json["Properties"]
    definition = _definition_text(properties, account_id, region_name)
    for key, value in (properties.get("DefinitionSubstitutions") or {}).items():
        definition = definition.replace("${" + key + "}", str(value))
    tags = [{"key": tag["Key"], "value": tag["Value"]} for tag in properties.get("Tags", [])]
    return get_backend(account_id, region_name).create_state_machine(
        properties.get("StateMachineName", resource_name),
        definition,
        properties.get("RoleArn", ""),
        tags=tags,
        sm_type=properties.get("StateMachineType"),
    )


def _definition_text(properties: Mapping[str, Any], account_id: str, region_name: str) -> str:
    if "DefinitionString" in properties:
        return str(properties["DefinitionString"])
    if "Definition" in properties:
        return json.dumps(properties["Definition"])
    location = properties.get("DefinitionS3Location")
    if location:
        from moto.s3.models import s3_backends
        from moto.utilities.utils import get_partition

        backend = s3_backends[account_id][get_partition(region_name)]
        key = backend.get_object(location["Bucket"], location["Key"], location.get("Version"))
        if key is None:
            raise PatchError(f"DefinitionS3Location s3://{location['Bucket']}/{location['Key']} does not exist")
        return key.value.decode()
    raise PatchError("AWS::StepFunctions::StateMachine needs DefinitionString, Definition or DefinitionS3Location")


def bucket_create_from_cloudformation_json(
    inner: Any,
    cls: Any,
    resource_name: str,
    cloudformation_json: dict[str, Any],
    account_id: str,
    region_name: str,
    **kwargs: Any,
) -> Any:
    """Wraps moto/s3/models.py FakeBucket.create_from_cloudformation_json.

    moto honours BucketEncryption and Tags only. The template's
    NotificationConfiguration.EventBridgeConfiguration (manifest uploads start runs) and
    VersioningConfiguration (a run is named after the manifest's version) matter here."""
    from moto.s3.models import s3_backends
    from moto.utilities.utils import get_partition

    bucket = inner(cls, resource_name, cloudformation_json, account_id, region_name, **kwargs)
    properties = cloudformation_json.get("Properties", {})
    backend = s3_backends[account_id][get_partition(region_name)]
    notification = properties.get("NotificationConfiguration") or {}
    if notification.get("EventBridgeConfiguration", {}).get("EventBridgeEnabled", True) and (
        "EventBridgeConfiguration" in notification
    ):
        backend.put_bucket_notification_configuration(bucket.name, {"EventBridgeConfiguration": {}})
    versioning = (properties.get("VersioningConfiguration") or {}).get("Status")
    if versioning:
        backend.put_bucket_versioning(bucket.name, versioning)
    return bucket


def ecr_repository_create_from_cloudformation_json(
    inner: Any,
    cls: Any,
    resource_name: str,
    cloudformation_json: dict[str, Any],
    account_id: str,
    region_name: str,
    **kwargs: Any,
) -> Any:
    """Wraps moto/ecr/models.py Repository.create_from_cloudformation_json.

    The generated name (<stack>-<LogicalId>-<suffix>) keeps upper-case letters, which moto's
    own repository-name check then rejects; CloudFormation generates lower-case names."""
    return inner(cls, resource_name.lower(), cloudformation_json, account_id, region_name, **kwargs)


class _CfnResource:
    """A resource moto's CloudFormation does not model, created with the service's own backend."""

    def __init__(self, physical_id: str) -> None:
        self.physical_resource_id = physical_id

    @classmethod
    def has_cfn_attr(cls, attr: str) -> bool:
        return False

    def is_created(self) -> bool:
        return True

    @classmethod
    def delete_from_cloudformation_json(cls, *args: Any, **kwargs: Any) -> None:
        return None


class CfnBucketPolicy(_CfnResource):
    """AWS::S3::BucketPolicy: recorded, not enforced.

    moto has no CloudFormation model for it. Its put_bucket_policy enforces Principal "*"
    statements and ignores their Conditions, so the template's DenyInsecureTransport
    (Deny s3:* unless aws:SecureTransport) would deny every call to a local cloud that speaks
    HTTP. The policy is therefore only logged."""

    @classmethod
    def create_from_cloudformation_json(
        cls, resource_name: str, cloudformation_json: dict[str, Any], account_id: str, region_name: str, **kw: Any
    ) -> CfnBucketPolicy:
        bucket = cloudformation_json["Properties"].get("Bucket")
        log.info("bucket policy of %s not applied locally (moto would enforce it without its conditions)", bucket)
        return cls(resource_name)


class CfnQueuePolicy(_CfnResource):
    """AWS::SQS::QueuePolicy: moto has no CloudFormation model; set each queue's Policy attribute."""

    @classmethod
    def create_from_cloudformation_json(
        cls, resource_name: str, cloudformation_json: dict[str, Any], account_id: str, region_name: str, **kw: Any
    ) -> CfnQueuePolicy:
        from moto.sqs.models import sqs_backends

        properties = cloudformation_json["Properties"]
        backend = sqs_backends[account_id][region_name]
        for queue_url in properties.get("Queues", []):
            backend.set_queue_attributes(
                str(queue_url).rstrip("/").rsplit("/", 1)[-1], {"Policy": json.dumps(properties["PolicyDocument"])}
            )
        return cls(resource_name)


class CfnSchedule(_CfnResource):
    """AWS::Scheduler::Schedule: moto has no CloudFormation model; create it in moto's Scheduler.

    The schedule is listed and described like on AWS; moto does not fire schedules
    (scheduler.py does, on the local cloud's schedule clock)."""

    @classmethod
    def create_from_cloudformation_json(
        cls, resource_name: str, cloudformation_json: dict[str, Any], account_id: str, region_name: str, **kw: Any
    ) -> CfnSchedule:
        from moto.scheduler.models import scheduler_backends

        p = cloudformation_json["Properties"]
        schedule = scheduler_backends[account_id][region_name].create_schedule(
            description=p.get("Description", ""),
            end_date=p.get("EndDate"),
            flexible_time_window=p.get("FlexibleTimeWindow", {"Mode": "OFF"}),
            group_name=p.get("GroupName"),
            kms_key_arn=p.get("KmsKeyArn"),
            name=p.get("Name", resource_name),
            schedule_expression=p["ScheduleExpression"],
            schedule_expression_timezone=p.get("ScheduleExpressionTimezone"),
            start_date=p.get("StartDate"),
            state=p.get("State", "ENABLED"),
            target=p["Target"],
            action_after_completion=p.get("ActionAfterCompletion"),
        )
        return cls(schedule.arn)


class CfnEventInvokeConfig(_CfnResource):
    """AWS::Lambda::EventInvokeConfig (what SAM makes of a function's EventInvokeConfig): moto has
    no CloudFormation model; put it with moto's PutFunctionEventInvokeConfig, which refuses
    MaximumRetryAttempts over 2 and MaximumEventAgeInSeconds over 21,600 as Lambda does (the
    minimums, 0 and 60, are botocore's to check on the API path; cfn-lint checks the template). The
    asynchronous path honours MaximumRetryAttempts (services/awslambda.py); the event's age is not
    enforced (the local queue holds a throttled event until it runs)."""

    @classmethod
    def create_from_cloudformation_json(
        cls, resource_name: str, cloudformation_json: dict[str, Any], account_id: str, region_name: str, **kw: Any
    ) -> CfnEventInvokeConfig:
        from moto.awslambda.utils import get_backend

        properties = dict(cloudformation_json["Properties"])
        function = str(properties.pop("FunctionName"))
        properties.pop("Qualifier", None)
        get_backend(account_id, region_name).put_function_event_invoke_config(function, properties)
        return cls(resource_name)


EXTRA_CFN_MODELS: dict[str, type[_CfnResource]] = {
    "AWS::Lambda::EventInvokeConfig": CfnEventInvokeConfig,
    "AWS::S3::BucketPolicy": CfnBucketPolicy,
    "AWS::SQS::QueuePolicy": CfnQueuePolicy,
    "AWS::Scheduler::Schedule": CfnSchedule,
}


def cfn_resource_class_from_type(inner: Any, resource_type: str) -> Any:
    """Wraps moto/cloudformation/parsing.py resource_class_from_type: adds EXTRA_CFN_MODELS.

    moto skips resource types it does not model (with a warning) and the stack still
    completes; the types above are ones the template uses whose effect the local runtime needs
    or that a user may list (schedules)."""
    extra = EXTRA_CFN_MODELS.get(resource_type)
    if extra is not None:
        return extra

    return inner(resource_type)


def patches() -> list[Patch]:
    import moto.cloudformation.parsing as cfn_parsing
    from moto.ecr.models import Repository
    from moto.s3.models import FakeBucket
    from moto.stepfunctions.models import StateMachine

    return [
        replace(
            StateMachine, "create_from_cloudformation_json", classmethod(state_machine_create_from_cloudformation_json)
        ),
        wrap(FakeBucket, "create_from_cloudformation_json", bucket_create_from_cloudformation_json),
        wrap(Repository, "create_from_cloudformation_json", ecr_repository_create_from_cloudformation_json),
        wrap(cfn_parsing, "resource_class_from_type", cfn_resource_class_from_type),
    ]
