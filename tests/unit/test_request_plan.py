"""request_plan: every SageMaker request a run will make, built at Validate run with the starters' builders and
checked against botocore's model; a refusal names the run document's field, SageMaker's limit and a fix."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from sdflow_common import request_limits
from sdflow_common.errors import InvalidRunDocument
from sdflow_common.request_plan import check_requests, planned_requests
from sdflow_common.run_document import problems_of
from sdflow_common.settings import Settings
from tests.unit.helpers import load_event
from tests.unit.job_requests import assert_valid_request

pytestmark = pytest.mark.usefixtures("aws_env")

OPERATIONS = [
    "CreateProcessingJob",
    "CreateProcessingJob",
    "CreateTrainingJob",
    "CreateProcessingJob",
    "CreateModelPackageGroup",
    "CreateModelPackage",
    "CreateModel",
    "CreateEndpointConfig",
    "CreateEndpoint",
    "UpdateEndpoint",
]


def config(**sections: dict[str, Any]) -> dict[str, Any]:
    """`$.config` of events/register_model_task.json, its run document's sections changed."""
    found = copy.deepcopy(load_event("register_model_task.json")["config"])
    for name, values in sections.items():
        found["run"][name] = {**found["run"].get(name, {}), **values} if isinstance(values, dict) else values
    return dict(found)


def refusals(raw: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(InvalidRunDocument) as caught:
        check_requests(raw, Settings.from_env())
    return {problem["field"]: problem["message"] for problem in problems_of(caught.value)}


def test_planned_requests_valid_run_builds_every_request_within_botocore_limits() -> None:
    requests = planned_requests(config(), Settings.from_env())

    assert [planned.operation for planned in requests] == OPERATIONS
    for planned in requests:
        assert_valid_request(planned.operation, planned.request)


def test_planned_requests_names_carry_the_widest_counters_a_name_is_cut_for() -> None:
    requests = {planned.label: planned.request for planned in planned_requests(config(), Settings.from_env())}

    assert requests["training job"]["TrainingJobName"].endswith("-r1000-a1000")
    assert requests["download job"]["ProcessingJobName"].endswith("-r1000-a1000")
    assert requests["dedup job"]["ProcessingJobName"].endswith("-r1000-a1000")
    assert requests["model"]["ModelName"].endswith("-r1000-a1000")


def test_check_requests_url_column_longer_than_a_container_argument_is_refused_naming_it() -> None:
    found = refusals(config(dataset={"url_column": "u" * 300}))

    assert set(found) == {"dataset.url_column"}
    message = found["dataset.url_column"]
    assert "download job's CreateProcessingJob" in message
    assert "length less than or equal to 256" in message
    assert "change dataset.url_column" in message


def test_check_requests_endpoint_instance_type_sagemaker_does_not_host_is_refused_naming_it() -> None:
    found = refusals(config(endpoint={"instance_type": "ml.g5.13xlarge"}))

    assert set(found) == {"endpoint.instance_type"}
    assert "enum value set" in found["endpoint.instance_type"]


def test_check_requests_parquet_uri_longer_than_s3uri_is_refused_naming_its_position() -> None:
    raw = config()
    long_uri = "s3://sdflow-data-test/datasets/" + "k" * 1000 + ".parquet"
    raw["run"]["dataset"]["parquet_uris"] = [raw["run"]["dataset"]["parquet_uris"][0], long_uri]

    found = refusals(raw)

    assert set(found) == {"dataset.parquet_uris.1"}
    assert "length less than or equal to 1024" in found["dataset.parquet_uris.1"]


def test_check_requests_execution_name_with_marks_step_functions_allows_is_accepted() -> None:
    raw = config()
    name = "run(1)!it's-\u200bfine"
    raw = json.loads(json.dumps(raw).replace(raw["run_id"], name))

    requests = check_requests(raw, Settings.from_env())

    package = next(planned.request for planned in requests if planned.operation == "CreateModelPackage")
    assert package["CustomerMetadataProperties"]["sdflow:run_id"] == "run_1__it_s-_fine"
    assert all(request_limits.operation_problems(p.operation, p.request) == [] for p in requests)


def test_planned_requests_dedup_job_follows_the_downloads_only_when_enabled() -> None:
    enabled = planned_requests(config(deduplication={"instance_type": "ml.m5.4xlarge"}), Settings.from_env())
    disabled = planned_requests(config(deduplication={"enabled": False}), Settings.from_env())

    assert [planned.label for planned in enabled][:3] == ["download job", "dedup job", "training job"]
    [dedup] = [planned.request for planned in enabled if planned.label == "dedup job"]
    assert dedup["ProcessingJobName"].startswith("sdf-dd-")
    assert dedup["ProcessingResources"]["ClusterConfig"]["InstanceType"] == "ml.m5.4xlarge"
    assert dedup["AppSpecification"]["ContainerEntrypoint"] == ["dedup"]
    assert "dedup job" not in [planned.label for planned in disabled]
    assert len(disabled) == len(enabled) - 1


def test_check_requests_dedup_instance_type_sagemaker_does_not_offer_is_refused_naming_it() -> None:
    found = refusals(config(deduplication={"instance_type": "ml.m5.3xlarge"}))

    assert set(found) == {"deduplication.instance_type"}
    message = found["deduplication.instance_type"]
    assert "dedup job's CreateProcessingJob" in message
    assert "enum value set" in message
    assert "change deduplication.instance_type" in message


def test_check_requests_dedup_disabled_does_not_check_its_instance_type() -> None:
    requests = check_requests(
        config(deduplication={"enabled": False, "instance_type": "ml.m5.3xlarge"}), Settings.from_env()
    )

    assert "dedup job" not in [planned.label for planned in requests]
