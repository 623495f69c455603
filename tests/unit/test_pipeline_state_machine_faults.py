"""statemachines/pipeline.asl.json's failure paths, executed by moto's Step Functions interpreter:
Retry on quotas, throttling, capacity and crashed Lambda runtimes, Catch to a failed run, timeouts
(tests/unit/pipeline_harness.py plays the functions)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sdflow_common import errors
from tests.unit.pipeline_harness import (
    DAY,
    HOUR,
    HOURS_4,
    LambdaError,
    Pipeline,
    answer_all_success,
    raise_behaviour,
    started_behaviour,
    validate_run_behaviour,
)


def test_pipeline_download_held_by_quota_waits_and_retries_with_next_attempt(pipeline: Pipeline) -> None:
    seen: list[int] = []

    def start_download(payload: dict[str, Any]) -> Any:
        if payload["shard"]["shard_id"] == "00002":
            seen.append(payload["attempt"])
            if len(seen) < 3:
                raise LambdaError("SageMakerQuotaExceeded", "ml.c5.xlarge for processing job usage is 2 Instances")
        return started_behaviour(payload)

    pipeline.behaviours["StartDownloadFunction"] = start_download

    result = pipeline.run(answer_all_success)

    assert result["status"] == "SUCCEEDED"
    assert seen == [0, 1, 2]
    assert pipeline.calls["BuildIndexFunction"], "the shard was downloaded, not recorded failed"


@pytest.mark.parametrize("function", ["StartTrainingFunction", "DeployEndpointFunction"])
def test_pipeline_training_and_deploy_held_by_quota_are_retried(pipeline: Pipeline, function: str) -> None:
    seen: list[int] = []

    def start(payload: dict[str, Any]) -> Any:
        seen.append(payload["attempt"])
        if len(seen) == 1:
            raise LambdaError("SageMakerQuotaExceeded", "ml.g5.12xlarge for training job usage is 1 Instances")
        return started_behaviour(payload)

    pipeline.behaviours[function] = start

    result = pipeline.run(answer_all_success)

    assert result["status"] == "SUCCEEDED"
    assert seen == [0, 1]


@pytest.mark.parametrize(
    "function", ["ValidateRunFunction", "StartDownloadFunction", "BuildIndexFunction", "StartTrainingFunction"]
)
def test_pipeline_crashed_lambda_runtime_is_retried_and_run_succeeds(pipeline: Pipeline, function: str) -> None:
    crashed: list[str] = []
    behaviour = pipeline.behaviours[function]

    def crash_once(payload: dict[str, Any]) -> Any:
        if not crashed:
            crashed.append(function)
            raise LambdaError("Runtime.ExitError", "RequestId: 1 Error: Runtime exited with error: signal: killed")
        return behaviour(payload)

    pipeline.behaviours[function] = crash_once

    result = pipeline.run(answer_all_success)

    assert result["status"] == "SUCCEEDED", result.get("cause")
    assert crashed == [function]


def test_pipeline_invalid_run_fails_at_validation_and_starts_nothing(pipeline: Pipeline) -> None:
    message = json.dumps([{"field": "training.instance_count", "message": "must be ≥ 1"}])
    pipeline.behaviours["ValidateRunFunction"] = raise_behaviour("InvalidRunDocument", message)

    result = pipeline.run(answer_all_success)

    assert result["status"] == "FAILED"
    assert result.get("error") == "InvalidRunDocument"
    assert "training.instance_count" in result["cause"]
    assert not pipeline.calls["StartDownloadFunction"]
    assert not pipeline.calls["StartTrainingFunction"]


def test_pipeline_failed_shard_is_retried_once_then_fails_its_child_and_run_continues(pipeline: Pipeline) -> None:
    def answer(name: str, payload: dict[str, Any]) -> tuple[str, Any]:
        if name == "StartDownloadFunction" and payload["shard"]["shard_id"] == "00001":
            return "failure", ("DownloadJobFailed", "AlgorithmError: parquet has no URL column")
        return answer_all_success(name, payload)

    result = pipeline.run(answer)

    assert result["status"] == "SUCCEEDED"
    attempts = [c["attempt"] for c in pipeline.calls["StartDownloadFunction"] if c["shard"]["shard_id"] == "00001"]
    assert attempts == [0, 1], "a failed download is retried once, with a new attempt number"
    assert len(pipeline.calls["BuildIndexFunction"]) == 1
    map_run = pipeline.sfn.list_map_runs(executionArn=result["executionArn"])["mapRuns"][0]
    children = pipeline.sfn.list_executions(mapRunArn=map_run["mapRunArn"])["executions"]
    assert sorted(child["status"] for child in children) == ["FAILED", "SUCCEEDED", "SUCCEEDED"], (
        "the failed shard's child stays failed, so a redrive would re-run it"
    )


def test_pipeline_cached_shard_starts_no_download_job(pipeline: Pipeline) -> None:
    pipeline.behaviours["ValidateRunFunction"] = validate_run_behaviour(
        pipeline.s3, 3, HOURS_4, cached=frozenset({0, 2})
    )

    result = pipeline.run(answer_all_success)

    assert result["status"] == "SUCCEEDED"
    assert [call["shard"]["shard_id"] for call in pipeline.calls["StartDownloadFunction"]] == ["00001"]


def test_pipeline_reused_training_deploys_the_earlier_model_without_training(pipeline: Pipeline) -> None:
    earlier = {"job_name": "sdf-tr-old", "model_data_url": "s3://b/old/model.tar.gz", "final_metrics": {}}
    resume = {"from_execution_arn": "arn:aws:states:us-east-1:123456789012:execution:p:old", "training": earlier}
    pipeline.behaviours["ValidateRunFunction"] = validate_run_behaviour(
        pipeline.s3,
        2,
        HOURS_4,
        cached=frozenset({0, 1}),
        resume=resume,
    )

    result = pipeline.run(answer_all_success)

    assert result["status"] == "SUCCEEDED"
    assert not pipeline.calls["StartDownloadFunction"]
    assert not pipeline.calls["StartTrainingFunction"]
    assert pipeline.calls["StartEvaluationFunction"][0]["training"] == earlier, "a reused model is evaluated too"
    assert pipeline.calls["DeployEndpointFunction"][0]["training"] == earlier


def test_pipeline_no_usable_shards_fails_without_training(pipeline: Pipeline) -> None:
    pipeline.behaviours["BuildIndexFunction"] = raise_behaviour(errors.NoUsableShards.__name__, "3 of 3 shards failed")

    result = pipeline.run(answer_all_success)

    assert result["status"] == "FAILED"
    assert result.get("error") == "NoUsableShards"
    assert not pipeline.calls["StartTrainingFunction"]


def test_pipeline_training_job_failure_fails_the_run_and_deploys_nothing(pipeline: Pipeline) -> None:
    def answer(name: str, payload: dict[str, Any]) -> tuple[str, Any]:
        if name == "StartTrainingFunction":
            return "failure", ("TrainingJobFailed", "AlgorithmError: CUDA out of memory")
        return answer_all_success(name, payload)

    result = pipeline.run(answer)

    assert result["status"] == "FAILED"
    assert result.get("error") == "TrainingJobFailed"
    assert not pipeline.calls["DeployEndpointFunction"]
    assert len(pipeline.calls["StartTrainingFunction"]) == 1, "SageMaker's RetryStrategy retries, not the state"


def test_pipeline_training_capacity_failure_is_retried_with_a_new_job(pipeline: Pipeline) -> None:
    failures: list[int] = []

    def answer(name: str, payload: dict[str, Any]) -> tuple[str, Any]:
        if name == "StartTrainingFunction" and not failures:
            failures.append(payload["attempt"])
            return "failure", ("TrainingCapacityUnavailable", "CapacityError: Unable to provision requested ML compute")
        return answer_all_success(name, payload)

    result = pipeline.run(answer)

    assert result["status"] == "SUCCEEDED", result.get("cause")
    assert [call["attempt"] for call in pipeline.calls["StartTrainingFunction"]] == [0, 1]


def test_pipeline_throttled_training_start_is_retried_with_next_attempt(pipeline: Pipeline) -> None:
    seen: list[int] = []

    def start_training(payload: dict[str, Any]) -> Any:
        seen.append(payload["attempt"])
        if len(seen) == 1:
            raise LambdaError("SageMakerThrottled", "Rate exceeded")
        return started_behaviour(payload)

    pipeline.behaviours["StartTrainingFunction"] = start_training

    result = pipeline.run(answer_all_success)

    assert result["status"] == "SUCCEEDED"
    assert seen == [0, 1]


def test_pipeline_endpoint_rollback_fails_the_run(pipeline: Pipeline) -> None:
    def answer(name: str, payload: dict[str, Any]) -> tuple[str, Any]:
        if name == "DeployEndpointFunction":
            return "failure", ("EndpointDeployFailed", "update rolled back to sdflow-old-a0")
        return answer_all_success(name, payload)

    result = pipeline.run(answer)

    assert result["status"] == "FAILED"
    assert result.get("error") == "EndpointDeployFailed"


def test_pipeline_lost_training_event_times_out_and_fails_the_run(pipeline: Pipeline) -> None:
    pipeline.behaviours["ValidateRunFunction"] = validate_run_behaviour(
        pipeline.s3, 1, {"download": 4 * HOUR, "training": DAY, "endpoint": 4 * HOUR}
    )

    def answer(name: str, payload: dict[str, Any]) -> tuple[str, Any] | None:
        if name != "StartTrainingFunction":
            return answer_all_success(name, payload)
        pipeline.pass_task_timeout()  # the job's event never comes: a day passes
        return None

    result = pipeline.run(answer)

    assert result["status"] == "FAILED"
    assert result.get("error") == "States.Timeout"
