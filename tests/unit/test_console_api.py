"""The console's JSON API (sdflow/console/API.md) through FastAPI's TestClient, in process.

Step Functions, SageMaker and SageMaker Runtime are fakes that record their calls
(tests/unit/console_fakes.py); S3 and CloudWatch Logs are moto's. The console's caches read a
clock the tests move (console_fakes.Clock)."""

from __future__ import annotations

import base64
import io
import json
import math
import tarfile
from datetime import timedelta
from typing import Any
from urllib.parse import quote

import pytest
from botocore.exceptions import EndpointConnectionError
from pydantic import TypeAdapter, ValidationError

from sdflow.console import server
from sdflow_common import names
from tests.unit.console_fakes import (
    ENDPOINT_URL,
    MAP,
    NOTIFY_LOG_GROUP,
    RUN,
    T0,
    Console,
    add_run,
    execution_arn,
    install_clock,
    logs_client,
    map_run_arn,
    pipeline_history,
    put_logs,
)
from tests.unit.helpers import DATA_BUCKET, AwsWorld

TRAINING_LOGS = "/aws/sagemaker/TrainingJobs"
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))


@pytest.fixture
def console(mocked_aws: AwsWorld, monkeypatch: pytest.MonkeyPatch) -> Console:
    harness = Console()
    install_clock(monkeypatch, harness.clock)
    logs_client().create_log_group(logGroupName=NOTIFY_LOG_GROUP)  # the template creates it
    return harness


def assert_error_shape(body: dict[str, Any], text: str) -> dict[str, Any]:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message", "hint"}
    assert isinstance(body["error"]["code"], str)
    assert isinstance(body["error"]["message"], str)
    assert "Traceback" not in text
    return body["error"]  # type: ignore[no-any-return]


# ---------------------------------------------------------------------- overview


def test_overview_runs_newest_first_started_by_upload_when_marker_exists(
    console: Console, mocked_aws: AwsWorld
) -> None:
    for name, hours_ago in (("run-middle", 2), ("run-newest", 1), ("run-oldest", 3)):
        console.sfn.add_execution(name, status="SUCCEEDED", start=T0 - timedelta(hours=hours_ago))
    manifest = f"s3://{DATA_BUCKET}/uploads/pokemon.json"
    mocked_aws.put_json("runs/run-middle/started_by.json", {"manifest": manifest, "source": "upload"})

    body = console.client().get("/api/overview").json()

    assert [run["name"] for run in body["runs"]] == ["run-newest", "run-middle", "run-oldest"]
    by_name = {run["name"]: run for run in body["runs"]}
    assert {name: run["started_by"] for name, run in by_name.items()} == {
        "run-newest": "api", "run-middle": "upload", "run-oldest": "api",
    }  # fmt: skip
    assert (by_name["run-middle"]["manifest"], by_name["run-newest"]["manifest"]) == (manifest, None)
    assert by_name["run-newest"]["url"] == "#/runs/run-newest"
    assert (body["bucket"], body["endpoint_url"]) == (DATA_BUCKET, ENDPOINT_URL)


def test_overview_stopped_cloud_returns_503_with_local_up_hint(console: Console) -> None:
    console.sfn.fail_with["ListExecutions"] = EndpointConnectionError(endpoint_url=ENDPOINT_URL)

    response = console.client().get("/api/overview")

    assert response.status_code == 503
    error = assert_error_shape(response.json(), response.text)
    assert ENDPOINT_URL in error["message"]
    assert "sdflow local up" in error["hint"]


# ---------------------------------------------------------------------- one run


def test_run_running_states_graph_and_map_run_counts_reported(console: Console) -> None:
    add_run(console)

    body = console.client().get(f"/api/runs/{RUN}").json()

    assert {name: state["status"] for name, state in body["states"].items()} == {
        "Start run": "succeeded", "Validate run": "succeeded", MAP: "succeeded",
        "Build dataset index": "caught", "Check trained model": "running",
    }  # fmt: skip
    assert body["states"]["Build dataset index"]["error"] == "Index.TooFewShards"
    nodes = {node["name"]: node for node in body["graph"]["states"]}
    assert nodes[MAP]["distributed"]
    assert nodes["Download shard"]["parent"] == MAP
    assert body["graph"]["start_at"] == "Start run"
    described = body["map_runs"][MAP]
    assert described["arn"] == map_run_arn(RUN)
    assert described["counts"] == {"pending": 0, "running": 1, "succeeded": 8, "failed": 1, "timed_out": 0,
                                   "aborted": 0, "total": 10, "results_written": 9, "empty": 0}  # fmt: skip
    assert (described["max_concurrency"], described["tolerated_failure_percentage"]) == (8, 10.0)
    assert console.sfn.called("DescribeMapRun") == [{"mapRunArn": map_run_arn(RUN)}]
    assert (body["run"]["status"], body["finished"]) == ("RUNNING", False)
    assert body["poll_after_s"] > 0
    assert "description" not in body
    assert "history" not in body


def test_run_finished_reports_finished_and_polls_slower_than_running(console: Console) -> None:
    add_run(console, "run-running")
    add_run(console, "run-failed", status="FAILED")
    console.sfn.executions[execution_arn("run-failed")] |= {"error": "States.TaskFailed", "cause": "boom"}
    client = console.client()

    running = client.get("/api/runs/run-running").json()
    failed = client.get("/api/runs/run-failed").json()

    assert (running["finished"], failed["finished"]) == (False, True)
    assert failed["poll_after_s"] > running["poll_after_s"]
    assert (failed["run"]["error"], failed["run"]["cause"]) == ("States.TaskFailed", "boom")
    assert failed["run"]["stop"] is not None
    assert running["run"]["stop"] is None


def test_run_second_poll_of_running_execution_fetches_only_new_events(console: Console) -> None:
    console.sfn.page_size = 2
    h = add_run(console)
    client = console.client()
    client.get(f"/api/runs/{RUN}")
    first_pages = len(console.sfn.called("GetExecutionHistory"))
    assert first_pages == math.ceil(len(h.events) / 2)

    h.exit("Check trained model", "Choice")
    h.enter("Train model")
    h.add("TaskScheduled")
    console.clock.advance(2)
    second = client.get(f"/api/runs/{RUN}").json()

    later = console.sfn.called("GetExecutionHistory")[first_pages:]
    assert all(call["reverseOrder"] is True for call in later)
    assert len(later) == 2  # [23, 22] all new, [21, 20] holds a known id: stop there
    assert "nextToken" not in later[0]
    assert later[1]["nextToken"] == "2"
    assert len(second["states"]) == 6
    assert second["states"]["Check trained model"]["status"] == "succeeded"
    assert second["states"]["Train model"]["status"] == "running"
    assert second["states"]["Validate run"]["status"] == "succeeded"


def test_run_finished_execution_history_not_fetched_again_after_ttl(console: Console) -> None:
    add_run(console, status="SUCCEEDED")
    client = console.client()
    first = client.get(f"/api/runs/{RUN}").json()

    console.clock.advance(3600)
    second = client.get(f"/api/runs/{RUN}").json()

    assert len(console.sfn.called("DescribeExecution")) == 2  # the status is asked again
    assert len(console.sfn.called("GetExecutionHistory")) == 1
    assert len(console.sfn.called("DescribeStateMachineForExecution")) == 1
    assert second["states"] == first["states"]


def test_run_two_polls_within_ttl_cost_one_describe_execution(console: Console) -> None:
    add_run(console)
    client = console.client()
    client.get(f"/api/runs/{RUN}")
    after_first = console.api_calls

    client.get(f"/api/runs/{RUN}")

    assert after_first > 0
    assert console.api_calls == after_first == console.recorded_calls()
    assert len(console.sfn.called("DescribeExecution")) == 1
    console.clock.advance(1.5)
    client.get(f"/api/runs/{RUN}")
    assert len(console.sfn.called("DescribeExecution")) == 2
    assert console.api_calls == console.recorded_calls()
    assert console.built["stepfunctions"] == 1  # one client per service, built once


def test_run_unreadable_definition_returns_422_error(console: Console) -> None:
    add_run(console)
    console.sfn.definitions[execution_arn(RUN)] = "{not json"

    response = console.client().get(f"/api/runs/{RUN}")

    assert response.status_code == 422
    assert assert_error_shape(response.json(), response.text)["code"] == "UnreadableDefinition"


# ---------------------------------------------------------------------- one state


def test_state_reached_input_output_parsed_as_json_with_events(console: Console) -> None:
    h = add_run(console)

    body = console.client().get(f"/api/runs/{RUN}/states/Validate run").json()

    assert (body["name"], body["type"], body["status"]) == ("Validate run", "Task", "succeeded")
    assert body["input"] == {"config": {"run_id": "r1"}}
    assert body["output"] == {"config": {"run_id": "r1"}, "validated": True}
    expected = [(e["id"], e["type"]) for e in h.events if 4 <= e["id"] <= 8]
    assert [(e["id"], e["type"]) for e in body["events"]] == expected
    assert body["entered"] is not None
    assert body["exited"] is not None


def test_state_not_reached_status_not_reached(console: Console) -> None:
    add_run(console)

    response = console.client().get(f"/api/runs/{RUN}/states/Train model")

    assert response.status_code == 200
    body = response.json()
    assert (body["status"], body["type"], body["input"], body["events"]) == ("not_reached", "Task", None, [])


def test_state_unknown_state_returns_404_no_such_state(console: Console) -> None:
    add_run(console)

    response = console.client().get(f"/api/runs/{RUN}/states/Polish the GPU")

    assert response.status_code == 404
    assert assert_error_shape(response.json(), response.text)["code"] == "NoSuchState"


# ---------------------------------------------------------------------- bad input


def test_run_unknown_execution_returns_404_error_shape(console: Console) -> None:
    response = console.client().get("/api/runs/no-such-run")

    assert response.status_code == 404
    error = assert_error_shape(response.json(), response.text)
    assert error["code"] == "ExecutionDoesNotExist"
    assert console.sfn.called("DescribeExecution") == [{"executionArn": execution_arn("no-such-run")}]


@pytest.mark.parametrize("name", ["has space", "x" * 81, "semi;colon"])
def test_run_invalid_execution_name_returns_400_without_calling_aws(console: Console, name: str) -> None:
    response = console.client().get(f"/api/runs/{name}")

    assert response.status_code == 400
    assert assert_error_shape(response.json(), response.text)["code"] == "BadExecutionName"
    assert console.sfn.calls == []


def test_run_execution_name_of_80_chars_is_accepted(console: Console) -> None:
    add_run(console, "x" * 80)

    assert console.client().get(f"/api/runs/{'x' * 80}").status_code == 200


def test_run_stopped_cloud_returns_503_with_local_up_hint(console: Console) -> None:
    console.sfn.fail_with["DescribeExecution"] = EndpointConnectionError(endpoint_url=ENDPOINT_URL)

    response = console.client().get(f"/api/runs/{RUN}")

    assert response.status_code == 503
    error = assert_error_shape(response.json(), response.text)
    assert (error["code"], "sdflow local up" in error["hint"]) == ("Unreachable", True)


def test_run_unexpected_reader_exception_returns_500_one_line(console: Console) -> None:
    console.sfn.fail_with["DescribeExecution"] = RuntimeError("reader fell over")

    response = console.client(raise_server_exceptions=False).get(f"/api/runs/{RUN}")

    assert response.status_code == 500
    error = assert_error_shape(response.json(), response.text)
    assert error["code"] == "RuntimeError"
    assert "reader fell over" in error["message"]
    assert "\n" not in error["message"]


def test_run_unexpected_multiline_exception_returns_500_one_line_message(console: Console) -> None:
    with pytest.raises(ValidationError) as raised:
        TypeAdapter(int).validate_python("not a number")
    assert "\n" in str(raised.value)  # pydantic's message spans lines
    console.sfn.fail_with["DescribeExecution"] = raised.value

    response = console.client(raise_server_exceptions=False).get(f"/api/runs/{RUN}")

    assert response.status_code == 500
    error = assert_error_shape(response.json(), response.text)
    assert "\n" not in error["message"]


def test_artifact_other_bucket_returns_403_without_reading_it(console: Console) -> None:
    response = console.client().get("/api/artifact", params={"uri": "s3://someone-elses-bucket/secret.png"})

    assert response.status_code == 403
    assert assert_error_shape(response.json(), response.text)["code"] == "OtherBucket"
    assert console.boto_calls == []


@pytest.mark.parametrize("group", ["/aws/states/sdflow", "/sdflow/secrets", "aws/sagemaker/TrainingJobs"])
def test_logs_group_outside_pipeline_returns_403(console: Console, group: str) -> None:
    response = console.client().get("/api/logs", params={"group": group, "stream": "s"})

    assert response.status_code == 403
    assert assert_error_shape(response.json(), response.text)["code"] == "OtherLogGroup"
    assert console.boto_calls == []


@pytest.mark.parametrize("body", [{"prompt": ""}, {"prompt": "a pikachu", "num_inference_steps": 0}, {}])
def test_invoke_invalid_body_returns_422_error_shape(console: Console, body: dict[str, Any]) -> None:
    response = console.client().post("/api/endpoints/sdflow/invoke", json=body)

    assert response.status_code == 422
    assert console.runtime.calls == []
    assert_error_shape(response.json(), response.text)


def test_api_unknown_path_returns_404_error_shape(console: Console) -> None:
    response = console.client().get("/api/nothing-here")

    assert response.status_code == 404
    assert_error_shape(response.json(), response.text)


def test_invoke_valid_prompt_returns_endpoint_image_base64(console: Console) -> None:
    request = {"prompt": "a pikachu in a hat", "seed": 7, "num_inference_steps": 20}

    response = console.client().post("/api/endpoints/sdflow-blue/invoke", json=request)

    assert response.status_code == 200
    assert base64.b64decode(response.json()["image"]) == console.runtime.image
    (call,) = console.runtime.called("InvokeEndpoint")
    assert call["EndpointName"] == "sdflow-blue"
    assert json.loads(call["Body"]) == request


# ---------------------------------------------------------------------- artifacts


def test_artifact_member_of_tar_gz_in_stack_bucket_returned_as_png(console: Console, mocked_aws: AwsWorld) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in (("./training_summary.json", b'{"steps": 3}'), ("./samples.png", PNG)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    key = "runs/r1/training/job/output/output.tar.gz"
    mocked_aws.s3.put_object(Bucket=DATA_BUCKET, Key=key, Body=buffer.getvalue())
    client = console.client()

    response = client.get("/api/artifact", params={"uri": f"s3://{DATA_BUCKET}/{key}", "member": "samples.png"})

    assert response.status_code == 200
    assert response.headers["content-type"] == "image/png"
    assert response.content == PNG
    missing = client.get("/api/artifact", params={"uri": f"s3://{DATA_BUCKET}/{key}", "member": "loss.png"})
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "NoSuchMember")


# ---------------------------------------------------------------------- training


def training_run(console: Console) -> str:
    h = pipeline_history()
    h.exit("Check trained model", "Choice")
    h.enter("Train model")
    h.add("TaskScheduled")
    add_run(console, history=h)
    job = names.training_job_name(names.run_hash(execution_arn(RUN), T0), "r1", 0, 1)
    console.sagemaker.training_jobs[job] = {
        "TrainingJobName": job,
        "TrainingJobStatus": "InProgress",
        "SecondaryStatus": "Training",
        "AlgorithmSpecification": {
            "TrainingImage": "sdflow-training:latest",
            "MetricDefinitions": [
                {"Name": "train:lr", "Regex": "lr=([0-9.e-]+)"},
                {"Name": "train:loss", "Regex": "loss=([0-9.]+)"},
            ],
        },
        "ResourceConfig": {"InstanceType": "ml.g5.xlarge", "InstanceCount": 1},
        "TrainingStartTime": T0 + timedelta(minutes=5),
    }
    return job


def test_training_loss_points_read_with_job_metric_regex_and_extended(console: Console) -> None:
    job = training_run(console)
    stream = f"{job}/algo-1-1764072000"
    put_logs(TRAINING_LOGS, stream, ["step=1 loss=0.5 lr=0.001", "step=2 lr=0.001", "epoch 1 done", "step=3 loss=0.25"])
    client = console.client()

    first = client.get(f"/api/runs/{RUN}").json()["training"]

    assert (first["job_name"], first["status"], first["instance_type"]) == (job, "InProgress", "ml.g5.xlarge")
    assert first["loss"] == [[1, 0.5], [3, 0.25]]
    put_logs(TRAINING_LOGS, stream, ["step=4 loss=0.125"])
    console.clock.advance(2)
    second = client.get(f"/api/runs/{RUN}").json()["training"]
    assert second["loss"] == [[1, 0.5], [3, 0.25], [4, 0.125]]


def test_training_uncompressed_output_summary_and_plots_read_from_model_prefix(
    console: Console, mocked_aws: AwsWorld
) -> None:
    job = training_run(console)
    prefix = f"s3://{DATA_BUCKET}/runs/r1/training/{job}/output/model/"
    console.sagemaker.training_jobs[job] |= {
        "TrainingJobStatus": "Completed",
        "OutputDataConfig": {"S3OutputPath": f"s3://{DATA_BUCKET}/runs/r1/training/", "CompressionType": "NONE"},
        "ModelArtifacts": {"S3ModelArtifacts": prefix},
    }
    mocked_aws.put_json(f"runs/r1/training/{job}/output/model/training_summary.json", {"steps": 3})
    mocked_aws.s3.put_object(Bucket=DATA_BUCKET, Key=f"runs/r1/training/{job}/output/model/samples.png", Body=PNG)
    client = console.client()

    training = client.get(f"/api/runs/{RUN}").json()["training"]

    assert training["summary"] == {"steps": 3}
    samples = client.get(training["samples_url"])
    assert (samples.status_code, samples.content) == (200, PNG)
    assert training["loss_png_url"] == f"/api/artifact?uri={quote(prefix + 'loss.png', safe='')}"


def test_training_log_group_missing_gives_empty_curve_not_error(console: Console) -> None:
    job = training_run(console)

    response = console.client().get(f"/api/runs/{RUN}")

    assert response.status_code == 200
    training = response.json()["training"]
    assert (training["job_name"], training["loss"]) == (job, [])


# ---------------------------------------------------------------------- notifications


def _notification(arn: str, subject: str) -> str:
    record = {"level": "INFO", "message": "notification published", "correlation_id": arn,
              "status": "SUCCEEDED", "subject": subject, "notification": f"{subject}: see the console"}  # fmt: skip
    return json.dumps(record)


def test_notifications_of_this_run_returned_other_runs_not(console: Console) -> None:
    add_run(console, status="SUCCEEDED")
    put_logs(NOTIFY_LOG_GROUP, "2026/11/25/[$LATEST]0a1b", [
        _notification(execution_arn(RUN), "sdflow run succeeded"),
        _notification(execution_arn("another-run"), "another run succeeded"),
        "notification published, not JSON",
        "START RequestId: 1234 Version: $LATEST",
    ])  # fmt: skip

    notifications = console.client().get(f"/api/runs/{RUN}").json()["notifications"]

    assert [(n["status"], n["subject"], n["message"]) for n in notifications] == [
        ("SUCCEEDED", "sdflow run succeeded", "sdflow run succeeded: see the console")
    ]
    assert notifications[0]["time"]


def test_notifications_log_group_missing_run_page_still_answers(console: Console) -> None:
    add_run(console, status="SUCCEEDED")

    response = console.client(notify_log_group="/aws/lambda/sdflow-notify-not-yet").get(f"/api/runs/{RUN}")

    assert response.status_code == 200
    assert response.json()["notifications"] == []


# ---------------------------------------------------------------------- server


def test_console_server_binds_loopback_only(console: Console) -> None:
    console_server = server.ConsoleServer(console.config(), port=0)

    assert server.HOST == "127.0.0.1"
    assert console_server._server.config.host == server.HOST


def test_run_execution_arn_of_this_pipeline_is_read_as_its_name(console: Console) -> None:
    add_run(console, RUN)
    arn = execution_arn(RUN)

    response = console.client().get(f"/api/runs/{arn}")

    assert response.status_code == 200
    assert response.json()["run"]["name"] == RUN


def test_run_execution_arn_of_another_state_machine_returns_404(console: Console) -> None:
    other = "arn:aws:states:us-east-1:123456789012:execution:someone-elses-machine:" + RUN

    response = console.client().get(f"/api/runs/{other}")

    assert response.status_code == 404
    assert assert_error_shape(response.json(), response.text)["code"] == "NotThisPipeline"
    assert console.sfn.calls == []
