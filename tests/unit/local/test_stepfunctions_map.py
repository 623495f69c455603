"""Step Functions: the Distributed Map's tolerated failure threshold and ResultWriter, as AWS documents them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sdflow.local import runtime as runtime_module
from sdflow.local.stepfunctions.map import EXCEEDED_CAUSE
from tests.unit.local.helpers import client
from tests.unit.local.machines import FAIL_WHEN_ASKED, distributed_map, run_machine

EXCEEDED = "States.ExceedToleratedFailureThreshold"


def _shards(failing: int, total: int = 4) -> dict[str, Any]:
    return {"items": [{"shard": n, "fail": n < failing} for n in range(total)], "limit": 1, "percent": 50}


def _machine(**fields: Any) -> dict[str, Any]:
    return {"StartAt": "Map", "States": {"Map": distributed_map(FAIL_WHEN_ASKED, "Check", **fields)}}


def test_moto_gap_failed_child_does_not_fail_the_map(aws: None) -> None:
    assert run_machine(_machine(), _shards(failing=1))["status"] == "SUCCEEDED"


def test_patch_one_failed_child_fails_the_map_without_thresholds(runtime: runtime_module.Runtime) -> None:
    described = run_machine(_machine(), _shards(failing=1))
    assert described["status"] == "FAILED"
    assert (described["error"], described["cause"]) == (EXCEEDED, EXCEEDED_CAUSE)


def test_patch_no_failed_child_succeeds_without_thresholds(runtime: runtime_module.Runtime) -> None:
    assert run_machine(_machine(), _shards(failing=0))["status"] == "SUCCEEDED"


@pytest.mark.parametrize(
    ("fields", "failing", "status"),
    [
        ({"ToleratedFailureCount": 1}, 1, "SUCCEEDED"),
        ({"ToleratedFailureCount": 1}, 2, "FAILED"),
        ({"ToleratedFailureCountPath": "$.limit"}, 2, "FAILED"),
        ({"ToleratedFailurePercentage": 50.0}, 2, "SUCCEEDED"),  # 50 % is not more than 50 %
        ({"ToleratedFailurePercentage": 50.0}, 3, "FAILED"),
        ({"ToleratedFailurePercentagePath": "$.percent"}, 2, "SUCCEEDED"),
        ({"ToleratedFailureCount": 3, "ToleratedFailurePercentage": 50.0}, 3, "FAILED"),  # either one exceeded
        ({"ToleratedFailureCount": 0}, 1, "FAILED"),
    ],
)
def test_patch_threshold_given_applies_alone(
    runtime: runtime_module.Runtime, fields: dict[str, Any], failing: int, status: str
) -> None:
    described = run_machine(_machine(**fields), _shards(failing=failing))
    assert described["status"] == status
    if status == "FAILED":
        assert described["error"] == EXCEEDED


def test_patch_exceeded_threshold_is_caught_by_states_all(runtime: runtime_module.Runtime) -> None:
    catch = [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.error", "Next": "Caught"}]
    definition = _machine(Catch=catch)
    definition["States"]["Caught"] = {"Type": "Pass", "End": True}
    described = run_machine(definition, _shards(failing=1))
    assert described["status"] == "SUCCEEDED"
    assert json.loads(described["output"])["error"] == {"Error": EXCEEDED, "Cause": EXCEEDED_CAUSE}


def _writer(prefix: str = "results") -> dict[str, Any]:
    return {"Resource": "arn:aws:states:::s3:putObject", "Parameters": {"Bucket.$": "$.bucket", "Prefix": prefix}}


def _read(bucket: str, key: str) -> Any:
    return json.loads(client("s3").get_object(Bucket=bucket, Key=key)["Body"].read())


def test_moto_gap_result_writer_writes_an_empty_manifest(aws: None) -> None:
    client("s3").create_bucket(Bucket="results")
    writer = {"Resource": "arn:aws:states:::s3:putObject", "Parameters": {"Bucket": "results", "Prefix": "p"}}
    described = run_machine(_machine(ResultWriter=writer, ResultPath="$.written"), _shards(failing=0))
    details = json.loads(described["output"])["written"]["ResultWriterDetails"]
    manifest = _read("results", details["Key"])
    assert manifest["ResultFiles"] == {"FAILED": [], "PENDING": [], "SUCCEEDED": []}


def test_moto_gap_result_writer_paths_select_from_the_results(aws: None) -> None:
    client("s3").create_bucket(Bucket="results")
    described = run_machine(_machine(ResultWriter=_writer()), {**_shards(failing=0), "bucket": "results"})
    assert (described["status"], described["error"]) == ("FAILED", "States.Runtime")
    assert "could not be found in the input '[" in described["cause"]


def test_patch_result_writer_writes_each_status_and_a_manifest(runtime: runtime_module.Runtime) -> None:
    client("s3").create_bucket(Bucket="results")
    writer = _writer()
    del writer["Parameters"]["Prefix"]
    writer["Parameters"]["Prefix.$"] = "States.Format('runs/{}/results', $$.Execution.Name)"  # as the pipeline does
    described = run_machine(
        _machine(ResultWriter=writer, ResultPath="$.written", ToleratedFailureCount=1),
        {**_shards(failing=1, total=3), "bucket": "results"},
    )
    assert described["status"] == "SUCCEEDED"
    written = json.loads(described["output"])["written"]
    map_run_id = written["MapRunArn"].split(":")[-1]
    folder = f"runs/{described['name']}/results/{map_run_id}"
    assert written["ResultWriterDetails"] == {"Bucket": "results", "Key": f"{folder}/manifest.json"}

    manifest = _read("results", written["ResultWriterDetails"]["Key"])
    assert manifest["DestinationBucket"] == "results"
    assert manifest["MapRunArn"] == written["MapRunArn"]
    assert manifest["ResultFiles"]["PENDING"] == []
    [succeeded_file] = manifest["ResultFiles"]["SUCCEEDED"]
    [failed_file] = manifest["ResultFiles"]["FAILED"]
    assert succeeded_file["Key"] == f"{folder}/SUCCEEDED_0.json"
    assert failed_file["Key"] == f"{folder}/FAILED_0.json"

    succeeded = _read("results", succeeded_file["Key"])
    assert len(json.dumps(succeeded, ensure_ascii=False).encode()) == succeeded_file["Size"]
    assert [json.loads(entry["Output"]) for entry in succeeded] == [
        {"shard": 1, "status": "ok"},
        {"shard": 2, "status": "ok"},
    ]
    assert {entry["Status"] for entry in succeeded} == {"SUCCEEDED"}
    assert json.loads(succeeded[0]["Input"]) == {"shard": 1, "fail": False}
    assert succeeded[0]["ExecutionArn"].endswith(f":{succeeded[0]['Name']}")
    assert ":execution:m/" in succeeded[0]["ExecutionArn"]

    [failed] = _read("results", failed_file["Key"])
    assert (failed["Status"], failed["Error"], failed["Cause"]) == (
        "FAILED",
        "ShardFailed",
        "the shard could not be read",
    )
    assert "Output" not in failed


def test_patch_result_writer_to_a_missing_bucket_fails_the_map(runtime: runtime_module.Runtime) -> None:
    described = run_machine(_machine(ResultWriter=_writer()), {**_shards(failing=0), "bucket": "no-such-bucket"})
    assert described["status"] == "FAILED"
    assert described["error"] == "States.ResultWriterFailed"
    assert "no-such-bucket" in described["cause"]
