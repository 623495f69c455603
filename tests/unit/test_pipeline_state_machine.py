"""statemachines/pipeline.asl.json executed by moto's Step Functions interpreter.

Every Lambda task is answered by a test double that plays the function's contract
(docs/contracts.md); callback tasks hand their token to the test, which resolves it the way
job_events would. What is under test is the definition: the flow, the data passed between
states, Retry and Catch, the Distributed Map, the timeouts and the failure path."""

from __future__ import annotations

import json
import queue
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws
from moto.awslambda_simple.models import LambdaSimpleBackend

from sdflow_common import errors
from tests.unit.conftest import DATA_BUCKET, REGION
from tests.unit.intake_harness import definition_for_tests

ASL = Path(__file__).resolve().parents[2] / "statemachines" / "pipeline.asl.json"
FUNCTIONS = (
    "ValidateRunFunction",
    "StartDownloadFunction",
    "BuildIndexFunction",
    "StartTrainingFunction",
    "DeployEndpointFunction",
    "NotifyFunction",
)
RUN_DOCUMENT = {
    "run_name": "cats",
    "dataset": {"prefix": f"s3://{DATA_BUCKET}/datasets/cats/"},
    "base_model_uri": f"s3://{DATA_BUCKET}/models/tiny/",
}

Behaviour = Callable[[dict[str, Any]], Any]


def _definition_for_tests() -> str:
    """The real definition with every retry wait cut to one second (moto really sleeps)."""
    text, functions = definition_for_tests()
    assert set(functions) == set(FUNCTIONS), functions
    return text


class LambdaError(Exception):
    """Raised by a double to make the invocation fail with `error_type`, as a handler would."""

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type


@dataclass
class Pipeline:
    """The state machine in moto plus the doubles answering its tasks."""

    sfn: Any
    s3: Any
    arn: str
    behaviours: dict[str, Behaviour] = field(default_factory=dict)
    calls: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    tokens: queue.Queue[tuple[str, dict[str, Any]]] = field(default_factory=queue.Queue)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def invoke(self, function_name: str, body: str) -> Any:
        name = function_name.split(":")[-1]
        payload = json.loads(body) if body else {}
        with self.lock:
            self.calls[name].append(payload)
        if "token" in payload:
            self.tokens.put((name, payload))
        return self.behaviours[name](payload)

    def run(
        self,
        answer: Callable[[str, dict[str, Any]], tuple[str, Any] | None],
        document: dict[str, Any] | None = None,
        timeout: float = 60,
    ) -> dict[str, Any]:
        """Start an execution and resolve each waiting task with `answer(function, payload)`:
        ("success", output) / ("failure", (error, cause)) / None to leave it waiting."""
        execution_arn = self.sfn.start_execution(
            stateMachineArn=self.arn, name=f"run-{time.monotonic_ns()}", input=json.dumps(document or RUN_DOCUMENT)
        )["executionArn"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            description = self.sfn.describe_execution(executionArn=execution_arn)
            if description["status"] != "RUNNING" and ("output" in description or description["status"] != "SUCCEEDED"):
                return description
            try:
                name, payload = self.tokens.get(timeout=0.05)
            except queue.Empty:
                continue
            outcome = answer(name, payload)
            if outcome is None:
                continue
            kind, value = outcome
            if kind == "success":
                self.sfn.send_task_success(taskToken=payload["token"], output=json.dumps(value))
            else:
                error, cause = value
                self.sfn.send_task_failure(taskToken=payload["token"], error=error, cause=cause)
        raise AssertionError(f"execution still running after {timeout} s: {self.calls.keys()}")


def _validate_run(s3: Any, shard_count: int, timeouts: dict[str, int]) -> Behaviour:
    def behaviour(payload: dict[str, Any]) -> dict[str, Any]:
        run_id = payload["execution_name"]
        shards = [
            {
                "shard_id": f"{i:05d}",
                "parquet_uri": f"s3://{DATA_BUCKET}/datasets/cats/part-{i}.parquet",
                "output_uri": f"s3://{DATA_BUCKET}/runs/{run_id}/dataset/shards/{i:05d}/",
            }
            for i in range(shard_count)
        ]
        key = f"runs/{run_id}/shards.json"
        s3.put_object(Bucket=DATA_BUCKET, Key=key, Body=json.dumps(shards).encode())
        run = {**payload["run"], "download": {"max_concurrency": 2}}
        run["dataset"] = {**run["dataset"], "url_column": "URL", "caption_column": "TEXT"}
        return {
            "run_id": run_id,
            "execution_arn": payload["execution_arn"],
            "bucket": DATA_BUCKET,
            "shard_list_key": key,
            "shard_count": shard_count,
            "dataset_prefix_uri": f"s3://{DATA_BUCKET}/runs/{run_id}/dataset/",
            "timeouts": timeouts,
            "run": run,
        }

    return behaviour


def _build_index(payload: dict[str, Any]) -> dict[str, Any]:
    return {
        "index_uri": f"s3://{DATA_BUCKET}/runs/{payload['config']['run_id']}/dataset/index.json",
        "total_samples": 100,
        "shards_ok": payload["config"]["shard_count"],
        "shards_failed": 0,
        "failed_shards": [],
    }


def _started(payload: dict[str, Any]) -> dict[str, str]:
    return {"resource_name": f"sdf-test-{payload.get('attempt', 0)}"}


def _answer_all_success(name: str, payload: dict[str, Any]) -> tuple[str, Any]:
    if name == "StartDownloadFunction":
        return "success", {"shard_id": payload["shard"]["shard_id"], "status": "ok", "job_name": "sdf-dl-x"}
    if name == "StartTrainingFunction":
        return "success", {
            "job_name": "sdf-tr-x",
            "model_data_url": "s3://b/model.tar.gz",
            "final_metrics": {"train:loss": 0.125},
        }
    return "success", {
        "endpoint_name": "sdflow",
        "endpoint_config_name": "sdflow-abc-a0",
        "model_name": "sdflow-abc-a0",
        "action": "create",
    }


@pytest.fixture
def pipeline(aws_env: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pipeline]:
    config = {"stepfunctions": {"execute_state_machine": True}, "lambda": {"use_docker": False}}
    with mock_aws(config=config):
        s3 = boto3.client("s3", region_name=REGION)
        s3.create_bucket(Bucket=DATA_BUCKET)
        iam = boto3.client("iam", region_name=REGION)
        role = iam.create_role(RoleName="fn", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
        awslambda = boto3.client("lambda", region_name=REGION)
        for name in FUNCTIONS:
            awslambda.create_function(
                FunctionName=name,
                Runtime="python3.11",
                Role=role,
                Handler="app.lambda_handler",
                Code={"ZipFile": b"double"},
            )
        sfn = boto3.client("stepfunctions", region_name=REGION)
        arn = sfn.create_state_machine(name="sdflow-test-pipeline", definition=_definition_for_tests(), roleArn=role)[
            "stateMachineArn"
        ]
        harness = Pipeline(sfn=sfn, s3=s3, arn=arn)
        harness.behaviours = {
            "ValidateRunFunction": _validate_run(s3, 3, {"download": 30, "training": 30, "endpoint": 30}),
            "StartDownloadFunction": _started,
            "BuildIndexFunction": _build_index,
            "StartTrainingFunction": _started,
            "DeployEndpointFunction": _started,
            "NotifyFunction": lambda payload: {"message_id": "m-1"},
        }

        def invoke(
            backend: Any, function_name: str, qualifier: Any, body: Any, headers: Any, response_headers: Any
        ) -> bytes:
            text = body.decode() if isinstance(body, bytes) else body
            try:
                result = harness.invoke(function_name, text)
            except LambdaError as exc:
                response_headers["x-amz-function-error"] = "Unhandled"
                return json.dumps({"errorMessage": str(exc), "errorType": exc.error_type}).encode()
            return json.dumps(result).encode()

        monkeypatch.setattr(LambdaSimpleBackend, "invoke", invoke)
        yield harness


def _raise(error_type: str, message: str) -> Behaviour:
    def behaviour(payload: dict[str, Any]) -> Any:
        raise LambdaError(error_type, message)

    return behaviour


def _notifications(pipeline: Pipeline) -> list[dict[str, Any]]:
    return pipeline.calls["NotifyFunction"]


def test_pipeline_all_steps_succeed_notifies_success_with_every_result(pipeline: Pipeline) -> None:
    result = pipeline.run(_answer_all_success)

    assert result["status"] == "SUCCEEDED"
    [notification] = _notifications(pipeline)
    assert notification["outcome"] == "succeeded"
    state = notification["state"]
    assert state["dataset"]["shards_ok"] == 3
    assert state["training"]["final_metrics"] == {"train:loss": 0.125}
    assert state["endpoint"]["endpoint_name"] == "sdflow"
    downloads = pipeline.calls["StartDownloadFunction"]
    assert sorted(call["shard"]["shard_id"] for call in downloads) == ["00000", "00001", "00002"]
    assert {call["attempt"] for call in downloads} == {0}
    first = downloads[0]
    assert first["dataset"] == {"url_column": "URL", "caption_column": "TEXT"}
    assert first["execution_arn"] == result["executionArn"], "names must hash the parent execution"
    assert first["run_id"] == state["config"]["run_id"]
    training = pipeline.calls["StartTrainingFunction"][0]
    assert training["dataset"]["index_uri"].endswith("/dataset/index.json")
    assert pipeline.calls["DeployEndpointFunction"][0]["training"]["job_name"] == "sdf-tr-x"


def test_pipeline_state_stays_small_whatever_the_shard_count(pipeline: Pipeline) -> None:
    pipeline.behaviours["ValidateRunFunction"] = _validate_run(
        pipeline.s3, 40, {"download": 30, "training": 30, "endpoint": 30}
    )
    result = pipeline.run(_answer_all_success)

    assert result["status"] == "SUCCEEDED"
    assert len(pipeline.calls["StartDownloadFunction"]) == 40
    notification = _notifications(pipeline)[0]
    assert "Download shards" not in notification["state"], "the Map's result must be discarded"
    assert len(json.dumps(notification["state"])) < 4096


def test_pipeline_map_writes_child_results_under_the_runs_prefix(pipeline: Pipeline) -> None:
    result = pipeline.run(_answer_all_success)

    assert result["status"] == "SUCCEEDED"
    execution = result["executionArn"].split(":")[-1]
    listed = pipeline.s3.list_objects_v2(Bucket=DATA_BUCKET, Prefix=f"runs/{execution}/download-results/")
    keys = [obj["Key"] for obj in listed.get("Contents", [])]
    assert len(keys) == 1, keys
    assert keys[0].endswith("/manifest.json"), keys
    manifest = json.loads(pipeline.s3.get_object(Bucket=DATA_BUCKET, Key=keys[0])["Body"].read())
    assert manifest["DestinationBucket"] == DATA_BUCKET
    assert ":mapRun:" in manifest["MapRunArn"]


def test_pipeline_map_children_return_empty_objects_even_when_collected_inline(pipeline: Pipeline) -> None:
    """Were the results collected into the state (no ResultWriter), each shard would cost 3 bytes."""
    definition = json.loads(_definition_for_tests())
    download = definition["States"]["Download shards"]
    del download["ResultWriter"]
    download["ResultPath"] = "$.download_results"
    pipeline.sfn.update_state_machine(stateMachineArn=pipeline.arn, definition=json.dumps(definition))

    def answer(name: str, payload: dict[str, Any]) -> tuple[str, Any]:
        if name == "StartDownloadFunction" and payload["shard"]["shard_id"] == "00001":
            return "failure", ("DownloadJobFailed", "AlgorithmError: parquet has no URL column")
        return _answer_all_success(name, payload)

    result = pipeline.run(answer)

    assert result["status"] == "SUCCEEDED"
    assert _notifications(pipeline)[0]["state"]["download_results"] == [{}, {}, {}]


def test_pipeline_download_held_by_quota_waits_and_retries_with_next_attempt(pipeline: Pipeline) -> None:
    seen: list[int] = []

    def start_download(payload: dict[str, Any]) -> Any:
        if payload["shard"]["shard_id"] == "00002":
            seen.append(payload["attempt"])
            if len(seen) < 3:
                raise LambdaError("SageMakerQuotaExceeded", "ml.c5.xlarge for processing job usage is 2 Instances")
        return _started(payload)

    pipeline.behaviours["StartDownloadFunction"] = start_download

    result = pipeline.run(_answer_all_success)

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
        return _started(payload)

    pipeline.behaviours[function] = start

    result = pipeline.run(_answer_all_success)

    assert result["status"] == "SUCCEEDED"
    assert seen == [0, 1]


def test_pipeline_invalid_run_notifies_failure_and_starts_nothing(pipeline: Pipeline) -> None:
    message = json.dumps([{"field": "training.instance_count", "message": "must be ≥ 1"}])
    pipeline.behaviours["ValidateRunFunction"] = _raise("InvalidRunDocument", message)

    result = pipeline.run(_answer_all_success)

    assert result["status"] == "FAILED"
    assert result.get("error") == "RunFailed"
    assert result["cause"].startswith("InvalidRunDocument: ")
    [notification] = _notifications(pipeline)
    assert notification["outcome"] == "failed"
    assert notification["state"]["error"]["Error"] == "InvalidRunDocument"
    assert "training.instance_count" in notification["state"]["error"]["Cause"]
    assert not pipeline.calls["StartDownloadFunction"]
    assert not pipeline.calls["StartTrainingFunction"]


def test_pipeline_failed_shard_is_retried_once_then_recorded_and_run_continues(pipeline: Pipeline) -> None:
    def answer(name: str, payload: dict[str, Any]) -> tuple[str, Any]:
        if name == "StartDownloadFunction" and payload["shard"]["shard_id"] == "00001":
            return "failure", ("DownloadJobFailed", "AlgorithmError: parquet has no URL column")
        return _answer_all_success(name, payload)

    result = pipeline.run(answer)

    assert result["status"] == "SUCCEEDED"
    attempts = [c["attempt"] for c in pipeline.calls["StartDownloadFunction"] if c["shard"]["shard_id"] == "00001"]
    assert attempts == [0, 1], "a failed download is retried once, with a new attempt number"
    assert len(pipeline.calls["BuildIndexFunction"]) == 1


def test_pipeline_no_usable_shards_notifies_failure_without_training(pipeline: Pipeline) -> None:
    pipeline.behaviours["BuildIndexFunction"] = _raise(errors.NoUsableShards.__name__, "3 of 3 shards failed")

    result = pipeline.run(_answer_all_success)

    assert result["status"] == "FAILED"
    assert result.get("error") == "RunFailed"
    assert result["cause"].startswith("NoUsableShards: ")
    assert not pipeline.calls["StartTrainingFunction"]
    assert _notifications(pipeline)[0]["state"]["error"]["Error"] == "NoUsableShards"


def test_pipeline_training_job_failure_notifies_failure_and_deploys_nothing(pipeline: Pipeline) -> None:
    def answer(name: str, payload: dict[str, Any]) -> tuple[str, Any]:
        if name == "StartTrainingFunction":
            return "failure", ("TrainingJobFailed", "AlgorithmError: CUDA out of memory")
        return _answer_all_success(name, payload)

    result = pipeline.run(answer)

    assert result["status"] == "FAILED"
    assert result.get("error") == "RunFailed"
    assert result["cause"].startswith("TrainingJobFailed: ")
    assert not pipeline.calls["DeployEndpointFunction"]
    [notification] = _notifications(pipeline)
    # moto 5.2.5 drops SendTaskFailure's cause (the local runtime patches that), so only
    # the error name is checked here; the cause's path is the same as the error's.
    assert notification["state"]["error"]["Error"] == "TrainingJobFailed"
    assert len(pipeline.calls["StartTrainingFunction"]) == 1, "SageMaker's RetryStrategy retries, not the state"


def test_pipeline_throttled_training_start_is_retried_with_next_attempt(pipeline: Pipeline) -> None:
    seen: list[int] = []

    def start_training(payload: dict[str, Any]) -> Any:
        seen.append(payload["attempt"])
        if len(seen) == 1:
            raise LambdaError("SageMakerThrottled", "Rate exceeded")
        return _started(payload)

    pipeline.behaviours["StartTrainingFunction"] = start_training

    result = pipeline.run(_answer_all_success)

    assert result["status"] == "SUCCEEDED"
    assert seen == [0, 1]


def test_pipeline_endpoint_rollback_notifies_failure(pipeline: Pipeline) -> None:
    def answer(name: str, payload: dict[str, Any]) -> tuple[str, Any]:
        if name == "DeployEndpointFunction":
            return "failure", ("EndpointDeployFailed", "update rolled back to sdflow-old-a0")
        return _answer_all_success(name, payload)

    result = pipeline.run(answer)

    assert result["status"] == "FAILED"
    assert result.get("error") == "RunFailed"
    assert result["cause"].startswith("EndpointDeployFailed: ")
    assert _notifications(pipeline)[0]["state"]["training"]["job_name"] == "sdf-tr-x"


def test_pipeline_lost_training_event_times_out_and_notifies_failure(pipeline: Pipeline) -> None:
    pipeline.behaviours["ValidateRunFunction"] = _validate_run(
        pipeline.s3, 1, {"download": 30, "training": 2, "endpoint": 30}
    )

    def answer(name: str, payload: dict[str, Any]) -> tuple[str, Any] | None:
        return None if name == "StartTrainingFunction" else _answer_all_success(name, payload)

    result = pipeline.run(answer)

    assert result["status"] == "FAILED"
    assert result.get("error") == "RunFailed"
    assert result["cause"].startswith("States.Timeout: ")
    assert _notifications(pipeline)[0]["state"]["error"]["Error"] == "States.Timeout"


def test_pipeline_definition_names_states_as_verb_phrases() -> None:
    definition = json.loads(ASL.read_text())
    names = list(definition["States"]) + list(definition["States"]["Download shards"]["ItemProcessor"]["States"])
    for name in names:
        assert re.fullmatch(r"[A-Z][a-z]+( [a-z]+)+", name), f"state '{name}' is not a verb phrase"
