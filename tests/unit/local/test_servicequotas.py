"""Service Quotas answers SageMaker's instance quotas as the local SageMaker enforces them."""

from __future__ import annotations

from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdflow.local import runtime as runtime_module
from sdflow.local.sagemaker import quotas
from tests.constants import ACCOUNT, REGION
from tests.unit.local.helpers import PROCESSING_REQUEST, client


def _all(operation: str, **params: Any) -> list[dict[str, Any]]:
    paginator = client("service-quotas").get_paginator(operation)
    return [quota for page in paginator.paginate(ServiceCode="sagemaker", **params) for quota in page["Quotas"]]


def test_moto_gap_no_list_service_quotas_and_no_sagemaker(aws: None) -> None:
    quotas_client = client("service-quotas")
    with pytest.raises(Exception, match=r"list_service_quotas|not.*implemented|NotImplemented"):
        quotas_client.list_service_quotas(ServiceCode="sagemaker")
    with pytest.raises(ClientError, match="NoSuchResource"):
        quotas_client.list_aws_default_service_quotas(ServiceCode="sagemaker")


def test_list_service_quotas_pages_aws_names_with_configured_values(runtime: runtime_module.Runtime) -> None:
    runtime.sagemaker_quotas = quotas.SageMakerQuotas(
        overrides={"endpoint": 1, "ml.m5.xlarge for processing job usage": 9}
    )
    first = client("service-quotas").list_service_quotas(ServiceCode="sagemaker", MaxResults=100)
    assert len(first["Quotas"]) == 100
    assert "NextToken" in first
    listed = {quota["QuotaName"]: quota for quota in _all("list_service_quotas")}
    assert len(listed) > 900
    processing = listed["ml.m5.xlarge for processing job usage"]
    assert processing["Value"] == 9.0
    assert processing["QuotaCode"] == quotas.quota_code("ml.m5.xlarge for processing job usage")
    assert processing["QuotaCode"].startswith("L-")
    assert len(processing["QuotaCode"]) == 10
    assert processing["QuotaArn"] == f"arn:aws:servicequotas:{REGION}:{ACCOUNT}:sagemaker/{processing['QuotaCode']}"
    assert listed["ml.m5.large for processing job usage"]["Value"] == 4.0
    assert listed["ml.g5.xlarge for training job usage"]["Value"] == 2.0
    assert listed["ml.g5.xlarge for spot training job usage"]["Value"] == 2.0
    assert listed["ml.g5.xlarge for endpoint usage"]["Value"] == 1.0
    defaults = {quota["QuotaName"]: quota["Value"] for quota in _all("list_aws_default_service_quotas")}
    assert defaults["ml.m5.xlarge for processing job usage"] == 4.0  # the by-name override is an applied value


def test_get_service_quota_matches_enforced_limit(runtime: runtime_module.Runtime) -> None:
    runtime.sagemaker_quotas = quotas.SageMakerQuotas(overrides={"processing job": 1})
    quotas_client = client("service-quotas")
    code = quotas.quota_code("ml.m5.xlarge for processing job usage")
    quota = quotas_client.get_service_quota(ServiceCode="sagemaker", QuotaCode=code)["Quota"]
    assert (quota["QuotaName"], quota["Value"]) == ("ml.m5.xlarge for processing job usage", 1.0)
    assert quotas_client.get_aws_default_service_quota(ServiceCode="sagemaker", QuotaCode=code)["Quota"]["Value"] == 1.0
    sagemaker = client("sagemaker")
    sagemaker.create_processing_job(**PROCESSING_REQUEST)
    with pytest.raises(ClientError, match=r"'ml.m5.xlarge for processing job usage' is 1 Instances"):
        sagemaker.create_processing_job(**{**PROCESSING_REQUEST, "ProcessingJobName": "second"})


def test_get_service_quota_unknown_code_no_such_resource(runtime: runtime_module.Runtime) -> None:
    quotas_client = client("service-quotas")
    with pytest.raises(ClientError) as missing:
        quotas_client.get_service_quota(ServiceCode="sagemaker", QuotaCode="L-00000000")
    assert missing.value.response["Error"]["Code"] == "NoSuchResourceException"
    with pytest.raises(ClientError, match="InvalidPaginationToken"):
        quotas_client.list_service_quotas(ServiceCode="sagemaker", NextToken="not-a-token")


def test_vpc_quotas_still_answered_by_moto(runtime: runtime_module.Runtime) -> None:
    vpc = client("service-quotas").list_aws_default_service_quotas(ServiceCode="vpc")["Quotas"]
    assert vpc
    assert all(quota["ServiceCode"] == "vpc" for quota in vpc)
