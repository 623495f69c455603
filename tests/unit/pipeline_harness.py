"""The harness of the pipeline state machine tests (tests/unit/test_pipeline_state_machine*.py):
statemachines/pipeline.asl.json executed by moto's Step Functions interpreter.

Every Lambda task is answered by a test double that plays the function's contract
(docs/contracts.md); callback tasks hand their token to the test, which resolves it the way
job_events would. What is under test is the definition: the flow, the data passed between
states, Retry and Catch, the Distributed Map, the timeouts and the failure path."""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
from moto import mock_aws

from sdflow.local import patching
from sdflow.local.clock import Clock
from sdflow.local.runtime import Runtime
from tests.constants import REGION, TIME_SCALE
from tests.helpers import wait_for
from tests.unit.helpers import DATA_BUCKET
from tests.unit.intake_harness import InProcessRunner, pipeline_definition

ASL = Path(__file__).resolve().parents[2] / "statemachines" / "pipeline.asl.json"
FUNCTIONS = (
    "ValidateRunFunction",
    "StartDownloadFunction",
    "FindDuplicatesFunction",
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


def pipeline_definition_text() -> str:
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


def validate_run_behaviour(
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
        # As Validate run writes it back: the block with its defaults (deduplication on).
        run["deduplication"] = {"enabled": True, **(run.get("deduplication") or {})}
        run["dataset"] = {**run["dataset"], "url_column": "URL", "caption_column": "TEXT", "filters": None}
        config = {
            "run_id": run_id,
            "execution_arn": payload["execution_arn"],
            "bucket": DATA_BUCKET,
            "shard_list_key": key,
            "shard_count": shard_count,
            "dataset_prefix_uri": f"s3://{DATA_BUCKET}/runs/{run_id}/dataset/",
            "timeouts": {"evaluation": 4 * HOUR + 3, "approval": 4 * HOUR + 4, "dedup": 4 * HOUR + 5, **timeouts},
            "run": run,
            "holdout_rate": 0.0,
        }
        if resume is not None:
            config["resume"] = resume
        return config

    return behaviour


def build_index_behaviour(payload: dict[str, Any]) -> dict[str, Any]:
    return {
        "index_uri": f"s3://{DATA_BUCKET}/runs/{payload['config']['run_id']}/dataset/index.json",
        "total_samples": 100,
        "shards_ok": payload["config"]["shard_count"],
        "shards_empty": 0,
        "shards_failed": 0,
        "failed_shards": [],
        "manifest_uri": f"s3://{DATA_BUCKET}/runs/{payload['config']['run_id']}/dataset/manifest.json",
        "holdout_samples": 0,
        "holdout_manifest_uri": None,
        "curation": {"rows_read": 120, "filter_drops": {"min_width": 20}, "kept": 100, "deduplicated": False},
    }


def started_behaviour(payload: dict[str, Any]) -> dict[str, str]:
    return {"resource_name": f"sdf-test-{payload.get('attempt', 0)}"}


DEDUP_SUMMARY_URI = f"s3://{DATA_BUCKET}/runs/x/dataset/dedup/summary.json"
PACKAGE_ARN = "arn:aws:sagemaker:us-east-1:123456789012:model-package/sdf-cats/1"


def register_behaviour(status: str = "Approved") -> Behaviour:
    def behaviour(payload: dict[str, Any]) -> dict[str, Any]:
        return {
            "model_package_arn": PACKAGE_ARN,
            "approval_status": status,
            "prompt_adherence": 0.9,
            "training_job": payload["training"]["job_name"],
            "evaluation_job": payload["evaluation"]["job_name"],
        }

    return behaviour


def answer_all_success(name: str, payload: dict[str, Any]) -> tuple[str, Any]:
    if name == "StartDownloadFunction":
        return "success", {"shard_id": payload["shard"]["shard_id"], "status": "ok", "job_name": "sdf-dl-x"}
    if name == "FindDuplicatesFunction":
        return "success", {"job_name": "sdf-dd-x", "summary_uri": DEDUP_SUMMARY_URI}
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


@contextlib.contextmanager
def pipeline_on_local_stepfunctions(tmp_path: Path) -> Iterator[Pipeline]:
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
            harness.arn = sfn.create_state_machine(
                name="sdflow-test-pipeline", definition=pipeline_definition_text(), roleArn=role
            )["stateMachineArn"]
            harness.behaviours = {
                "ValidateRunFunction": validate_run_behaviour(s3, 3, DISTINCT_TIMEOUTS),
                "StartDownloadFunction": started_behaviour,
                "FindDuplicatesFunction": started_behaviour,
                "BuildIndexFunction": build_index_behaviour,
                "StartTrainingFunction": started_behaviour,
                "StartEvaluationFunction": started_behaviour,
                "RegisterModelFunction": register_behaviour(),
                "AwaitApprovalFunction": started_behaviour,
                "DeployEndpointFunction": started_behaviour,
            }
            yield harness


def raise_behaviour(error_type: str, message: str) -> Behaviour:
    def behaviour(payload: dict[str, Any]) -> Any:
        raise LambdaError(error_type, message)

    return behaviour


def final_state(result: dict[str, Any]) -> dict[str, Any]:
    return dict(json.loads(result["output"]))
