"""The whole pipeline through the local runtime: the real template, state machine, handlers,
rules and container code, on generated data and a tiny model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from sdflow import samples
from sdflow.demo import DEMO_ENDPOINT, DemoOptions, manifest, prepare_inputs, run_pipeline
from sdflow.local.cloud import LocalCloud
from tests.constants import TIME_SCALE
from tests.e2e.commands import SDFLOW
from tests.helpers import free_port, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
# No-op sizes where the model's quality is not under test: a random VAE, 4 steps.
SMALL = {
    "shards": 2,
    "images_per_shard": 12,
    "instance_count": 1,
    "max_train_steps": 4,
    "vae_steps": 0,
    "min_prompt_adherence": None,
    "eval_inference_steps": 2,
    "eval_in_training": False,
    "clip_steps": None,  # no CLIP model, no held-out split
}


def _endpoint_names(cloud: Any) -> list[str]:
    return [e["EndpointName"] for e in cloud.client("sagemaker").list_endpoints()["Endpoints"]]


@pytest.fixture
def image_server() -> Iterator[samples.ImageServer]:
    with samples.ImageServer() as server:
        yield server


def test_pipeline_broken_shard_within_tolerance_succeeds_and_names_it(
    tmp_path: Path, image_server: samples.ImageServer
) -> None:
    options = DemoOptions(**{**SMALL, "shards": 3}, broken_shard=True, tolerated_failure_percent=34.0)
    with LocalCloud(tmp_path, port=0, time_scale=TIME_SCALE) as cloud:
        prepare_inputs(cloud.client("s3"), cloud.bucket, tmp_path, image_server, options)
        result = run_pipeline(cloud, tmp_path, options)

        assert result["progress"].status == "SUCCEEDED"
        [message] = cloud.sns_messages()
        assert message["attributes"]["outcome"] == "succeeded"
        text = message["message"]
        assert "2 of 3 shards downloaded" in text
        assert "failed shard 00002" in text
        assert "part-00002.parquet" in text
        assert DEMO_ENDPOINT in _endpoint_names(cloud)
        # The model was uploaded uncompressed, and the evaluation and the endpoint read it from its prefix.
        described = cloud.client("stepfunctions").describe_execution(executionArn=result["execution_arn"])
        prefix = json.loads(described["output"])["training"]["model_data_url"]
        assert prefix.endswith("/output/model/")
        assert f"loss curve {prefix}loss.png" in text
        job = prefix.removeprefix(f"s3://{cloud.bucket}/").removesuffix("model/")
        listed = cloud.client("s3").list_objects_v2(Bucket=cloud.bucket, Prefix=job)["Contents"]
        keys = {item["Key"].removeprefix(job) for item in listed}
        assert {"model/model_index.json", "model/sdflow_model.json"} <= keys
        assert "model.tar.gz" not in keys


def test_pipeline_training_failure_notifies_and_deploys_no_endpoint(
    tmp_path: Path, image_server: samples.ImageServer
) -> None:
    options = DemoOptions(**{**SMALL, "shards": 1}, failing_training=True)
    with LocalCloud(tmp_path, port=0, time_scale=TIME_SCALE) as cloud:
        prepare_inputs(cloud.client("s3"), cloud.bucket, tmp_path, image_server, options)
        result = run_pipeline(cloud, tmp_path, options)

        assert result["progress"].status == "FAILED"
        assert result["progress"].error == "TrainingJobFailed"
        [message] = cloud.sns_messages()
        assert message["subject"].endswith("FAILED")
        assert message["attributes"]["error"] == "TrainingJobFailed"
        assert "in state: Train model" in message["message"]
        assert "gemini" in message["message"].lower()
        assert _endpoint_names(cloud) == []
        jobs = cloud.client("sagemaker").list_training_jobs()["TrainingJobSummaries"]
        assert [job["TrainingJobStatus"] for job in jobs] == ["Failed"]


class _CloudFromOutside:
    """Clients of a `sdflow local up` running in another process, from its state file."""

    def __init__(self, state: dict[str, Any]) -> None:
        import boto3

        self.outputs = state["outputs"]
        self.endpoint_url = state["endpoint_url"]
        self._session = boto3.session.Session(
            aws_access_key_id="testing", aws_secret_access_key="testing", region_name=state["region"]
        )

    def client(self, name: str) -> Any:
        return self._session.client(name, endpoint_url=self.endpoint_url)


def _get_json(url: str, quiet: bool = False) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return json.loads(response.read())
    except OSError:
        if quiet:
            return None
        raise


def test_local_up_is_driven_by_clients_from_another_process(tmp_path: Path, image_server: samples.ImageServer) -> None:
    workdir = tmp_path / "work"
    port, console_port = free_port(), free_port()
    server = subprocess.Popen(
        [*SDFLOW, "--workdir", str(workdir), "local", "up", "--port", str(port), "--console-port", str(console_port),
         "--time-scale", str(TIME_SCALE)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (workdir / "cloud.json").exists():
            assert server.poll() is None, server.stdout.read() if server.stdout else ""
            assert time.monotonic() < deadline, "sdflow local up did not come up in 120 s"
            time.sleep(0.5)
        state = json.loads((workdir / "cloud.json").read_text())
        assert state["endpoint_url"] == f"http://127.0.0.1:{port}"
        cloud = _CloudFromOutside(state)
        options = DemoOptions(**SMALL)
        prepare_inputs(cloud.client("s3"), cloud.outputs["DataBucketName"], tmp_path, image_server, options)
        run_file = tmp_path / "run.json"
        run_file.write_text(json.dumps(manifest(state["outputs"]["DataBucketName"], options)))
        env = {**os.environ, **state["env"]}

        started = subprocess.run(
            [*SDFLOW, "--workdir", str(workdir), "run", str(run_file)],
            capture_output=True, text=True, env=env, timeout=120, check=False,
        )  # fmt: skip
        assert started.returncode == 0, started.stderr
        execution_arn = started.stdout.strip().splitlines()[-1]
        watched = subprocess.run(
            [*SDFLOW, "--workdir", str(workdir), "watch", execution_arn],
            capture_output=True, text=True, env=env, timeout=600, check=False,
        )  # fmt: skip
        assert watched.returncode == 0, watched.stdout[-3000:] + watched.stderr[-3000:]
        assert "Train model" in watched.stdout
        assert "SUCCEEDED" in watched.stdout

        history = cloud.client("stepfunctions").get_execution_history(executionArn=execution_arn)["events"]
        assert history[-1]["type"] == "ExecutionSucceeded"
        image = tmp_path / "cli.png"
        invoked = subprocess.run(
            [*SDFLOW, "--workdir", str(workdir), "invoke", DEMO_ENDPOINT, "a red circle", "-o", str(image),
             "--steps", "2", "--seed", "1"],
            capture_output=True, text=True, env=env, timeout=300, check=False,
        )  # fmt: skip
        assert invoked.returncode == 0, invoked.stderr
        with Image.open(image) as png:
            assert png.format == "PNG"

        # The console `local up` started, and `sdflow console` on its own, read the same run.
        name = execution_arn.rsplit(":", 1)[-1]
        beside = _get_json(f"http://127.0.0.1:{console_port}/api/overview")
        assert [(r["name"], r["status"], r["started_by"]) for r in beside["runs"]] == [(name, "SUCCEEDED", "upload")]
        alone_port = free_port()
        alone = subprocess.Popen(
            [*SDFLOW, "--workdir", str(workdir), "console", "--port", str(alone_port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        try:
            run = wait_for(
                lambda: _get_json(f"http://127.0.0.1:{alone_port}/api/runs/{name}", quiet=True),
                timeout_s=60, interval_s=0.3, what="sdflow console",
            )  # fmt: skip
            assert run["run"]["status"] == "SUCCEEDED"
            assert {run["states"][s]["status"] for s in ("Train model", "Deploy endpoint")} == {"succeeded"}
            assert run["map_runs"]["Download shards"]["counts"]["succeeded"] == SMALL["shards"]
        finally:
            alone.send_signal(signal.SIGINT)
            alone.wait(timeout=30)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
    assert not (workdir / "cloud.json").exists()
