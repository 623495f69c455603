"""Lambda: real handlers, timeouts, asynchronous invocations and the DLQ."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sdflow.local import runtime as runtime_module
from sdflow.local.lambda_runner import FunctionSpec, LambdaRunner
from tests.constants import ACCOUNT, REGION
from tests.unit.local.helpers import HANDLERS, ROLE, client, lambda_model, records, wait_for, zip_files


def test_moto_gap_simple_lambda_backend_echoes_instead_of_running_the_handler(aws: None) -> None:
    client("lambda").create_function(
        FunctionName="echo",
        Runtime="python3.11",
        Role=ROLE,
        Handler="app.lambda_handler",
        Code={"ZipFile": zip_files({"app.py": "def lambda_handler(e, c):\n    raise RuntimeError('never runs')\n"})},
    )
    response = client("lambda").invoke(FunctionName="echo", Payload=b'{"a": 1}')
    assert "FunctionError" not in response
    assert response["Payload"].read() == b'{"a": 1}'


def test_patch_lambda_invoke_runs_handler_with_function_env_only(
    function_arn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SDFLOW_TEST_PARENT_ONLY", "must not leak")
    first = json.loads(client("lambda").invoke(FunctionName=function_arn, Payload=b"{}")["Payload"].read())
    second = json.loads(client("lambda").invoke(FunctionName="probe", Payload=b"{}")["Payload"].read())
    assert first["greeting"] == "hello"
    assert first["endpoint"] == "http://127.0.0.1:9"
    assert first["function"] == "probe"
    assert first["leaked"] is None
    assert 0 < first["remaining_ms"] <= 3000
    assert second["pid"] == first["pid"], "a warm worker is reused"


def test_patch_lambda_invoke_unhandled_exception_becomes_lambda_error_payload(function_arn: str) -> None:
    response = client("lambda").invoke(FunctionName=function_arn, Payload=b'{"fail": true}')
    body = json.loads(response["Payload"].read())
    assert response["FunctionError"] == "Unhandled"
    assert body["errorType"] == "InvalidRunDocument"
    assert body["errorMessage"] == "dataset: is required"
    assert any("app.py" in frame for frame in body["stackTrace"])


def test_patch_lambda_invoke_past_timeout_kills_worker_as_sandbox_timedout(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(HANDLERS)
    runner = LambdaRunner("http://127.0.0.1:9", REGION, tmp_path / "logs")
    spec = FunctionSpec("slow", "arn:aws:lambda:us-east-1:1:function:slow", "app.lambda_handler", tmp_path, timeout_s=1)
    try:
        started = time.monotonic()
        result = runner.invoke(spec, json.dumps({"sleep": 30}))
        elapsed = time.monotonic() - started
        after = runner.invoke(spec, "{}")
    finally:
        runner.shutdown()
    assert result.function_error == "Unhandled"
    assert result.error_type == "Sandbox.Timedout"
    assert "Task timed out after 1.00 seconds" in json.loads(result.payload)["errorMessage"]
    assert elapsed < 10
    assert after.function_error is None, "the next invocation starts a fresh worker"


def test_patch_lambda_invoke_event_type_runs_in_background(function_arn: str, tmp_path: Path) -> None:
    response = client("lambda").invoke(
        FunctionName=function_arn, InvocationType="Event", Payload=json.dumps({"record": True, "sleep": 0.5})
    )
    assert response["StatusCode"] == 202
    assert not records(tmp_path / "events.jsonl"), "the call returned before the handler finished"
    wait_for(lambda: records(tmp_path / "events.jsonl"), what="the asynchronous invocation")


def test_patch_lambda_async_failure_goes_to_dead_letter_queue(
    runtime: runtime_module.Runtime, function_arn: str, tmp_path: Path
) -> None:
    queue_url = client("sqs").create_queue(QueueName="dlq")["QueueUrl"]
    fn = lambda_model("probe")
    fn.dead_letter_config = {"TargetArn": f"arn:aws:sqs:{REGION}:{ACCOUNT}:dlq"}
    client("lambda").invoke(FunctionName=function_arn, InvocationType="Event", Payload=b'{"fail": true}')
    assert runtime.wait_idle(20)
    messages = client("sqs").receive_message(QueueUrl=queue_url, MessageAttributeNames=["All"])["Messages"]
    assert json.loads(messages[0]["Body"]) == {"fail": True}
    assert messages[0]["MessageAttributes"]["ErrorMessage"]["StringValue"] == "dataset: is required"


@pytest.mark.parametrize(("retries", "runs"), [(None, 3), (1, 2), (0, 1)])
def test_patch_lambda_async_failure_is_retried_as_its_event_invoke_config_says(
    runtime: runtime_module.Runtime, function_arn: str, tmp_path: Path, retries: int | None, runs: int
) -> None:
    """Lambda retries a failing asynchronous event twice unless EventInvokeConfig says fewer."""
    runtime.async_retry_delays_s = (0.0, 0.0)
    if retries is not None:
        client("lambda").put_function_event_invoke_config(FunctionName=function_arn, MaximumRetryAttempts=retries)
    client("lambda").invoke(FunctionName=function_arn, InvocationType="Event", Payload=b'{"fail": true, "record": 1}')
    assert runtime.wait_idle(20)
    assert len(records(tmp_path / "events.jsonl")) == runs


# ------------------------------------------------------------------------------------ (b) EventBridge


def test_runner_serves_concurrent_invocations_with_bounded_pool(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(HANDLERS)
    runner = LambdaRunner("http://127.0.0.1:9", REGION, tmp_path / "logs", max_workers_per_function=2)
    spec = FunctionSpec("f", "arn:aws:lambda:us-east-1:1:function:f", "app.lambda_handler", tmp_path, timeout_s=10)
    results: list[dict[str, Any]] = []

    def call() -> None:
        results.append(json.loads(runner.invoke(spec, json.dumps({"sleep": 0.3})).payload))

    threads = [threading.Thread(target=call) for _ in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        runner.shutdown()
    assert len(results) == 4
    assert len({r["pid"] for r in results}) <= 2


def test_runner_over_total_worker_cap_stops_least_recently_used_idle_worker(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(HANDLERS)
    runner = LambdaRunner("http://127.0.0.1:9", REGION, tmp_path / "logs", max_workers_total=2)
    specs = [
        FunctionSpec(name, f"arn:aws:lambda:us-east-1:1:function:{name}", "app.lambda_handler", tmp_path, timeout_s=10)
        for name in ("first", "second", "third")
    ]
    try:
        pids = [json.loads(runner.invoke(spec, "{}").payload)["pid"] for spec in specs]
        warm = runner.worker_pids()
        # "first" was idle longest: its worker made room for "third"; the other two stay warm.
        assert sorted(warm) == sorted(pids[1:])
        assert json.loads(runner.invoke(specs[1], "{}").payload)["pid"] == pids[1]
    finally:
        runner.shutdown()


def test_runner_worker_idle_past_its_lifetime_is_stopped_at_next_invocation(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(HANDLERS)
    runner = LambdaRunner("http://127.0.0.1:9", REGION, tmp_path / "logs", idle_lifetime_s=1.0)
    early, late = (
        FunctionSpec(name, f"arn:aws:lambda:us-east-1:1:function:{name}", "app.lambda_handler", tmp_path, timeout_s=10)
        for name in ("early", "late")
    )
    try:
        early_pid = json.loads(runner.invoke(early, "{}").payload)["pid"]
        late_pid = json.loads(runner.invoke(late, "{}").payload)["pid"]
        assert sorted(runner.worker_pids()) == sorted([early_pid, late_pid]), "idle a moment: both stay warm"

        time.sleep(1.5)
        assert json.loads(runner.invoke(late, "{}").payload)["pid"] != late_pid, "idle past its lifetime: cold"
        assert early_pid not in runner.worker_pids(), "stopped without being invoked again"
        assert len(runner.worker_pids()) == 1
    finally:
        runner.shutdown()


def test_runner_burst_workers_idle_past_the_surplus_lifetime_are_stopped_first_stays_warm(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(HANDLERS)
    runner = LambdaRunner(
        "http://127.0.0.1:9", REGION, tmp_path / "logs", max_workers_per_function=3, surplus_idle_lifetime_s=0.5
    )
    burst, other = (
        FunctionSpec(name, f"arn:aws:lambda:us-east-1:1:function:{name}", "app.lambda_handler", tmp_path, timeout_s=10)
        for name in ("burst", "other")
    )
    pids: list[int] = []

    def call() -> None:
        pids.append(json.loads(runner.invoke(burst, json.dumps({"sleep": 0.5})).payload)["pid"])

    try:
        threads = [threading.Thread(target=call) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(set(pids)) == 3, "a burst of three: three workers"
        time.sleep(1.2)
        runner.invoke(other, "{}")  # any invocation recycles what has expired
        left = [pid for pid in set(pids) if pid in runner.worker_pids()]
        assert len(left) == 1, "the burst's surplus workers stopped, one worker of the function kept warm"
        assert json.loads(runner.invoke(burst, "{}").payload)["pid"] == left[0]
    finally:
        runner.shutdown()


def test_patch_lambda_handler_tells_time_on_advanced_clock(function_arn: str, runtime: runtime_module.Runtime) -> None:
    """A handler compares claim deadlines with its own time.time(): on the cloud's clock, it must be."""
    runtime.clock.advance(86_400)
    answer = json.loads(client("lambda").invoke(FunctionName=function_arn, Payload=b"{}")["Payload"].read())
    assert 86_300 < answer["now"] - time.time() < 86_500
    assert 0 < answer["remaining_ms"] <= 3000, "the deadline moves with the clock"


def test_patch_lambda_async_invocation_while_cloud_stops_ends_without_traceback(
    runtime: runtime_module.Runtime, function_arn: str, caplog: pytest.LogCaptureFixture
) -> None:
    # LocalCloud.stop() marks the runtime, then shuts the runner down under invocations in flight.
    runtime.stopping = True
    assert runtime.lambda_runner is not None
    runtime.lambda_runner.shutdown()

    with caplog.at_level(logging.INFO, logger="sdflow.local.services.awslambda"):
        client("lambda").invoke(FunctionName=function_arn, InvocationType="Event", Payload=b"{}")
        assert runtime.wait_idle(20)

    records = [r for r in caplog.records if r.name == "sdflow.local.services.awslambda"]
    assert [r.getMessage() for r in records] == [
        "asynchronous invocation of probe dropped: the local cloud is stopping"
    ]
    assert all(r.exc_info is None and r.levelno == logging.INFO for r in records)
