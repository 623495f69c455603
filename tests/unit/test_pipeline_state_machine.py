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

from sdflow.local import patching
from sdflow.local.clock import Clock
from sdflow.local.runtime import Runtime
from sdflow_common import errors, names
from tests.constants import REGION, TIME_SCALE
from tests.helpers import wait_for
from tests.unit.helpers import DATA_BUCKET
from tests.unit.intake_harness import InProcessRunner, pipeline_definition

ASL = Path(__file__).resolve().parents[2] / "statemachines" / "pipeline.asl.json"
FUNCTIONS = (
    "ValidateRunFunction",
    "StartDownloadFunction",
    "BuildIndexFunction",
    "StartTrainingFunction",
    "StartEvaluationFunction",
    "RegisterModelFunction",
    "AwaitApprovalFunction",
    "DeployEndpointFunction",
)
HOUR, DAY = 3600, 86_400
# Task timeouts as run documents give them (hours: the clock is scaled, so they cost nothing).
HOURS_4 = {"download": 4 * HOUR, "training": 4 * HOUR, "endpoint": 4 * HOUR}
DISTINCT_TIMEOUTS = {"download": 4 * HOUR, "training": 4 * HOUR + 1, "endpoint": 4 * HOUR + 2}
RUN_DOCUMENT = {
    "run_name": "cats",
    "dataset": {"prefix": f"s3://{DATA_BUCKET}/datasets/cats/"},
    "base_model_uri": f"s3://{DATA_BUCKET}/models/tiny/",
}

Behaviour = Callable[[dict[str, Any]], Any]


def _definition() -> str:
    """The real definition, Retry intervals as written (the runtime's clock is scaled)."""
    text, functions = pipeline_definition()
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
    clock: Clock = field(default_factory=lambda: Clock(scale=TIME_SCALE))

    def invoke(self, function_name: str, payload: dict[str, Any]) -> Any:
        name = function_name.split(":")[-1]
        with self.lock:
            self.calls[name].append(payload)
        result = self.behaviours[name](payload)
        # A starter that raised created nothing: its attempt's token is closed by the Retry.
        if "token" in payload:
            self.tokens.put((name, payload))
        return result

    def pass_task_timeout(self) -> None:
        """Advance the clock past the waiting task's TimeoutSeconds (what nobody answering does)."""
        wait_for(
            lambda: self.clock.advance_to_next(what="TimeoutSeconds"),
            timeout_s=10,
            what="a task waiting with TimeoutSeconds",
            interval_s=0.01,
        )

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


def _validate_run(
    s3: Any,
    shard_count: int,
    timeouts: dict[str, int],
    *,
    cached: frozenset[int] = frozenset(),
    resume: dict[str, Any] | None = None,
) -> Behaviour:
    def behaviour(payload: dict[str, Any]) -> dict[str, Any]:
        run_id = payload["execution_name"]
        shards = [
            {
                "shard_id": f"{i:05d}",
                "parquet_uri": f"s3://{DATA_BUCKET}/datasets/cats/part-{i}.parquet",
                "output_uri": f"s3://{DATA_BUCKET}/runs/{run_id}/dataset/shards/{i:05d}/",
                "cached": i in cached,
            }
            for i in range(shard_count)
        ]
        key = f"runs/{run_id}/shards.json"
        s3.put_object(Bucket=DATA_BUCKET, Key=key, Body=json.dumps(shards).encode())
        run = {**payload["run"], "download": {"max_concurrency": 2, "tolerated_failure_percent": 40}}
        run["dataset"] = {**run["dataset"], "url_column": "URL", "caption_column": "TEXT"}
        config = {
            "run_id": run_id,
            "execution_arn": payload["execution_arn"],
            "bucket": DATA_BUCKET,
            "shard_list_key": key,
            "shard_count": shard_count,
            "dataset_prefix_uri": f"s3://{DATA_BUCKET}/runs/{run_id}/dataset/",
            "timeouts": {"evaluation": 4 * HOUR + 3, "approval": 4 * HOUR + 4, **timeouts},
            "run": run,
        }
        if resume is not None:
            config["resume"] = resume
        return config

    return behaviour


def _build_index(payload: dict[str, Any]) -> dict[str, Any]:
    return {
        "index_uri": f"s3://{DATA_BUCKET}/runs/{payload['config']['run_id']}/dataset/index.json",
        "total_samples": 100,
        "shards_ok": payload["config"]["shard_count"],
        "shards_empty": 0,
        "shards_failed": 0,
        "failed_shards": [],
        "manifest_uri": f"s3://{DATA_BUCKET}/runs/{payload['config']['run_id']}/dataset/manifest.json",
    }


def _started(payload: dict[str, Any]) -> dict[str, str]:
    return {"resource_name": f"sdf-test-{payload.get('attempt', 0)}"}


PACKAGE_ARN = "arn:aws:sagemaker:us-east-1:123456789012:model-package/sdf-cats/1"


def _register(status: str = "Approved") -> Behaviour:
    def behaviour(payload: dict[str, Any]) -> dict[str, Any]:
        return {
            "model_package_arn": PACKAGE_ARN,
            "approval_status": status,
            "prompt_adherence": 0.9,
            "training_job": payload["training"]["job_name"],
            "evaluation_job": payload["evaluation"]["job_name"],
        }

    return behaviour


def _answer_all_success(name: str, payload: dict[str, Any]) -> tuple[str, Any]:
    if name == "StartDownloadFunction":
        return "success", {"shard_id": payload["shard"]["shard_id"], "status": "ok", "job_name": "sdf-dl-x"}
    if name == "StartTrainingFunction":
        return "success", {
            "job_name": "sdf-tr-x",
            "model_data_url": "s3://b/model.tar.gz",
            "final_metrics": {"train:loss": 0.125},
        }
    if name == "StartEvaluationFunction":
        return "success", {"job_name": "sdf-ev-x", "evaluation_uri": "s3://b/runs/x/evaluation/sdf-ev-x/"}
    if name == "AwaitApprovalFunction":
        return "success", {"model_package_arn": payload["model_package_arn"], "approval_status": "Approved"}
    return "success", {
        "endpoint_name": "sdflow",
        "endpoint_config_name": "sdflow-abc-a0",
        "model_name": "sdflow-abc-a0",
        "action": "create",
    }


@pytest.fixture
def pipeline(aws_env: None, tmp_path: Path) -> Iterator[Pipeline]:
    """The definition runs on the local cloud's Step Functions (moto's interpreter with the
    local patches: the context object's RedriveCount, Map Runs, tolerated failures), as in
    `sdflow local up`; only the functions are doubles."""
    config = {"stepfunctions": {"execute_state_machine": True}, "lambda": {"use_docker": False}}
    with mock_aws(config=config):
        s3 = boto3.client("s3", region_name=REGION)
        s3.create_bucket(Bucket=DATA_BUCKET)
        iam = boto3.client("iam", region_name=REGION)
        role = iam.create_role(RoleName="fn", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
        sfn = boto3.client("stepfunctions", region_name=REGION)
        harness = Pipeline(sfn=sfn, s3=s3, arn="")
        runtime = Runtime(
            workdir=tmp_path,
            lambda_runner=InProcessRunner(harness.invoke),  # type: ignore[arg-type]
            async_retry_delays_s=(),
            clock=harness.clock,
        )
        with patching.patched(runtime):
            awslambda = boto3.client("lambda", region_name=REGION)
            for name in FUNCTIONS:
                awslambda.create_function(
                    FunctionName=name,
                    Runtime="python3.11",
                    Role=role,
                    Handler="app.lambda_handler",
                    Code={"ZipFile": b"double"},
                )
                runtime.register_code(name, tmp_path)
            harness.arn = sfn.create_state_machine(name="sdflow-test-pipeline", definition=_definition(), roleArn=role)[
                "stateMachineArn"
            ]
            harness.behaviours = {
                "ValidateRunFunction": _validate_run(s3, 3, DISTINCT_TIMEOUTS),
                "StartDownloadFunction": _started,
                "BuildIndexFunction": _build_index,
                "StartTrainingFunction": _started,
                "StartEvaluationFunction": _started,
                "RegisterModelFunction": _register(),
                "AwaitApprovalFunction": _started,
                "DeployEndpointFunction": _started,
            }
            yield harness


def _raise(error_type: str, message: str) -> Behaviour:
    def behaviour(payload: dict[str, Any]) -> Any:
        raise LambdaError(error_type, message)

    return behaviour


def _final_state(result: dict[str, Any]) -> dict[str, Any]:
    return dict(json.loads(result["output"]))


def test_pipeline_all_steps_succeed_with_every_result_in_the_output(pipeline: Pipeline) -> None:
    result = pipeline.run(_answer_all_success)

    assert result["status"] == "SUCCEEDED"
    state = _final_state(result)
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
    assert pipeline.calls["StartEvaluationFunction"][0]["training"]["job_name"] == "sdf-tr-x"
    register = pipeline.calls["RegisterModelFunction"][0]
    assert register["evaluation"]["evaluation_uri"] == "s3://b/runs/x/evaluation/sdf-ev-x/"
    assert register["dataset"]["index_uri"].endswith("/dataset/index.json")
    assert not pipeline.calls["AwaitApprovalFunction"], "auto approval deploys at once"
    deploy = pipeline.calls["DeployEndpointFunction"][0]
    assert deploy["training"]["job_name"] == "sdf-tr-x"
    assert deploy["model"]["model_package_arn"] == PACKAGE_ARN


def test_pipeline_quality_gate_failed_fails_the_run_before_deploy(pipeline: Pipeline) -> None:
    pipeline.behaviours["RegisterModelFunction"] = _raise("QualityGateFailed", "prompt adherence 0.40 is below 0.80")

    result = pipeline.run(_answer_all_success)

    assert result["status"] == "FAILED"
    assert result.get("error") == "QualityGateFailed"
    assert len(pipeline.calls["RegisterModelFunction"]) == 1, "a failed gate is not retried"
    assert not pipeline.calls["DeployEndpointFunction"]


def test_pipeline_manual_approval_waits_for_the_decision_then_deploys(pipeline: Pipeline) -> None:
    pipeline.behaviours["RegisterModelFunction"] = _register("PendingManualApproval")

    result = pipeline.run(_answer_all_success)

    assert result["status"] == "SUCCEEDED", result.get("cause")
    [wait] = pipeline.calls["AwaitApprovalFunction"]
    assert wait["model_package_arn"] == PACKAGE_ARN
    assert wait["timeout_seconds"] == 4 * HOUR + 4
    assert _final_state(result)["approval"]["approval_status"] == "Approved"
    assert pipeline.calls["DeployEndpointFunction"]


@pytest.mark.parametrize(
    ("answer_approval", "error"),
    [
        (("failure", ("ModelRejected", "model package was rejected: blurry")), "ModelRejected"),
        (None, "States.Timeout"),
    ],
    ids=["rejected", "timed-out"],
)
def test_pipeline_manual_approval_rejected_or_timed_out_fails_without_deploy(
    pipeline: Pipeline, answer_approval: tuple[str, Any] | None, error: str
) -> None:
    pipeline.behaviours["RegisterModelFunction"] = _register("PendingManualApproval")
    pipeline.behaviours["ValidateRunFunction"] = _validate_run(
        pipeline.s3, 1, {"download": 4 * HOUR, "training": 4 * HOUR, "endpoint": 4 * HOUR, "approval": DAY}
    )

    def answer(name: str, payload: dict[str, Any]) -> tuple[str, Any] | None:
        if name != "AwaitApprovalFunction":
            return _answer_all_success(name, payload)
        if answer_approval is None:  # nobody decides: a day passes
            pipeline.pass_task_timeout()
        return answer_approval

    result = pipeline.run(answer)

    assert result["status"] == "FAILED"
    assert result.get("error") == error
    assert not pipeline.calls["DeployEndpointFunction"]


def test_pipeline_callback_payloads_carry_the_execution_identity_and_the_timeout(pipeline: Pipeline) -> None:
    """Job names hash the execution ARN, its start time and the redrive count; the claim's
    deadline is the task's timeout."""
    result = pipeline.run(_answer_all_success)

    assert result["status"] == "SUCCEEDED"
    started = result["startDate"].timestamp()
    calls = {
        "download": (pipeline.calls["StartDownloadFunction"][0], 4 * HOUR),
        "training": (pipeline.calls["StartTrainingFunction"][0], 4 * HOUR + 1),
        "endpoint": (pipeline.calls["DeployEndpointFunction"][0], 4 * HOUR + 2),
    }
    for kind, (call, timeout) in calls.items():
        assert call["execution_arn"] == result["executionArn"], kind
        assert abs(names.start_millis(call["start_time"]) / 1000 - started) < 1, kind
        assert call["redrive_count"] == 0, kind
        assert call["timeout_seconds"] == timeout, kind
    assert calls["download"][0]["child_redrive_count"] == 0


def test_pipeline_state_stays_small_whatever_the_shard_count(pipeline: Pipeline) -> None:
    pipeline.behaviours["ValidateRunFunction"] = _validate_run(pipeline.s3, 40, HOURS_4)
    result = pipeline.run(_answer_all_success)

    assert result["status"] == "SUCCEEDED"
    assert len(pipeline.calls["StartDownloadFunction"]) == 40
    state = _final_state(result)
    assert "Download shards" not in state, "the Map's result must be discarded"
    assert len(json.dumps(state)) < 4096


def test_pipeline_map_writes_child_results_under_the_runs_prefix(pipeline: Pipeline) -> None:
    result = pipeline.run(_answer_all_success)

    assert result["status"] == "SUCCEEDED"
    execution = result["executionArn"].split(":")[-1]
    listed = pipeline.s3.list_objects_v2(Bucket=DATA_BUCKET, Prefix=f"runs/{execution}/download-results/")
    keys = [obj["Key"] for obj in listed.get("Contents", [])]
    assert sorted(key.rsplit("/", 1)[-1] for key in keys) == ["SUCCEEDED_0.json", "manifest.json"], keys
    manifest_key = next(key for key in keys if key.endswith("/manifest.json"))
    manifest = json.loads(pipeline.s3.get_object(Bucket=DATA_BUCKET, Key=manifest_key)["Body"].read())
    assert manifest["DestinationBucket"] == DATA_BUCKET
    assert ":mapRun:" in manifest["MapRunArn"]


def test_pipeline_map_children_return_empty_objects_even_when_collected_inline(pipeline: Pipeline) -> None:
    """Were the results collected into the state (no ResultWriter), each shard would cost 3 bytes."""
    definition = json.loads(_definition())
    download = definition["States"]["Download shards"]
    del download["ResultWriter"]
    download["ResultPath"] = "$.download_results"
    pipeline.sfn.update_state_machine(stateMachineArn=pipeline.arn, definition=json.dumps(definition))

    result = pipeline.run(_answer_all_success)

    assert result["status"] == "SUCCEEDED"
    assert _final_state(result)["download_results"] == [{}, {}, {}]


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

    result = pipeline.run(_answer_all_success)

    assert result["status"] == "SUCCEEDED", result.get("cause")
    assert crashed == [function]


def test_pipeline_invalid_run_fails_at_validation_and_starts_nothing(pipeline: Pipeline) -> None:
    message = json.dumps([{"field": "training.instance_count", "message": "must be ≥ 1"}])
    pipeline.behaviours["ValidateRunFunction"] = _raise("InvalidRunDocument", message)

    result = pipeline.run(_answer_all_success)

    assert result["status"] == "FAILED"
    assert result.get("error") == "InvalidRunDocument"
    assert "training.instance_count" in result["cause"]
    assert not pipeline.calls["StartDownloadFunction"]
    assert not pipeline.calls["StartTrainingFunction"]


def test_pipeline_failed_shard_is_retried_once_then_fails_its_child_and_run_continues(pipeline: Pipeline) -> None:
    def answer(name: str, payload: dict[str, Any]) -> tuple[str, Any]:
        if name == "StartDownloadFunction" and payload["shard"]["shard_id"] == "00001":
            return "failure", ("DownloadJobFailed", "AlgorithmError: parquet has no URL column")
        return _answer_all_success(name, payload)

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
    pipeline.behaviours["ValidateRunFunction"] = _validate_run(pipeline.s3, 3, HOURS_4, cached=frozenset({0, 2}))

    result = pipeline.run(_answer_all_success)

    assert result["status"] == "SUCCEEDED"
    assert [call["shard"]["shard_id"] for call in pipeline.calls["StartDownloadFunction"]] == ["00001"]


def test_pipeline_reused_training_deploys_the_earlier_model_without_training(pipeline: Pipeline) -> None:
    earlier = {"job_name": "sdf-tr-old", "model_data_url": "s3://b/old/model.tar.gz", "final_metrics": {}}
    resume = {"from_execution_arn": "arn:aws:states:us-east-1:123456789012:execution:p:old", "training": earlier}
    pipeline.behaviours["ValidateRunFunction"] = _validate_run(
        pipeline.s3,
        2,
        HOURS_4,
        cached=frozenset({0, 1}),
        resume=resume,
    )

    result = pipeline.run(_answer_all_success)

    assert result["status"] == "SUCCEEDED"
    assert not pipeline.calls["StartDownloadFunction"]
    assert not pipeline.calls["StartTrainingFunction"]
    assert pipeline.calls["StartEvaluationFunction"][0]["training"] == earlier, "a reused model is evaluated too"
    assert pipeline.calls["DeployEndpointFunction"][0]["training"] == earlier


def test_pipeline_no_usable_shards_fails_without_training(pipeline: Pipeline) -> None:
    pipeline.behaviours["BuildIndexFunction"] = _raise(errors.NoUsableShards.__name__, "3 of 3 shards failed")

    result = pipeline.run(_answer_all_success)

    assert result["status"] == "FAILED"
    assert result.get("error") == "NoUsableShards"
    assert not pipeline.calls["StartTrainingFunction"]


def test_pipeline_training_job_failure_fails_the_run_and_deploys_nothing(pipeline: Pipeline) -> None:
    def answer(name: str, payload: dict[str, Any]) -> tuple[str, Any]:
        if name == "StartTrainingFunction":
            return "failure", ("TrainingJobFailed", "AlgorithmError: CUDA out of memory")
        return _answer_all_success(name, payload)

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
        return _answer_all_success(name, payload)

    result = pipeline.run(answer)

    assert result["status"] == "SUCCEEDED", result.get("cause")
    assert [call["attempt"] for call in pipeline.calls["StartTrainingFunction"]] == [0, 1]


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


def test_pipeline_endpoint_rollback_fails_the_run(pipeline: Pipeline) -> None:
    def answer(name: str, payload: dict[str, Any]) -> tuple[str, Any]:
        if name == "DeployEndpointFunction":
            return "failure", ("EndpointDeployFailed", "update rolled back to sdflow-old-a0")
        return _answer_all_success(name, payload)

    result = pipeline.run(answer)

    assert result["status"] == "FAILED"
    assert result.get("error") == "EndpointDeployFailed"


def test_pipeline_lost_training_event_times_out_and_fails_the_run(pipeline: Pipeline) -> None:
    pipeline.behaviours["ValidateRunFunction"] = _validate_run(
        pipeline.s3, 1, {"download": 4 * HOUR, "training": DAY, "endpoint": 4 * HOUR}
    )

    def answer(name: str, payload: dict[str, Any]) -> tuple[str, Any] | None:
        if name != "StartTrainingFunction":
            return _answer_all_success(name, payload)
        pipeline.pass_task_timeout()  # the job's event never comes: a day passes
        return None

    result = pipeline.run(answer)

    assert result["status"] == "FAILED"
    assert result.get("error") == "States.Timeout"


def test_pipeline_definition_names_states_as_verb_phrases() -> None:
    definition = json.loads(ASL.read_text())
    names = list(definition["States"]) + list(definition["States"]["Download shards"]["ItemProcessor"]["States"])
    for name in names:
        assert re.fullmatch(r"[A-Z][a-z]+( [a-z]+)+", name), f"state '{name}' is not a verb phrase"
