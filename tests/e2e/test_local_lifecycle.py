"""`sdflow local up` stopped by SIGTERM or SIGINT: every process it started ends, its state file goes.

Python's default SIGTERM ends a process without running `finally` blocks, so before the CLI
turned signals into an orderly stop, a Lambda worker and a SageMaker job's processes (each in
their own session, on purpose) outlived `sdflow local up`, reparented to init, and cloud.json
stayed behind pointing at a dead endpoint."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import psutil
import pytest

from sdflow import samples
from sdflow.local.services import sns
from tests.constants import hold_for
from tests.e2e.clouds import CloudSpec, noop_cloud
from tests.e2e.commands import SDFLOW
from tests.e2e.jobs import BUCKET, download_request
from tests.e2e.runs import RecoveryTable, run_hash_of, start_run, wait_for_started_job
from tests.helpers import free_port, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RECOVERY = RecoveryTable()


@pytest.fixture(scope="module", autouse=True)
def _recovery_table() -> Iterator[None]:
    yield
    RECOVERY.print()


@pytest.fixture
def image_server() -> Iterator[samples.ImageServer]:
    # Slow URLs keep the download job busy for the whole test.
    with samples.ImageServer(slow_seconds=samples.MAX_SLOW_SECONDS) as server:
        yield server


def _client(state: dict[str, Any], service: str) -> Any:
    session = boto3.session.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name=state["region"]
    )
    return session.client(service, endpoint_url=state["endpoint_url"])


def _descendants(pid: int) -> list[psutil.Process]:
    # By parent pid: a job's helpers may call setsid and leave the process group.
    return psutil.Process(pid).children(recursive=True)


def _cmdlines(processes: list[psutil.Process]) -> list[str]:
    lines = []
    for process in processes:
        try:
            lines.append(" ".join(process.cmdline()))
        except psutil.Error:  # ended meanwhile
            continue
    return lines


def _gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _start_worker_and_job(state: dict[str, Any], tmp_path: Path, image_server: samples.ImageServer) -> None:
    lam = _client(state, "lambda")
    functions = {f["FunctionName"]: f for f in lam.list_functions()["Functions"]}
    validate = next(name for name in functions if "ValidateRun" in name)
    lam.invoke(FunctionName=validate, Payload=b"{}")  # any answer will do: a warm worker now exists
    # The job runs as the template's SageMaker role, on the stack's bucket, as start_download starts it.
    start_download = next(f for name, f in functions.items() if "StartDownload" in name)
    role_arn = start_download["Environment"]["Variables"]["SAGEMAKER_ROLE_ARN"]
    bucket = state["outputs"]["DataBucketName"]
    sample = samples.make_laion_parquet(tmp_path / "slow.parquet", image_server, good=1, slow=8, seed=5)
    _client(state, "s3").upload_file(str(sample.path), bucket, "datasets/lifecycle/slow.parquet")
    request = download_request(
        "lifecycle-download", "datasets/lifecycle/slow.parquet", "runs/lifecycle/", max_runtime=600
    )
    request = json.loads(json.dumps(request).replace(f"s3://{BUCKET}/", f"s3://{bucket}/")) | {"RoleArn": role_arn}
    _client(state, "sagemaker").create_processing_job(**request)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_local_up_signal_stops_every_process_and_removes_state_file(
    signum: int, tmp_path: Path, image_server: samples.ImageServer
) -> None:
    workdir = tmp_path / "work"
    state_file = workdir / "cloud.json"
    server = subprocess.Popen(
        [*SDFLOW, "--workdir", str(workdir), "local", "up", "--port", str(free_port()), "--console-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(
            lambda: state_file.exists() or server.poll() is not None,
            timeout_s=180, interval_s=0.5, what="sdflow local up",
        )  # fmt: skip
        assert server.poll() is None, server.stdout.read() if server.stdout else ""
        state = json.loads(state_file.read_text())
        _start_worker_and_job(state, tmp_path, image_server)
        wait_for(
            lambda: (lines := _cmdlines(_descendants(server.pid)))
            and any("lambda_worker.py" in line for line in lines)
            and sum("bin/download" in line for line in lines) >= 2,
            timeout_s=120, interval_s=0.2, what="a Lambda worker, the download job and its own children",
        )  # fmt: skip
        started = _descendants(server.pid)
        server.send_signal(signum)
        output, _ = server.communicate(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()
    assert server.returncode == 0, output
    assert f"stopping ({signal.Signals(signum).name})" in output
    assert "Traceback" not in output, output  # a stop is the command's normal end
    assert not state_file.exists()
    deadline = time.monotonic() + 10
    while [p for p in started if not _gone(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [p for p in started if not _gone(p)]
    assert not survivors, _cmdlines(survivors)


def test_local_cloud_stopped_mid_run_ends_it_aborted_with_a_cause_that_says_so(tmp_path: Path) -> None:
    """Stopping `sdflow local up` (LocalCloud.stop, what its SIGTERM and SIGINT run) while a run
    trains: the run ends ABORTED, its notification saying the local cloud stopped, not a
    States.Timeout with "(no cause given)" (every wait ends when the cloud's clock closes)."""
    spec = CloudSpec(dataset="stopped", shards=1, seconds_by_kind={"training": hold_for(600)})
    with noop_cloud(tmp_path / "work", spec) as noop:
        cloud = noop.cloud
        document = noop.document(
            training={"instance_type": "ml.m5.xlarge"},
            endpoint={"name": "sdflow-stopped", "instance_type": "ml.m5.large"},
        )
        arn = start_run(cloud, "stopped-mid-run", document)
        wait_for_started_job(cloud, "training", run_hash_of(cloud, arn), timeout_s=120)  # its check is done
        workdir, topic = cloud.workdir, cloud.topic_name
        stopping = time.monotonic()
    stopped_s = time.monotonic() - stopping
    messages = [m for m in sns.read_sns_messages(workdir, topic) if m["attributes"].get("run_id") == "stopped-mid-run"]
    assert len(messages) == 1, messages
    message = messages[0]
    assert message["attributes"]["outcome"] == "aborted", message
    assert message["attributes"]["error"] == "sdflow.LocalCloudStopped"
    assert "local cloud stopped" in message["message"], message["message"]
    assert "(no cause given)" not in message["message"]
    assert "in state: Train model" in message["message"]
    assert "Stopped: 1 training job" in message["message"], message["message"]
    assert stopped_s < 60, f"the stop took {stopped_s:.0f} s"
    leftovers = [f"{noop.sagemaker.running} no-op job(s) held"] if noop.sagemaker.running else []
    assert leftovers == []
    RECOVERY.record(
        "`sdflow local up` stopped mid-run (training)",
        "run ABORTED (sdflow.LocalCloudStopped), its job stopped, notified",
        stopping,
        leftovers,
    )
