"""Fault injection (sdflow/local/faults.py) and what each fault does: real processes killed, real
handler crashes, real events delivered twice or not at all."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sdflow.local import runtime as runtime_module
from sdflow.local.faults import FaultError, Faults
from sdflow.local.sagemaker import endpoints as sagemaker_endpoints
from sdflow.local.sagemaker import engine as local_sagemaker
from sdflow.local.sagemaker.engine import LocalSageMaker
from sdflow.local.sagemaker.noop import NoOpSageMaker
from sdflow.local.sagemaker.service import SageMakerStatusPublisher
from tests.unit.local.helpers import (
    PROCESSING_REQUEST,
    ROLE,
    TRAINING_REQUEST,
    client,
    events_queue,
    fake_training_image,
    received,
    wait_for,
    zip_files,
)
from tests.unit.local.recorders import Recorder

# A container that runs until killed and ignores SIGTERM (so a stop needs the SIGKILL after the grace).
STUBBORN = """#!/usr/bin/env python3
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("started", flush=True)
time.sleep(600)
"""

CRASHY = """
import boto3, os
from botocore.stub import Stubber

def lambda_handler(event, context):
    s3 = boto3.client("s3", region_name="us-east-1")
    with Stubber(s3) as stub:
        stub.add_response("list_buckets", {"Buckets": []})
        s3.list_buckets()
    with open(event["marker"], "a") as out:
        out.write("after the call\\n")
    return {"ok": True}
"""


def _faults(runtime: runtime_module.Runtime, publisher: Any = None) -> Faults:
    cloud = SimpleNamespace(runtime=runtime, deployment=None, status_publisher=publisher or SageMakerStatusPublisher())
    return Faults(cloud)  # type: ignore[arg-type]


@pytest.fixture
def local_sagemaker_stubborn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(local_sagemaker, "free_port", lambda: 65000)  # no socket in unit tests
    image = fake_training_image(tmp_path, {"download": STUBBORN, "train": STUBBORN})
    recorder = Recorder()
    sm = LocalSageMaker(tmp_path / "sm", "http://127.0.0.1:9", recorder, training_image_dir=image, stop_grace_s=0.5)
    yield sm, recorder
    sm.shutdown()


def test_kill_processing_job_fails_it_like_a_killed_container(local_sagemaker_stubborn: Any) -> None:
    sm, recorder = local_sagemaker_stubborn
    sm.run_processing_job({**PROCESSING_REQUEST, "ProcessingJobName": "p-kill"})
    runtime = runtime_module.Runtime(workdir=Path("."), sagemaker=sm)
    pid = _faults(runtime).kill_job("processing", "p-kill", timeout_s=20)
    assert pid > 0
    status, fields = wait_for(lambda: recorder.final("p-kill"), what="the killed job to end")
    assert status == "Failed"
    assert fields["FailureReason"].startswith("AlgorithmError: exit code 137 (killed by SIGKILL) on p-kill/algo-1")


def test_stop_training_job_sigterm_then_kill_after_grace_ends_stopped(local_sagemaker_stubborn: Any) -> None:
    sm, recorder = local_sagemaker_stubborn
    request = {**TRAINING_REQUEST, "TrainingJobName": "t-stop", "ResourceConfig": {"InstanceCount": 1}}
    sm.run_training_job(request)
    wait_for(lambda: sm.training_progress("t-stop")["secondary_status"] == "Training", what="the container")
    started = time.monotonic()
    sm.stop_job("training", "t-stop")
    status, fields = wait_for(lambda: recorder.final("t-stop"), what="the stopped job to end")
    assert (status, fields["SecondaryStatus"]) == ("Stopped", "Stopped")
    assert time.monotonic() - started < 10, "a container that ignores SIGTERM is killed after the grace"
    assert "ModelArtifacts" not in fields


def test_noop_stop_and_kill_end_held_jobs_at_once_without_output(tmp_path: Path) -> None:
    recorder = Recorder()
    noop = NoOpSageMaker("http://127.0.0.1:9", recorder, job_seconds=60)
    writes: list[str] = []
    noop._put = lambda bucket, key, body: writes.append(key)  # type: ignore[method-assign]
    try:
        request = {**PROCESSING_REQUEST, "ProcessingOutputConfig": {"Outputs": [{"S3Output": {"S3Uri": "s3://b/o/"}}]}}
        noop.run_processing_job({**request, "ProcessingJobName": "p-stop"})
        noop.run_training_job({**TRAINING_REQUEST, "TrainingJobName": "t-kill"})
        time.sleep(0.2)
        noop.stop_job("processing", "p-stop")
        noop.kill_job("training", "t-kill", timeout_s=5)
        assert wait_for(lambda: recorder.final("p-stop"), what="the stop")[0] == "Stopped"
        status, fields = wait_for(lambda: recorder.final("t-kill"), what="the kill")
        assert (status, fields["SecondaryStatus"]) == ("Failed", "Failed")
        assert "killed" in fields["FailureReason"]
        assert writes == [], "a stopped job writes no _SUCCESS"
    finally:
        noop.pool.shutdown(wait=False, cancel_futures=True)


def test_redeliver_sagemaker_event_sends_same_event_again(runtime: runtime_module.Runtime) -> None:
    queue_url = events_queue("SageMaker Processing Job State Change")
    publisher = SageMakerStatusPublisher()
    client("sagemaker").create_processing_job(**PROCESSING_REQUEST)
    name = str(PROCESSING_REQUEST["ProcessingJobName"])
    publisher.job_status_changed("processing", name, "Completed", {})
    _faults(runtime, publisher).redeliver_sagemaker_event(name, "Completed")
    first, second = received(queue_url)
    assert first == second, "a duplicate delivery is the same event, id included"
    assert first["detail"]["ProcessingJobStatus"] == "Completed"


def test_disabled_rule_delivers_no_sagemaker_event_until_enabled(runtime: runtime_module.Runtime) -> None:
    detail_type = "SageMaker Training Job State Change"
    queue_url = events_queue(detail_type)
    events = client("events")
    events.disable_rule(Name=detail_type.replace(" ", "-"))
    client("sagemaker").create_training_job(**TRAINING_REQUEST)
    publisher = SageMakerStatusPublisher()
    publisher.job_status_changed("training", "sdf-tr-run-a0", "Failed", {"FailureReason": "lost"})
    assert received(queue_url) == []
    events.enable_rule(Name=detail_type.replace(" ", "-"))
    _faults(runtime, publisher).redeliver_sagemaker_event("sdf-tr-run-a0")
    [event] = received(queue_url)
    assert event["detail"]["FailureReason"] == "lost"


def test_kill_lambda_worker_mid_invocation_answers_runtime_exit_error(
    runtime: runtime_module.Runtime, function_arn: str
) -> None:
    answers: list[dict[str, Any]] = []

    def invoke() -> None:
        response = client("lambda").invoke(FunctionName="probe", Payload=json.dumps({"sleep": 2.5}).encode())
        answers.append({"error": response.get("FunctionError"), "body": json.loads(response["Payload"].read())})

    thread = threading.Thread(target=invoke)
    thread.start()
    pid = _faults(runtime).kill_lambda_worker("probe", timeout_s=20)
    thread.join(30)
    assert pid > 0
    [answer] = answers
    assert (answer["error"], answer["body"]["errorType"]) == ("Unhandled", "Runtime.ExitError")
    # The next invocation gets a fresh worker and succeeds.
    assert "FunctionError" not in client("lambda").invoke(FunctionName="probe", Payload=b"{}")


def test_kill_lambda_worker_with_none_busy_kills_the_next_invocation(
    runtime: runtime_module.Runtime, function_arn: str
) -> None:
    killed: list[int] = []
    thread = threading.Thread(target=lambda: killed.append(_faults(runtime).kill_lambda_worker("probe", timeout_s=20)))
    thread.start()
    time.sleep(0.3)  # armed before the invocation comes, as when the run's events are still ahead
    response = client("lambda").invoke(FunctionName="probe", Payload=b"{}")
    thread.join(30)
    assert response.get("FunctionError") == "Unhandled"
    assert json.loads(response["Payload"].read())["errorType"] == "Runtime.ExitError"
    assert killed
    assert killed[0] > 0
    assert "FunctionError" not in client("lambda").invoke(FunctionName="probe", Payload=b"{}")


def test_kill_lambda_worker_no_invocation_comes_raises_and_disarms(
    runtime: runtime_module.Runtime, function_arn: str
) -> None:
    with pytest.raises(FaultError, match=r"no invocation of probe came within 0\.2 s"):
        _faults(runtime).kill_lambda_worker("probe", timeout_s=0.2)
    assert "FunctionError" not in client("lambda").invoke(FunctionName="probe", Payload=b"{}")


def test_crash_lambda_after_call_exits_once_after_the_side_effect(
    runtime: runtime_module.Runtime, tmp_path: Path
) -> None:
    code = tmp_path / "crashy"
    code.mkdir()
    (code / "app.py").write_text(CRASHY)
    client("lambda").create_function(
        FunctionName="crashy",
        Runtime="python3.11",
        Role=ROLE,
        Handler="app.lambda_handler",
        Code={"ZipFile": zip_files({"app.py": CRASHY})},
        Timeout=30,
    )
    runtime.register_code("crashy", code)
    faults = _faults(runtime)
    with pytest.raises(Exception, match=r"<service>\.<Operation>"):
        faults.crash_lambda_after("crashy", "list_buckets")
    claims = faults.crash_lambda_after("crashy", "s3.ListBuckets")
    marker = tmp_path / "marker.txt"
    payload = json.dumps({"marker": str(marker)}).encode()

    crashed = client("lambda").invoke(FunctionName="crashy", Payload=payload)
    assert json.loads(crashed["Payload"].read())["errorType"] == "Runtime.ExitError"
    assert not marker.exists(), "the handler died right after the call, before its next line"
    assert Faults.crashes_done(claims) == 1
    retried = client("lambda").invoke(FunctionName="crashy", Payload=payload)
    assert "FunctionError" not in retried
    assert marker.read_text() == "after the call\n"


def test_delete_endpoint_while_creating_returns_at_once_and_stops_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    image = tmp_path / "image"
    (image / "bin").mkdir(parents=True)
    (image / "bin" / "serve").write_text(STUBBORN)  # never answers /ping
    recorder = Recorder()
    sm = LocalSageMaker(tmp_path / "sm", "http://127.0.0.1:9", recorder, training_image_dir=image, stop_grace_s=0.5)

    class NoServer:
        def open(self, *args: Any, **kwargs: Any) -> Any:
            raise urllib.error.URLError("connection refused")

    class Model:
        def download_prefix(self, uri: str, dest: Path, field: str) -> list[str]:
            (dest / "weights.bin").write_bytes(b"w")
            return ["weights.bin"]

    sm._http = NoServer()  # type: ignore[assignment]
    sm._s3 = Model()  # type: ignore[assignment]
    monkeypatch.setattr(sagemaker_endpoints, "free_port", lambda: 65000)
    model = {"ModelName": "m", "PrimaryContainer": {"ModelDataUrl": "s3://b/model/"}}
    try:
        sm.deploy_endpoint("e", {"EndpointConfigName": "c"}, model)
        log = tmp_path / "sm" / "endpoints" / "e" / "c" / "serve.log"
        wait_for(lambda: log.exists() and "started" in log.read_text(), what="serve to start")
        started = time.monotonic()
        sm.delete_endpoint("e")
        assert time.monotonic() - started < 1.0, "DeleteEndpoint does not wait for the deployment"
        wait_for(lambda: not any(t.is_alive() for t in threading.enumerate() if t.name == "sdflow-endpoint-e"))
        assert sm.endpoint_url("e") is None
        assert not any(r[2] == "InService" for r in recorder.reports)
    finally:
        sm.shutdown()
