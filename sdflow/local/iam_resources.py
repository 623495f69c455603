"""Which IAM actions, on which resource ARNs, with which condition keys, one request needs.

The ARN formats and resource types are those of the Service Authorization Reference
(docs.aws.amazon.com/service-authorization/latest/reference/, "Actions, resources, and condition
keys for <service>"). Requests that also need a permission besides their own action:
- iam:PassRole on the role a SageMaker Create* request hands over (with iam:PassedToService),
  as the SageMaker Developer Guide's "Passing roles" section requires;
- sagemaker:AddTags on the new resource when a SageMaker Create* request carries Tags (tags set
  on create are authorized as AddTags, as the template's own policies anticipate);
- s3:GetObject on the source of a CopyObject / UploadPartCopy;
- cloudwatch:DescribeAlarms on each alarm a CreateEndpoint / UpdateEndpoint names for automatic
  rollback (the Developer Guide's "Auto-Rollback Configuration and Monitoring": "Ensure that your
  IAM execution role has permission to perform the cloudwatch:DescribeAlarms action on the
  auto-rollback alarms you specify"; enforced here on the caller).
SendTaskSuccess / SendTaskFailure / SendTaskHeartbeat: the reference lists no resource type, yet
AWS authorizes them against the state machine of the task's execution ("not authorized to perform:
states:SendTaskFailure on resource: arn:aws:states:…:stateMachine:…"); for a Distributed Map child
that is the child's own `stateMachine:<name>/<label>` ARN.
An operation not listed returns None: the caller evaluates it against Resource "*"."""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Params = dict[str, Any]


@dataclass(frozen=True)
class Check:
    action: str  # "s3:GetObject"
    resource: str  # an ARN, or "*"
    context: Mapping[str, list[str]] = field(default_factory=dict)  # lower-case condition keys


# Request context keys every request carries locally: the local endpoint stands in for AWS's
# HTTPS one, so aws:SecureTransport is what it would be there.
_GLOBAL = {"aws:securetransport": ["true"]}


def _ctx(**extra: list[str]) -> dict[str, list[str]]:
    return {**_GLOBAL, **{k.replace("__", ":").lower(): v for k, v in extra.items()}}


# ------------------------------------------------------------------------------ S3


def s3_checks(
    action: str, bucket: str | None, key: str | None, headers: Mapping[str, str], params: Params
) -> list[Check]:
    """moto's S3 handlers name the IAM action already (moto/s3/responses.py ACTION_MAP)."""
    action = {"HeadBucket": "ListBucket"}.get(action, action)  # HeadBucket is authorized as s3:ListBucket
    if bucket is None:
        resource = "*"
    elif key:
        resource = f"arn:aws:s3:::{bucket}/{key}"
    else:
        resource = f"arn:aws:s3:::{bucket}"
    context = _ctx()
    if action in ("ListBucket", "ListBucketVersions") and "prefix" in params:
        context["s3:prefix"] = [str(params["prefix"])]
    checks = [Check(f"s3:{action}", resource, context)]
    source = headers.get("x-amz-copy-source")
    if source and action == "PutObject":
        path = urllib.parse.unquote(source.split("?", 1)[0]).lstrip("/")
        checks.append(Check("s3:GetObject", f"arn:aws:s3:::{path}", _ctx()))
    return checks


# ------------------------------------------------------------------------------ other services


def _arn(service: str, region: str, account: str, resource: str) -> str:
    return f"arn:aws:{service}:{region}:{account}:{resource}"


def _lambda(operation: str, p: Params, region: str, account: str) -> list[Check] | None:
    name = str(p.get("FunctionName") or "")
    if not name:
        return None
    action = {"Invoke": "InvokeFunction", "InvokeAsync": "InvokeFunction"}.get(operation, operation)
    if name.startswith("arn:"):
        arn = name
    elif ":function:" in name:  # "123456789012:function:name[:qualifier]"
        arn = f"arn:aws:lambda:{region}:{name}"
    else:
        arn = _arn("lambda", region, account, f"function:{name}")
    if p.get("Qualifier") and arn.count(":") == 6:
        arn += f":{p['Qualifier']}"
    return [Check(f"lambda:{action}", arn, _ctx())]


_DYNAMODB_BATCH = {"BatchWriteItem", "BatchGetItem"}
_DYNAMODB_TRANSACT = {
    "Put": "PutItem",
    "Update": "UpdateItem",
    "Delete": "DeleteItem",
    "ConditionCheck": "ConditionCheckItem",
}


def _dynamodb(operation: str, p: Params, region: str, account: str) -> list[Check] | None:
    def table(name: str, index: str | None = None) -> str:
        if name.startswith("arn:"):
            return name
        return _arn("dynamodb", region, account, f"table/{name}" + (f"/index/{index}" if index else ""))

    if operation in _DYNAMODB_BATCH:
        return [Check(f"dynamodb:{operation}", table(name), _ctx()) for name in p.get("RequestItems") or {}]
    if operation == "TransactWriteItems":
        checks = []
        for item in p.get("TransactItems") or []:
            for kind, body in item.items():
                checks.append(Check(f"dynamodb:{_DYNAMODB_TRANSACT[kind]}", table(body["TableName"]), _ctx()))
        return checks
    if operation == "TransactGetItems":
        return [Check("dynamodb:GetItem", table(i["Get"]["TableName"]), _ctx()) for i in p.get("TransactItems") or []]
    if p.get("TableName"):
        return [Check(f"dynamodb:{operation}", table(str(p["TableName"]), p.get("IndexName")), _ctx())]
    return None


def _task_token_owner(responder: Any, token: str) -> str | None:
    """The state machine ARN a task token's SendTask* is authorized against, or None for a
    token no running execution knows (moto then answers InvalidToken / TaskDoesNotExist)."""
    from sdflow.local.runtime import runtime_or_none

    runtime = runtime_or_none()
    if runtime is not None and runtime.iam is not None and token in runtime.iam.token_owners:
        return str(runtime.iam.token_owners[token])
    backend = responder.stepfunction_backend
    for execution in backend._get_executions():  # moto's own lookup, as send_task_success does
        worker = getattr(execution, "exec_worker", None)
        if worker is not None and worker.env.callback_pool_manager.get(token) is not None:
            return str(execution.state_machine_arn)
    return None


_SFN_RESOURCE_PARAM = {
    "StartExecution": "stateMachineArn",
    "StartSyncExecution": "stateMachineArn",
    "DescribeStateMachine": "stateMachineArn",
    "DescribeExecution": "executionArn",
    "StopExecution": "executionArn",
    "GetExecutionHistory": "executionArn",
    "DescribeStateMachineForExecution": "executionArn",
    "RedriveExecution": "executionArn",
    "DescribeMapRun": "mapRunArn",
    "ListMapRuns": "executionArn",
}


def _states(responder: Any, operation: str, p: Params) -> list[Check] | None:
    if operation in ("SendTaskSuccess", "SendTaskFailure", "SendTaskHeartbeat"):
        owner = _task_token_owner(responder, str(p.get("taskToken") or ""))
        return [] if owner is None else [Check(f"states:{operation}", owner, _ctx())]
    if operation == "ListExecutions":
        arn = p.get("stateMachineArn") or p.get("mapRunArn")
        return [Check("states:ListExecutions", str(arn), _ctx())] if arn else None
    param = _SFN_RESOURCE_PARAM.get(operation)
    if param and p.get(param):
        return [Check(f"states:{operation}", str(p[param]), _ctx())]
    return None


# SageMaker: operation -> (resource type in the ARN, the request field naming it)
_SAGEMAKER: dict[str, tuple[str, str]] = {}
for _verb in ("Create", "Describe", "Stop", "Delete"):
    _SAGEMAKER[f"{_verb}ProcessingJob"] = ("processing-job", "ProcessingJobName")
    _SAGEMAKER[f"{_verb}TrainingJob"] = ("training-job", "TrainingJobName")
_SAGEMAKER["UpdateTrainingJob"] = ("training-job", "TrainingJobName")
for _verb in ("Create", "Describe", "Delete"):
    _SAGEMAKER[f"{_verb}Model"] = ("model", "ModelName")
    _SAGEMAKER[f"{_verb}EndpointConfig"] = ("endpoint-config", "EndpointConfigName")
for _verb in ("Create", "Describe", "Delete", "Update", "Invoke"):
    _SAGEMAKER[f"{_verb}Endpoint"] = ("endpoint", "EndpointName")
_SAGEMAKER["InvokeEndpointAsync"] = ("endpoint", "EndpointName")
for _verb in ("Create", "Describe", "Delete"):
    _SAGEMAKER[f"{_verb}ModelPackageGroup"] = ("model-package-group", "ModelPackageGroupName")
# A new version's ARN is model-package/<group>/<n>; the request names only the group.
_SAGEMAKER["CreateModelPackage"] = ("model-package", "ModelPackageGroupName")
# These name a package by its ARN (versioned) or its name (unversioned).
_SAGEMAKER_BY_ARN: dict[str, str] = {
    "DescribeModelPackage": "ModelPackageName",
    "UpdateModelPackage": "ModelPackageArn",
    "DeleteModelPackage": "ModelPackageName",
}
_PASSED_ROLE_FIELD = {
    "CreateProcessingJob": "RoleArn",
    "CreateTrainingJob": "RoleArn",
    "CreateModel": "ExecutionRoleArn",
}


def _sagemaker(operation: str, p: Params, region: str, account: str) -> list[Check] | None:
    if operation in ("AddTags", "ListTags", "DeleteTags") and p.get("ResourceArn"):
        return [Check(f"sagemaker:{operation}", str(p["ResourceArn"]), _ctx())]
    by_arn = p.get(_SAGEMAKER_BY_ARN.get(operation, ""))
    if by_arn:
        named = str(by_arn)
        resource = named if named.startswith("arn:") else _arn("sagemaker", region, account, f"model-package/{named}")
        return [Check(f"sagemaker:{operation}", resource.lower(), _ctx())]
    target = _SAGEMAKER.get(operation)
    if target is None or not p.get(target[1]):
        return None
    # SageMaker ARNs carry the resource name in lower case.
    arn = _arn("sagemaker", region, account, f"{target[0]}/{str(p[target[1]]).lower()}")
    checks = [Check(f"sagemaker:{operation}", arn, _ctx())]
    role = p.get(_PASSED_ROLE_FIELD.get(operation, ""))
    if role:
        checks.append(Check("iam:PassRole", str(role), _ctx(iam__PassedToService=["sagemaker.amazonaws.com"])))
    if operation.startswith("Create") and p.get("Tags"):
        checks.append(Check("sagemaker:AddTags", arn, _ctx()))
    rollback = ((p.get("DeploymentConfig") or {}).get("AutoRollbackConfiguration") or {}).get("Alarms") or []
    for alarm in rollback:  # SageMaker reads the alarms it is to watch as the caller
        name = str(alarm.get("AlarmName", ""))
        checks.append(Check("cloudwatch:DescribeAlarms", _arn("cloudwatch", region, account, f"alarm:{name}"), _ctx()))
    return checks


def _sns(operation: str, p: Params, region: str, account: str) -> list[Check] | None:
    arn = p.get("TopicArn") or p.get("TargetArn")
    if operation == "Publish" and p.get("PhoneNumber"):
        return [Check("sns:Publish", "*", _ctx())]
    return [Check(f"sns:{operation}", str(arn), _ctx())] if arn else None


def _sqs(operation: str, p: Params, region: str, account: str) -> list[Check] | None:
    url = str(p.get("QueueUrl") or "")
    if not url:
        return None
    parts = urllib.parse.urlparse(url).path.strip("/").split("/")
    owner, name = (parts[0], parts[1]) if len(parts) == 2 else (account, parts[-1])
    return [Check(f"sqs:{operation}", _arn("sqs", region, owner, name), _ctx())]


def _events(operation: str, p: Params, region: str, account: str) -> list[Check] | None:
    if operation != "PutEvents":
        return None
    buses = {str(e.get("EventBusName") or "default") for e in p.get("Entries") or []}
    return [
        Check(
            "events:PutEvents",
            bus if bus.startswith("arn:") else _arn("events", region, account, f"event-bus/{bus}"),
            _ctx(),
        )
        for bus in sorted(buses)
    ]


def _logs(operation: str, p: Params, region: str, account: str) -> list[Check] | None:
    group = p.get("logGroupName")
    if not group:
        return None
    resource = f"log-group:{group}"
    if operation in ("CreateLogStream", "PutLogEvents") and p.get("logStreamName"):
        resource += f":log-stream:{p['logStreamName']}"
    return [Check(f"logs:{operation}", _arn("logs", region, account, resource), _ctx())]


def _cloudwatch(operation: str, p: Params, region: str, account: str) -> list[Check] | None:
    if operation != "PutMetricData":
        return None
    # PutMetricData has no resource-level permissions; cloudwatch:namespace scopes it.
    return [Check("cloudwatch:PutMetricData", "*", _ctx(cloudwatch__namespace=[str(p.get("Namespace") or "")]))]


def _servicequotas(operation: str, p: Params, region: str, account: str) -> list[Check] | None:
    if operation in ("GetServiceQuota", "GetAWSDefaultServiceQuota") and p.get("ServiceCode") and p.get("QuotaCode"):
        resource = f"{p['ServiceCode']}/{p['QuotaCode']}"
        arn = _arn("servicequotas", region, account if operation == "GetServiceQuota" else "", resource)
        return [Check(f"servicequotas:{operation}", arn, _ctx())]
    if operation in ("ListServiceQuotas", "ListAWSDefaultServiceQuotas", "ListServices"):
        return [Check(f"servicequotas:{operation}", "*", _ctx())]
    return None


_BY_SERVICE: dict[str, Callable[[str, Params, str, str], list[Check] | None]] = {
    "lambda": _lambda,
    "dynamodb": _dynamodb,
    "sagemaker": _sagemaker,
    "sns": _sns,
    "sqs": _sqs,
    "events": _events,
    "logs": _logs,
    "cloudwatch": _cloudwatch,
    "servicequotas": _servicequotas,
}


def checks(
    responder: Any, service: str, operation: str, params: Params, region: str, account: str
) -> list[Check] | None:
    """The checks for a non-S3 request to `service` (its IAM prefix); [] for one that needs
    none, None for an operation not mapped here."""
    if service == "sts" and operation == "GetCallerIdentity":
        return []  # "No permissions are required to perform this operation" (STS API reference)
    if service == "states":
        return _states(responder, operation, params)
    derive = _BY_SERVICE.get(service)
    return derive(operation, params, region, account) if derive else None
