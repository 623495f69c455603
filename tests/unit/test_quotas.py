"""quotas: SageMaker instance quotas from Service Quotas cap the download concurrency at validation.

moto lists no SageMaker quotas, so Service Quotas is played by botocore's Stubber with the
response shapes of ListServiceQuotas / ListAWSDefaultServiceQuotas."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from sdflow_common import quotas
from sdflow_common.errors import InvalidRunDocument
from sdflow_common.run_document import RunDocument
from sdflow_common.validate_run import ValidateRunRequest, validate_run
from tests.constants import ACCOUNT, REGION
from tests.unit.helpers import DATA_BUCKET, AwsWorld
from tests.unit.parquet_files import parquet_bytes

PROCESSING = "ml.c5.xlarge for processing job usage"
TRAINING = "ml.g5.12xlarge for training job usage"
ENDPOINT = "ml.g5.xlarge for endpoint usage"
LISTING = {"ServiceCode": "sagemaker"}


def quota(name: str, value: float) -> dict[str, Any]:
    """One entry of ListServiceQuotas' `Quotas`, as Service Quotas returns it."""
    return {"ServiceCode": "sagemaker", "QuotaCode": "L-0A1B2C3D", "QuotaName": name, "Value": value}


def config(**document: Any) -> dict[str, Any]:
    """A run without the dedup job unless `document` asks for it: its quota has tests of its own (the end)."""
    run = RunDocument.model_validate(
        {"dataset": {"prefix": f"s3://{DATA_BUCKET}/datasets/cats/"}, "base_model_uri": f"s3://{DATA_BUCKET}/m/"}
        | {"deduplication": {"enabled": False}}
        | document
    )
    return {"run_id": "run-1", "shard_count": 3, "run": run.model_dump(mode="json")}


@pytest.fixture
def service_quotas(aws_env: None) -> Iterator[tuple[Any, Stubber]]:
    client = boto3.client("service-quotas", region_name=REGION)
    with Stubber(client) as stubber:
        yield client, stubber
        stubber.assert_no_pending_responses()


def test_quotas_download_concurrency_above_quota_is_capped_and_recorded(service_quotas: tuple[Any, Stubber]) -> None:
    client, stubber = service_quotas
    stubber.add_response(
        "list_service_quotas", {"Quotas": [quota(PROCESSING, 4), quota(TRAINING, 2), quota(ENDPOINT, 1)]}, LISTING
    )

    capped = quotas.apply_instance_quotas(config(download={"max_concurrency": 50}), client)

    assert capped["run"]["download"]["max_concurrency"] == 4
    check = capped["quota_check"]
    assert check["status"] == "checked"
    assert check["download_max_concurrency"] == {"requested": 50, "applied": 4, "quota": PROCESSING}
    assert check["limits"] == {PROCESSING: 4, TRAINING: 2, ENDPOINT: 1}
    assert RunDocument.model_validate(capped["run"]).download.max_concurrency == 4, "still a valid document"


def test_quotas_concurrency_within_quota_is_left_alone(service_quotas: tuple[Any, Stubber]) -> None:
    client, stubber = service_quotas
    stubber.add_response(
        "list_service_quotas", {"Quotas": [quota(PROCESSING, 20), quota(TRAINING, 1), quota(ENDPOINT, 1)]}, LISTING
    )

    checked = quotas.apply_instance_quotas(config(download={"max_concurrency": 10}), client)

    assert checked["run"]["download"]["max_concurrency"] == 10
    assert "download_max_concurrency" not in checked["quota_check"]


def test_quotas_default_values_fill_in_quotas_without_an_applied_value(service_quotas: tuple[Any, Stubber]) -> None:
    client, stubber = service_quotas
    stubber.add_response("list_service_quotas", {"Quotas": [quota(TRAINING, 1)], "NextToken": "p2"}, LISTING)
    stubber.add_response("list_service_quotas", {"Quotas": [quota(ENDPOINT, 1)]}, LISTING | {"NextToken": "p2"})
    stubber.add_response("list_aws_default_service_quotas", {"Quotas": [quota(PROCESSING, 8)]}, LISTING)

    capped = quotas.apply_instance_quotas(config(download={"max_concurrency": 50}), client)

    assert capped["run"]["download"]["max_concurrency"] == 8


def test_quotas_paging_stops_once_every_quota_is_found(service_quotas: tuple[Any, Stubber]) -> None:
    client, stubber = service_quotas
    found = [quota(PROCESSING, 4), quota(TRAINING, 1), quota(ENDPOINT, 1)]
    stubber.add_response("list_service_quotas", {"Quotas": found, "NextToken": "more"}, LISTING)

    result = quotas.apply_instance_quotas(config(), client)

    # A request for the next page would find no stubbed answer and end the lookup as "skipped".
    assert result["quota_check"]["status"] == "checked"


def test_quotas_denied_lookup_proceeds_uncapped(service_quotas: tuple[Any, Stubber]) -> None:
    client, stubber = service_quotas
    stubber.add_client_error("list_service_quotas", "AccessDeniedException", "not authorized", 400, LISTING)

    result = quotas.apply_instance_quotas(config(download={"max_concurrency": 50}), client)

    assert result["run"]["download"]["max_concurrency"] == 50
    assert result["quota_check"]["status"] == "skipped"
    assert "AccessDeniedException" in result["quota_check"]["reason"]


def test_quotas_unlisted_instance_type_is_not_checked_but_named(service_quotas: tuple[Any, Stubber]) -> None:
    client, stubber = service_quotas
    stubber.add_response("list_service_quotas", {"Quotas": [quota(TRAINING, 1), quota(ENDPOINT, 1)]}, LISTING)
    stubber.add_response("list_aws_default_service_quotas", {"Quotas": []}, LISTING)

    result = quotas.apply_instance_quotas(config(download={"max_concurrency": 50}), client)

    assert result["run"]["download"]["max_concurrency"] == 50
    assert result["quota_check"]["unlisted"] == [PROCESSING]


@pytest.mark.parametrize(
    ("document", "limits", "field"),
    [
        ({}, {PROCESSING: 0, TRAINING: 1, ENDPOINT: 1}, "download.instance_type"),
        ({"training": {"instance_count": 4}}, {PROCESSING: 4, TRAINING: 2, ENDPOINT: 1}, "training.instance_count"),
        (
            {"endpoint": {"initial_instance_count": 2}},
            {PROCESSING: 4, TRAINING: 1, ENDPOINT: 1},
            "endpoint.initial_instance_count",
        ),
    ],
)
def test_quotas_request_larger_than_its_quota_is_refused_naming_the_field(
    service_quotas: tuple[Any, Stubber], document: dict[str, Any], limits: dict[str, int], field: str
) -> None:
    client, stubber = service_quotas
    stubber.add_response("list_service_quotas", {"Quotas": [quota(n, v) for n, v in limits.items()]}, LISTING)

    with pytest.raises(InvalidRunDocument) as raised:
        quotas.apply_instance_quotas(config(**document), client)

    [problem] = json.loads(str(raised.value))
    assert problem["field"] == field
    assert "Service Quotas" in problem["message"]


def test_quotas_spot_training_is_checked_against_the_spot_quota(service_quotas: tuple[Any, Stubber]) -> None:
    client, stubber = service_quotas
    spot = "ml.g5.12xlarge for spot training job usage"
    stubber.add_response(
        "list_service_quotas",
        {"Quotas": [quota(PROCESSING, 4), quota(TRAINING, 8), quota(spot, 0), quota(ENDPOINT, 1)]},
        LISTING,
    )
    training = {"use_spot": True, "max_runtime_seconds": 3600, "max_wait_seconds": 7200}

    with pytest.raises(InvalidRunDocument, match="spot training job usage"):
        quotas.apply_instance_quotas(config(training=training), client)


def test_validate_run_without_quota_permission_returns_uncapped_config(mocked_aws: AwsWorld) -> None:
    mocked_aws.put_json("models/tiny/model_index.json", {"_class_name": "StableDiffusionPipeline"})
    mocked_aws.s3.put_object(Bucket=DATA_BUCKET, Key="datasets/cats/a.parquet", Body=parquet_bytes())
    request = ValidateRunRequest(
        run={
            "dataset": {"prefix": f"s3://{DATA_BUCKET}/datasets/cats/"},
            "base_model_uri": f"s3://{DATA_BUCKET}/models/tiny/",
            "download": {"max_concurrency": 50},
        },
        execution_name="run-1",
        execution_arn=f"arn:aws:states:{REGION}:{ACCOUNT}:execution:p:run-1",
        start_time="2025-06-02T09:15:43.512Z",
    )

    result = validate_run(request, data_bucket=DATA_BUCKET, max_shards=50)

    assert result["quota_check"]["status"] == "skipped"
    assert result["run"]["download"]["max_concurrency"] == 50


DEDUP = "ml.m5.2xlarge for processing job usage"


def test_quotas_dedup_instance_type_without_quota_is_refused_naming_the_field(
    service_quotas: tuple[Any, Stubber],
) -> None:
    client, stubber = service_quotas
    limits = {PROCESSING: 4, TRAINING: 1, ENDPOINT: 1, DEDUP: 0}
    stubber.add_response("list_service_quotas", {"Quotas": [quota(n, v) for n, v in limits.items()]}, LISTING)

    with pytest.raises(InvalidRunDocument) as raised:
        quotas.apply_instance_quotas(config(deduplication={"enabled": True}), client)

    [problem] = json.loads(str(raised.value))
    assert problem["field"] == "deduplication.instance_type"
    assert "one dedup job needs 1 instance(s)" in problem["message"]
    assert DEDUP in problem["message"]


def test_quotas_dedup_job_within_its_quota_is_checked(service_quotas: tuple[Any, Stubber]) -> None:
    client, stubber = service_quotas
    limits = {PROCESSING: 4, TRAINING: 1, ENDPOINT: 1, DEDUP: 2}
    stubber.add_response("list_service_quotas", {"Quotas": [quota(n, v) for n, v in limits.items()]}, LISTING)

    checked = quotas.apply_instance_quotas(config(deduplication={"enabled": True}), client)

    assert checked["quota_check"]["limits"] == limits
    assert checked["run"]["deduplication"]["enabled"] is True
