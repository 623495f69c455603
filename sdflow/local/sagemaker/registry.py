"""SageMaker Model Registry: model package groups and versioned model packages, held to AWS's rules.

The pipeline registers each trained model as a version of a model package group, a person approves it
(`aws sagemaker update-model-package --model-approval-status Approved`), and the "SageMaker Model Package
State Change" event carries the approval to the deploy step. moto 5.2.5 records the calls but:

- CreateModelPackageGroup accepts any name and silently replaces an existing group. AWS checks the name
  (1-63 characters, `[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}`: CreateModelPackageGroup request reference) and
  refuses a second group of that name with ValidationException "Model Package Group already exists: <arn>"
  (the message the SageMaker CloudFormation resource provider matches).
- CreateModelPackage ignores ClientToken ("A unique token that guarantees that the call to this API is
  idempotent"): a retried call made a second version. Here the same token in the same group returns the
  first call's ARN and changes nothing. boto3 fills in a fresh token when the caller gives none.
- CreateModelPackage leaves ModelApprovalStatus empty when omitted; a versioned package starts
  PendingManualApproval, as the Developer Guide's "Update the Approval Status of a Model" describes. A
  group given by ARN (the request allows one) is looked up by its name; a group that does not exist is
  refused with DescribeModelPackageGroup's ValidationException "ModelPackageGroup <arn> does not exist.".
- UpdateModelPackage overwrites ModelApprovalStatus, ApprovalDescription and CustomerMetadataProperties
  with None when the request omits them. Here only what the request names changes; metadata keys are
  merged and CustomerMetadataPropertiesToRemove deletes keys.
- No event is sent. Here each creation, and each update that changes the package, puts "SageMaker Model
  Package State Change" (source aws.sagemaker) on the default bus: detail shaped as the Developer Guide's
  example (DescribeModelPackage's fields, times as ISO 8601 strings "2021-02-24T17:00:14Z", not the epoch
  milliseconds of the job events), Resources [the package ARN].

`serving_container` resolves a model whose container names a model package (CreateModel's
`ModelPackageName`) for LocalSageMaker: a versioned package must be Approved to be deployed (CreateModelPackage
reference: "the value of this parameter must be set to Approved to deploy the model")."""

from __future__ import annotations

import datetime as dt
import json
import re
import threading
from collections.abc import Mapping
from typing import Any

from sdflow.local.account import ACCOUNT_ID
from sdflow.local.patching import Patch, replace, wrap
from sdflow.local.runtime import current_clock, runtime_or_none
from sdflow.local.sagemaker import limits

DETAIL_TYPE = "SageMaker Model Package State Change"
APPROVAL_STATUSES = ("Approved", "Rejected", "PendingManualApproval")
DEFAULT_APPROVAL = "PendingManualApproval"
GROUP_NAME = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}")
GROUP_NAME_MAX = 63
CLIENT_TOKEN = re.compile(r"[a-zA-Z0-9-]+")
CLIENT_TOKEN_MAX = 36
_ARN = re.compile(r"arn:aws[a-z-]*:sagemaker:([a-z0-9-]+):([0-9]{12}):([a-z-]+)/(.+)")
# Not part of the event: moto's invented Studio user (AWS names a user only for Studio callers).
_NOT_IN_EVENT = ("CreatedBy", "LastModifiedBy")
# A version number is read and taken in one step; the moto server answers requests on many threads.
_lock = threading.Lock()


class ModelPackageUnusable(Exception):
    """A model names a model package that cannot be served (missing, not approved, no container)."""


def _validation_error(errors: list[str]) -> Exception:
    from moto.sagemaker.exceptions import ValidationError

    noun = "error" if len(errors) == 1 else "errors"
    return ValidationError(message=f"{len(errors)} validation {noun} detected: {'; '.join(errors)}")


def _constraint(value: Any, field_name: str, rule: str) -> str:
    return f"Value '{value}' at '{field_name}' failed to satisfy constraint: Member must {rule}"


def _check_approval_status(value: Any) -> list[str]:
    if value is None or value in APPROVAL_STATUSES:
        return []
    return [_constraint(value, "modelApprovalStatus", f"satisfy enum value set: [{', '.join(APPROVAL_STATUSES)}]")]


def _group_arn(response: Any, name: str) -> str:
    return f"arn:aws:sagemaker:{response.region}:{response.current_account}:model-package-group/{name}"


def _group_name(value: str) -> str:
    """CreateModelPackage takes the group's name or its ARN (…:model-package-group/<name>)."""
    match = _ARN.fullmatch(value)
    return match.group(4) if match and match.group(3) == "model-package-group" else value


def _iso(value: Any) -> Any:
    """Model package events carry times as ISO 8601 UTC strings to the second (Developer Guide example)."""
    if isinstance(value, dt.datetime):
        aware = value if value.tzinfo else value.replace(tzinfo=dt.UTC)
        return aware.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if isinstance(value, dict):
        return {k: _iso(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_iso(v) for v in value]
    return value


def event_detail(package: Any) -> dict[str, Any]:
    """The event's detail: DescribeModelPackage's answer, times as AWS puts them in this event."""
    described = {k: v for k, v in package.gen_response_object().items() if k not in _NOT_IN_EVENT}
    return dict(_iso(described))


def _publish(package: Any, account: str, region: str) -> None:
    from sdflow.local.services.events import publish_as_service

    event = {
        "Source": "aws.sagemaker",
        "DetailType": DETAIL_TYPE,
        "Detail": json.dumps(event_detail(package)),
        "Resources": [package.arn],
        "Time": current_clock().time(),
    }
    [entry] = publish_as_service([event], account, region)
    event["EventId"] = entry.get("EventId")
    # Kept with the SageMaker job events, so that sdflow/local/faults.py can deliver it again.
    runtime = runtime_or_none()
    listener = getattr(runtime.sagemaker, "listener", None) if runtime else None
    if listener is not None and hasattr(listener, "published"):
        with listener.lock:
            listener.published.append(event)


def sagemaker_create_model_package_group(inner: Any, self: Any) -> Any:
    """Wraps moto/sagemaker/responses.py SageMakerResponse.create_model_package_group: the name
    rules, and a second group of the same name refused (moto replaces the first)."""
    name = self._get_param("ModelPackageGroupName") or ""
    errors = []
    if len(name) > GROUP_NAME_MAX:
        errors.append(_constraint(name, "modelPackageGroupName", f"have length less than or equal to {GROUP_NAME_MAX}"))
    if not GROUP_NAME.fullmatch(name):
        errors.append(
            _constraint(name, "modelPackageGroupName", f"satisfy regular expression pattern: {GROUP_NAME.pattern}")
        )
    if errors:
        raise _validation_error(errors)
    with _lock:
        groups = self.sagemaker_backend.model_package_groups
        # SageMaker ARNs are case-insensitive, so "Models" and "models" would be one resource.
        existing = next((group for key, group in groups.items() if key.lower() == name.lower()), None)
        if existing is not None:
            from moto.sagemaker.exceptions import ValidationError

            raise ValidationError(message=f"Model Package Group already exists: {existing.arn}")
        return inner(self)


def sagemaker_create_model_package(inner: Any, self: Any) -> Any:
    """Wraps moto/sagemaker/responses.py SageMakerResponse.create_model_package: ClientToken
    idempotency, the approval status checked and defaulted, the group by name or ARN and required
    to exist, and the state-change event."""
    from moto.core.responses import ActionResult
    from moto.sagemaker.exceptions import ValidationError

    # The maximums and patterns of the service model (AdditionalModelDataSources' channel names and S3
    # sources, CustomerMetadataProperties' characters …), as SageMaker checks them before creating anything.
    limits.check("CreateModelPackage", json.loads(self.body or "{}"))
    group = self._get_param("ModelPackageGroupName")
    token = self._get_param("ClientToken")
    errors = _check_approval_status(self._get_param("ModelApprovalStatus"))
    if token is not None and (len(token) > CLIENT_TOKEN_MAX or not CLIENT_TOKEN.fullmatch(token)):
        errors.append(_constraint(token, "clientToken", f"satisfy regular expression pattern: {CLIENT_TOKEN.pattern}"))
    if errors:
        raise _validation_error(errors)
    backend = self.sagemaker_backend
    with _lock:
        if group:
            group = _group_name(group)
            self.params["ModelPackageGroupName"] = group  # moto reads the request's parameters
            if group not in backend.model_package_groups:
                raise ValidationError(message=f"ModelPackageGroup {_group_arn(self, group)} does not exist.")
        if token is not None:
            for package in backend.model_packages.values():
                if package.client_token == token and package.model_package_group_name == group:
                    return ActionResult({"ModelPackageArn": package.arn})  # the retried call's answer
        result = inner(self)
        package = backend.model_packages[
            backend.model_package_name_mapping[group or self._get_param("ModelPackageName")]
        ]
        if group and package.model_approval_status is None:
            package.model_approval_status = DEFAULT_APPROVAL
        package.last_modified_time = package.creation_time  # as in the Developer Guide's event example
    _publish(package, self.current_account, self.region)
    return result


def sagemaker_update_model_package(self: Any) -> Any:
    """Replaces moto/sagemaker/responses.py SageMakerResponse.update_model_package: only the fields
    the request names change (moto sets the others to None), and a change publishes the event."""
    from moto.core.responses import ActionResult

    errors = _check_approval_status(self._get_param("ModelApprovalStatus"))
    if errors:
        raise _validation_error(errors)
    arn = self._get_param("ModelPackageArn")
    with _lock:
        package = self.sagemaker_backend.describe_model_package(arn)  # moto's error when there is none
        before = event_detail(package)
        if self._get_param("ModelApprovalStatus") is not None:
            package.model_approval_status = self._get_param("ModelApprovalStatus")
        if self._get_param("ApprovalDescription") is not None:
            package.approval_description = self._get_param("ApprovalDescription")
        metadata = dict(package.customer_metadata_properties or {})
        metadata.update(self._get_param("CustomerMetadataProperties") or {})
        for key in self._get_param("CustomerMetadataPropertiesToRemove") or []:
            metadata.pop(key, None)
        package.customer_metadata_properties = metadata or None
        if self._get_param("AdditionalInferenceSpecificationsToAdd"):
            package.add_additional_inference_specifications(self._get_param("AdditionalInferenceSpecificationsToAdd"))
        changed = event_detail(package) != before
        if changed:
            package.modifications_done()
    if changed:
        _publish(package, self.current_account, self.region)
    return ActionResult({"ModelPackageArn": package.arn})


def serving_container(container: Mapping[str, Any], endpoint_name: str, region: str) -> dict[str, Any]:
    """The container a model serves when it names a model package (`ModelPackageName`, a name or an ARN)
    instead of an image and artifact: the package's InferenceSpecification.Containers[0], with the
    model's own Environment over the package's. A name is looked up in the endpoint's account and region
    (the model's: CreateEndpoint takes a model of its own account and region)."""
    from moto.sagemaker.models import sagemaker_backends

    reference = str(container["ModelPackageName"])
    match = _ARN.fullmatch(reference)
    if match:
        region, account = match.group(1), match.group(2)
        arn = reference
    else:
        runtime = runtime_or_none()
        where = runtime.sagemaker_where.get(("endpoint", endpoint_name)) if runtime else None
        account, region = where or (ACCOUNT_ID, region)
        arn = f"arn:aws:sagemaker:{region}:{account}:model-package/{reference.lower()}"
    package = sagemaker_backends[account][region].model_packages.get(arn)
    if package is None:
        raise ModelPackageUnusable(
            f"model package {reference} does not exist in account {account}, region {region}: register the "
            "model with CreateModelPackage and name that version's ARN in the model's ModelPackageName"
        )
    if package.model_package_group_name and package.model_approval_status != "Approved":
        raise ModelPackageUnusable(
            f"model package {arn} is {package.model_approval_status}, and only an Approved version can be deployed: "
            f"approve it with `aws sagemaker update-model-package --model-package-arn {arn} "
            "--model-approval-status Approved`, then deploy again"
        )
    containers = (package.inference_specification or {}).get("Containers") or []
    if not containers:
        raise ModelPackageUnusable(f"model package {arn} has no InferenceSpecification.Containers to serve")
    resolved = dict(containers[0])
    environment = {**(resolved.get("Environment") or {}), **(container.get("Environment") or {})}
    if environment:
        resolved["Environment"] = environment
    return resolved


def patches() -> list[Patch]:
    from moto.sagemaker.responses import SageMakerResponse

    return [
        wrap(SageMakerResponse, "create_model_package_group", sagemaker_create_model_package_group),
        wrap(SageMakerResponse, "create_model_package", sagemaker_create_model_package),
        replace(SageMakerResponse, "update_model_package", sagemaker_update_model_package),
    ]
