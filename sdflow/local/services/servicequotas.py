"""Service Quotas: SageMaker's instance quotas, answering what the local SageMaker enforces.

moto 5.2.5 (moto/servicequotas/) knows only service code `vpc`, for ListAWSDefaultServiceQuotas
and GetServiceQuota, and has no ListServiceQuotas at all. Here service code `sagemaker` answers
ListServiceQuotas, ListAWSDefaultServiceQuotas, GetServiceQuota and GetAWSDefaultServiceQuota
from the runtime's SageMakerQuotas (sagemaker/quotas.py), so a caller that reads its
quotas before starting jobs sees exactly the limits that ResourceLimitExceeded enforces.

What is listed: one quota per instance type SageMaker accepts for the use (the enums
ProcessingInstanceType, TrainingInstanceType, ProductionVariantInstanceType of botocore's
SageMaker model; well over 900 quotas, as on AWS where SageMaker has over a thousand), named as
AWS names them ("ml.m5.xlarge for processing job usage", "… for training job usage",
"… for spot training job usage", "… for endpoint usage"), plus any quota configured by name.
ListAWSDefaultServiceQuotas gives the account's defaults (use-level overrides count as the
defaults), ListServiceQuotas the values in force. AWS says ListServiceQuotas may leave out a
quota whose applied value is unavailable; the local one always has every value, so lists all.
Pages hold at most MaxResults (1-100, API reference ListServiceQuotas). QuotaCodes have AWS's
form (L- and 8 hex digits) but are local stand-ins (sagemaker_quotas.quota_code); callers
should find quotas by name, as ResourceLimitExceeded quotes the name."""

from __future__ import annotations

import functools
import json
from typing import Any

from moto.core.exceptions import JsonRESTError

from sdflow.local.patching import Patch, add, wrap
from sdflow.local.runtime import runtime_or_none
from sdflow.local.sagemaker import quotas

SERVICE_CODE = "sagemaker"
SERVICE_NAME = "Amazon SageMaker"
MAX_RESULTS = 100
INSTANCE_TYPE_ENUMS = {
    "processing job": "ProcessingInstanceType",
    "training job": "TrainingInstanceType",
    "spot training job": "TrainingInstanceType",
    "endpoint": "ProductionVariantInstanceType",
}


class NoSuchResourceException(JsonRESTError):
    """Service Quotas' answer for a quota code it does not have (HTTP 400)."""

    def __init__(self, message: str) -> None:
        super().__init__("NoSuchResourceException", message)


class InvalidPaginationTokenException(JsonRESTError):
    def __init__(self) -> None:
        super().__init__("InvalidPaginationTokenException", "Invalid NextToken")


class IllegalArgumentException(JsonRESTError):
    def __init__(self, message: str) -> None:
        super().__init__("IllegalArgumentException", message)


@functools.cache
def _enum_quota_names() -> tuple[str, ...]:
    import botocore.session

    model = botocore.session.get_session().get_service_model("sagemaker")
    names = {
        quotas.quota_name(instance_type, use)
        for use, shape in INSTANCE_TYPE_ENUMS.items()
        for instance_type in getattr(model.shape_for(shape), "enum", [])  # a StringShape's enum
    }
    return tuple(sorted(names))


def _state() -> quotas.SageMakerQuotas:
    runtime = runtime_or_none()
    return runtime.sagemaker_quotas if runtime is not None else quotas.SageMakerQuotas()


def _quota_names(state: quotas.SageMakerQuotas) -> list[str]:
    return sorted({*_enum_quota_names(), *state.named_overrides()})


def _quota(name: str, value: int, region: str, account: str) -> dict[str, Any]:
    code = quotas.quota_code(name)
    return {
        "ServiceCode": SERVICE_CODE,
        "ServiceName": SERVICE_NAME,
        "QuotaArn": f"arn:aws:servicequotas:{region}:{account}:{SERVICE_CODE}/{code}",
        "QuotaCode": code,
        "QuotaName": name,
        "Value": float(value),
        "Unit": "None",
        "Adjustable": True,
        "GlobalQuota": False,
        "QuotaAppliedAtLevel": "ACCOUNT",
    }


def _by_code(state: quotas.SageMakerQuotas, code: str) -> str:
    for name in _quota_names(state):
        if quotas.quota_code(name) == code:
            return name
    raise NoSuchResourceException(f"The request failed because the specified quota {code} does not exist.")


def _page(self: Any, default: bool) -> str:
    params = json.loads(self.body or "{}")
    state = _state()
    names = _quota_names(state)
    if params.get("QuotaCode"):
        names = [_by_code(state, params["QuotaCode"])]
    max_results = int(params.get("MaxResults") or MAX_RESULTS)
    if not 1 <= max_results <= MAX_RESULTS:
        raise IllegalArgumentException(f"MaxResults must be between 1 and {MAX_RESULTS}, got {max_results}")
    token = params.get("NextToken")
    start = 0
    if token is not None:
        if not str(token).isdigit() or int(token) >= len(names):
            raise InvalidPaginationTokenException()
        start = int(token)
    # Applied quota ARNs carry the account; AWS default quotas are listed without one.
    account = "" if default else self.current_account
    page = [
        _quota(name, state.default_limit(name) if default else state.limit(name), self.region, account)
        for name in names[start : start + max_results]
    ]
    answer: dict[str, Any] = {"Quotas": page}
    if start + max_results < len(names):
        answer["NextToken"] = str(start + max_results)
    return json.dumps(answer)


def _service_code(self: Any) -> str:
    return str(json.loads(self.body or "{}").get("ServiceCode", ""))


def list_service_quotas(self: Any) -> str:
    """Adds ServiceQuotasResponse.list_service_quotas (moto has none): the values in force."""
    if _service_code(self) != SERVICE_CODE:
        raise NoSuchResourceException(f"Service Quotas has no quotas of service {_service_code(self)!r} locally.")
    return _page(self, default=False)


def list_aws_default_service_quotas(inner: Any, self: Any) -> str:
    """Wraps ServiceQuotasResponse.list_aws_default_service_quotas: `sagemaker` answered here."""
    if _service_code(self) != SERVICE_CODE:
        return str(inner(self))
    return _page(self, default=True)


def get_service_quota(inner: Any, self: Any) -> str:
    """Wraps ServiceQuotasResponse.get_service_quota: `sagemaker` answered here."""
    if _service_code(self) != SERVICE_CODE:
        return str(inner(self))
    state = _state()
    name = _by_code(state, str(json.loads(self.body or "{}").get("QuotaCode", "")))
    return json.dumps({"Quota": _quota(name, state.limit(name), self.region, self.current_account)})


def get_aws_default_service_quota(self: Any) -> str:
    """Adds ServiceQuotasResponse.get_aws_default_service_quota (moto has none) for `sagemaker`."""
    if _service_code(self) != SERVICE_CODE:
        raise NoSuchResourceException(f"Service Quotas has no quotas of service {_service_code(self)!r} locally.")
    state = _state()
    name = _by_code(state, str(json.loads(self.body or "{}").get("QuotaCode", "")))
    return json.dumps({"Quota": _quota(name, state.default_limit(name), self.region, "")})


def patches() -> list[Patch]:
    from moto.servicequotas.responses import ServiceQuotasResponse

    return [
        add(ServiceQuotasResponse, "list_service_quotas", list_service_quotas),
        wrap(ServiceQuotasResponse, "list_aws_default_service_quotas", list_aws_default_service_quotas),
        wrap(ServiceQuotasResponse, "get_service_quota", get_service_quota),
        add(ServiceQuotasResponse, "get_aws_default_service_quota", get_aws_default_service_quota),
    ]
