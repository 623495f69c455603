"""The local cloud with template.yaml deployed: real handlers, real rules, real state machine.

SageMaker work goes to a recording fake here (the local SageMaker has its own tests, and full
runs with training are the demo's tests); everything else is the real local runtime."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from botocore.config import Config

from sdflow import samples
from sdflow.local import template
from sdflow.local.cloud import ACCOUNT_ID, REGION, LocalCloud
from sdflow.local.lambda_runner import DEFAULT_MAX_WORKERS_TOTAL
from sdflow.local.services import events
from tests.helpers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


class RecordingSageMaker:
    """Stands in for LocalSageMaker: records requests, runs nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def run_processing_job(self, request: dict[str, Any]) -> None:
        self.calls.append(("processing", request))

    def run_training_job(self, request: dict[str, Any]) -> None:
        self.calls.append(("training", request))

    def deploy_endpoint(self, endpoint_name: str, endpoint_config: dict[str, Any], model: dict[str, Any]) -> None:
        self.calls.append(("endpoint", {"EndpointName": endpoint_name}))

    def invoke_endpoint(self, endpoint_name: str, body: bytes, content_type: str, accept: str) -> tuple[bytes, str]:
        return b"", "application/octet-stream"

    def stop_job(self, kind: str, name: str) -> None:
        self.calls.append(("stop", {"kind": kind, "name": name}))

    def processing_jobs(self, run_id: str) -> list[str]:
        return [
            r["ProcessingJobName"]
            for kind, r in self.calls
            if kind == "processing" and run_id in r["ProcessingJobName"]
        ]


def _wait_for(predicate: Callable[[], Any], what: str = "condition") -> Any:
    return wait_for(predicate, timeout_s=60.0, what=what, interval_s=0.2)


@pytest.fixture(scope="module")
def sagemaker() -> RecordingSageMaker:
    return RecordingSageMaker()


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory, sagemaker: RecordingSageMaker) -> Iterator[LocalCloud]:
    workdir = tmp_path_factory.mktemp("local-cloud")
    with LocalCloud(workdir, sagemaker_factory=lambda *_: sagemaker, async_retry_delays_s=()) as running:
        s3 = running.client("s3")
        # Intake reads each parquet footer (start_pipeline and Validate run refuse what no job could use): a row
        # for each of the default training instance's 4 GPUs (model_checks.batch_warnings).
        rows = [samples.SampleRow(f"http://127.0.0.1:9/{n}.jpg", "a") for n in range(4)]
        parquet = samples.write_parquet(workdir / "part-00000.parquet", rows)
        s3.put_object(Bucket=running.bucket, Key="datasets/tiny/part-00000.parquet", Body=parquet.read_bytes())
        s3.put_object(
            Bucket=running.bucket,
            Key="models/tiny/model_index.json",
            Body=b'{"_class_name": "StableDiffusionPipeline"}',
        )
        yield running


def _document(cloud: LocalCloud, run_name: str) -> dict[str, Any]:
    return {
        "run_name": run_name,
        "dataset": {"prefix": f"s3://{cloud.bucket}/datasets/tiny/"},
        "base_model_uri": f"s3://{cloud.bucket}/models/tiny/",
    }


def _executions(cloud: LocalCloud) -> list[dict[str, Any]]:
    return list(cloud.client("stepfunctions").list_executions(stateMachineArn=cloud.state_machine_arn)["executions"])


def _history_types(cloud: LocalCloud, execution_arn: str) -> list[str]:
    events = cloud.client("stepfunctions").get_execution_history(executionArn=execution_arn, maxResults=1000)
    return [event["type"] for event in events["events"]]


def test_local_cloud_deploys_every_template_resource_on_loopback(cloud: LocalCloud) -> None:
    declared = template.load_template(ROOT / "template.yaml")["Resources"]
    functions = {k for k, v in declared.items() if v["Type"] == "AWS::Serverless::Function"}
    assert cloud._server.get_host_and_port()[0] == "127.0.0.1"
    assert set(cloud.deployment.functions) == functions  # type: ignore[union-attr]
    assert len(functions) == 13

    start_pipeline = cloud.deployment.functions["StartPipelineFunction"]  # type: ignore[union-attr]
    assert start_pipeline.environment["STATE_MACHINE_ARN"] == cloud.state_machine_arn
    assert start_pipeline.environment["TOPIC_ARN"] == cloud.topic_arn
    assert start_pipeline.environment["DATA_BUCKET"] == cloud.bucket
    assert start_pipeline.environment["MAX_SHARDS"] == "10000"
    assert start_pipeline.code_dir == ROOT / "functions" / "start_pipeline"
    assert start_pipeline.layer_dirs == (ROOT / "layers" / "common",)

    machine = cloud.client("stepfunctions").describe_state_machine(stateMachineArn=cloud.state_machine_arn)
    assert "${" not in machine["definition"]
    assert cloud.deployment.functions["ValidateRunFunction"].arn in machine["definition"]  # type: ignore[union-attr]

    rules = cloud.client("events").list_rules()["Rules"]
    patterns = [json.loads(rule["EventPattern"]) for rule in rules]
    [s3_pattern] = [p for p in patterns if p["source"] == ["aws.s3"]]
    assert s3_pattern["detail"]["bucket"]["name"] == [cloud.bucket]
    assert s3_pattern["detail"]["object"]["key"] == [{"wildcard": "manifests/*.json"}]
    assert len(rules) == 6  # manifest, execution status, processing, training, endpoint, model package
    [run_ended] = [p for p in patterns if p["source"] == ["aws.states"]]
    assert run_ended["detail"]["stateMachineArn"] == [cloud.state_machine_arn]
    assert cloud.client("scheduler").list_schedules()["Schedules"], "the reconciler's schedule exists"
    assert cloud.client("s3").get_bucket_versioning(Bucket=cloud.bucket)["Status"] == "Enabled"


def test_local_cloud_invalid_manifest_is_rejected_and_notified_without_execution(cloud: LocalCloud) -> None:
    s3 = cloud.client("s3")
    before = len(_executions(cloud))
    s3.put_object(Bucket=cloud.bucket, Key="manifests/broken.json", Body=b'{"dataset": {}, "colour": "blue"}')
    report = _wait_for(
        lambda: s3.list_objects_v2(Bucket=cloud.bucket, Prefix="rejected/manifests/broken.json").get("Contents"),
        what="the rejection report",
    )
    assert report[0]["Key"] == "rejected/manifests/broken.json.errors.json"
    errors = json.loads(s3.get_object(Bucket=cloud.bucket, Key=report[0]["Key"])["Body"].read())["errors"]
    assert {"base_model_uri", "colour"} <= {error["field"] for error in errors}
    assert cloud.wait_idle(30)
    [message] = [m for m in cloud.sns_messages() if "broken.json" in m["message"]]
    assert message["subject"] == "[sdflow] Run manifest rejected: broken.json"
    assert message["attributes"]["outcome"] == "rejected"
    assert len(_executions(cloud)) == before


def _start_execution_with_cli(cloud: LocalCloud, document: dict[str, Any], tmp_path: Path) -> str:
    """StartExecution through the AWS CLI when it is installed (else boto3, the same API call)."""
    aws = shutil.which("aws")
    if aws is None:
        return str(
            cloud.client("stepfunctions").start_execution(
                stateMachineArn=cloud.state_machine_arn, name="api-run", input=json.dumps(document)
            )["executionArn"]
        )
    run_json = tmp_path / "run.json"
    run_json.write_text(json.dumps(document))
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        **cloud.cli_env(),
    }
    command = [aws, "stepfunctions", "start-execution", "--state-machine-arn", cloud.state_machine_arn]
    command += ["--name", "api-run", "--input", f"file://{run_json}", "--output", "json"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=True)
    return str(json.loads(result.stdout)["executionArn"])


def test_local_cloud_start_execution_runs_real_validate_run(
    cloud: LocalCloud, sagemaker: RecordingSageMaker, tmp_path: Path
) -> None:
    execution_arn = _start_execution_with_cli(cloud, _document(cloud, "api"), tmp_path)
    s3 = cloud.client("s3")
    shards = _wait_for(
        lambda: s3.list_objects_v2(Bucket=cloud.bucket, Prefix="runs/api-run/shards.json").get("Contents"),
        what="validate_run's shard list",
    )
    shard_list = json.loads(s3.get_object(Bucket=cloud.bucket, Key=shards[0]["Key"])["Body"].read())
    assert [s["parquet_uri"] for s in shard_list] == [f"s3://{cloud.bucket}/datasets/tiny/part-00000.parquet"]
    # The Distributed Map's child ran the real start_download, which created the processing job.
    [job] = _wait_for(lambda: sagemaker.processing_jobs("api-run"), what="the download job")
    described = cloud.client("sagemaker").describe_processing_job(ProcessingJobName=job)
    assert described["ProcessingJobStatus"] == "InProgress"
    cloud.client("stepfunctions").stop_execution(executionArn=execution_arn)


def test_local_cloud_redelivered_upload_event_starts_one_execution(cloud: LocalCloud) -> None:
    s3 = cloud.client("s3")
    key = "manifests/twice.json"
    s3.put_object(Bucket=cloud.bucket, Key=key, Body=json.dumps(_document(cloud, "twice")).encode())
    [first] = _wait_for(
        lambda: [e for e in _executions(cloud) if e["name"].startswith("twice-")], what="the first execution"
    )
    assert cloud.wait_idle(30)
    head = s3.head_object(Bucket=cloud.bucket, Key=key)
    # EventBridge delivers at least once: the same "Object Created" event arrives again.
    detail = {
        "version": "0",
        "bucket": {"name": cloud.bucket},
        "object": {
            "key": key,
            "size": head["ContentLength"],
            "etag": head["ETag"].strip('"'),
            "version-id": head["VersionId"],
        },
        "reason": "PutObject",
    }
    entry = {"Source": "aws.s3", "DetailType": "Object Created", "Detail": json.dumps(detail)}
    # PutEvents refuses aws.* sources from callers, so redeliver it as S3 itself would.
    [published] = events.publish_as_service([entry], ACCOUNT_ID, REGION)
    assert "EventId" in published
    assert cloud.wait_idle(30)
    assert [e["executionArn"] for e in _executions(cloud) if e["name"].startswith("twice-")] == [first["executionArn"]]
    cloud.client("stepfunctions").stop_execution(executionArn=first["executionArn"])


def test_local_cloud_job_state_change_event_resolves_waiting_task(
    cloud: LocalCloud, sagemaker: RecordingSageMaker
) -> None:
    sfn = cloud.client("stepfunctions")
    execution_arn = sfn.start_execution(
        stateMachineArn=cloud.state_machine_arn,
        name="events-run",
        # No Find duplicates: this recording SageMaker runs no job, and the index is what is under test.
        input=json.dumps({**_document(cloud, "events"), "deduplication": {"enabled": False}}),
    )["executionArn"]
    [job] = _wait_for(lambda: sagemaker.processing_jobs("events-run"), what="the download job")
    # What LocalSageMaker reports when the job ends: moto's job is updated, the event published,
    # the template's rule invokes the real job_events, which resolves the task token.
    cloud.status_publisher.job_status_changed("processing", job, "Completed", {})
    assert cloud.client("sagemaker").describe_processing_job(ProcessingJobName=job)["ProcessingJobStatus"] == (
        "Completed"
    )
    _wait_for(lambda: "MapStateSucceeded" in _history_types(cloud, execution_arn), what="the Map to finish")
    ended = _wait_for(
        lambda: (d := sfn.describe_execution(executionArn=execution_arn))["status"] != "RUNNING" and d,
        what="the run to end",
    )
    # The fake job wrote no shard, so the real build_index refuses the dataset; the execution's
    # FAILED status event reaches the notify function.
    assert ended["status"] == "FAILED"
    assert ended["error"] == "NoUsableShards"
    _wait_for(lambda: [m for m in cloud.sns_messages() if "events-run" in m["subject"]], what="the failure notice")


def test_local_cloud_prewarm_makes_the_next_invocation_warm(cloud: LocalCloud) -> None:
    runtime = cloud.runtime
    assert runtime is not None
    assert runtime.lambda_runner is not None
    cloud.prewarm().join(timeout=120)
    cold_starts = runtime.lambda_runner.stats["cold_starts"]

    event = (ROOT / "events" / "scheduled_reconciler.json").read_bytes()
    answer = cloud.client("lambda").invoke(FunctionName=cloud.function_name("ReconcilerFunction"), Payload=event)

    assert "FunctionError" not in answer, answer["Payload"].read()
    assert runtime.lambda_runner.stats["cold_starts"] == cold_starts


def test_local_cloud_every_function_called_in_turn_after_prewarm_starts_none_cold(cloud: LocalCloud) -> None:
    """A run calls the template's functions one after another: each keeps a warm worker, so none
    of them starts cold again (with fewer warm workers than functions, the least recently used one
    recycled was always the next one called)."""
    runtime = cloud.runtime
    assert runtime is not None
    assert runtime.lambda_runner is not None
    cloud.prewarm().join(timeout=120)
    cold_starts = runtime.lambda_runner.stats["cold_starts"]
    lambda_client = cloud.client("lambda")
    names = sorted(f["FunctionName"] for f in lambda_client.list_functions()["Functions"])
    assert len(names) <= DEFAULT_MAX_WORKERS_TOTAL, "every function of the template keeps a warm worker"

    for name in names:  # an empty event: most handlers refuse it, in a warm worker all the same
        lambda_client.invoke(FunctionName=name, Payload=b"{}")

    assert runtime.lambda_runner.stats["cold_starts"] == cold_starts


def test_local_cloud_client_without_options_is_one_per_service(cloud: LocalCloud) -> None:
    s3 = cloud.client("s3")
    assert cloud.client("s3") is s3
    assert cloud.client("sns") is not s3
    # Options make a client of its own: a caller's settings and event handlers stay its own.
    assert cloud.client("s3", config=Config(retries={"max_attempts": 1})) is not s3
    assert s3.list_objects_v2(Bucket=cloud.bucket, Prefix="models/tiny/")["KeyCount"] == 1
