"""CloudWatch Logs and metrics: function output in /aws/lambda/<fn>, EMF lines as metric data."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from sdflow.local.lambda_runner import FunctionSpec, LambdaRunner, log_stream_name
from sdflow.local.lambda_worker import report_line
from sdflow.local.services import logs
from tests.constants import ACCOUNT, REGION
from tests.unit.local.helpers import HANDLERS, client, wait_for

EMF_HANDLER = """
from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.metrics import MetricUnit

logger = Logger()
metrics = Metrics()

@metrics.log_metrics
def lambda_handler(event, context):
    logger.info("shard done", extra={"shard": event["shard"]})
    metrics.add_dimension(name="kind", value="download")
    metrics.add_metric(name="ShardsDone", unit=MetricUnit.Count, value=event["count"])
    return {}
"""
STREAM = re.compile(r"^\d{4}/\d{2}/\d{2}/\[\$LATEST\][0-9a-f]{32}$")
REPORT = re.compile(
    r"^REPORT RequestId: (?P<id>[0-9a-f-]{36})\tDuration: \d+\.\d\d ms\tBilled Duration: \d+ ms\t"
    r"Memory Size: 256 MB\tMax Memory Used: \d+ MB\t(Init Duration: \d+\.\d\d ms\t)?$"
)


@pytest.fixture
def sink(aws: None) -> Iterator[logs.CloudWatchSink]:
    sink = logs.CloudWatchSink(ACCOUNT, REGION, flush_interval_s=0.1)
    yield sink
    sink.close()


def _runner(tmp_path: Path, sink: logs.CloudWatchSink, handler: str, env: dict[str, str] | None = None) -> Any:
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    (code / "app.py").write_text(handler)
    runner = LambdaRunner("http://127.0.0.1:9", REGION, tmp_path / "logs", output_sink=sink)
    spec = FunctionSpec(
        "fn", f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:fn", "app.lambda_handler", code,
        timeout_s=30, memory_mb=256, environment=env or {},
    )  # fmt: skip
    return runner, spec


def _events(group: str, pattern: str = "") -> list[dict[str, Any]]:
    logs_client = client("logs")
    try:
        return list(logs_client.filter_log_events(logGroupName=group, filterPattern=pattern)["events"])
    except logs_client.exceptions.ResourceNotFoundException:  # not flushed yet
        return []


def test_function_output_in_log_group_with_start_end_report_per_invocation(
    tmp_path: Path, sink: logs.CloudWatchSink
) -> None:
    runner, spec = _runner(tmp_path, sink, HANDLERS + "\nprint('hello from the handler')\n")
    try:
        first = runner.invoke(spec, "{}", request_id="11111111-1111-4111-8111-111111111111")
        runner.invoke(spec, "{}", request_id="22222222-2222-4222-8222-222222222222")
    finally:
        runner.shutdown()
    assert first.function_error is None
    reports = wait_for(lambda: len(found := _events("/aws/lambda/fn", "REPORT")) == 2 and found, what="REPORT")
    messages = [e["message"] for e in _events("/aws/lambda/fn")]
    assert "START RequestId: 11111111-1111-4111-8111-111111111111 Version: $LATEST" in messages
    assert "END RequestId: 22222222-2222-4222-8222-222222222222" in messages
    assert "hello from the handler" in messages  # module-level output of the init phase
    parsed = [REPORT.match(e["message"]) for e in reports]
    assert all(parsed), [e["message"] for e in reports]
    assert [m.group("id") for m in parsed if m] == [
        "11111111-1111-4111-8111-111111111111",
        "22222222-2222-4222-8222-222222222222",
    ]
    assert "Init Duration" in reports[0]["message"]
    assert "Init Duration" not in reports[1]["message"]
    (stream,) = client("logs").describe_log_streams(logGroupName="/aws/lambda/fn")["logStreams"]
    assert STREAM.match(stream["logStreamName"])
    assert "START RequestId" in (tmp_path / "logs" / "fn.log").read_text()  # the file copy stays


def test_function_log_stream_name_is_the_one_the_handler_sees(tmp_path: Path, sink: logs.CloudWatchSink) -> None:
    handler = "import os\ndef lambda_handler(event, context):\n    return context.log_stream_name\n"
    runner, spec = _runner(tmp_path, sink, handler)
    try:
        seen = json.loads(runner.invoke(spec, "{}").payload)
    finally:
        runner.shutdown()
    wait_for(lambda: _events("/aws/lambda/fn", "REPORT"), what="the REPORT line")
    (stream,) = client("logs").describe_log_streams(logGroupName="/aws/lambda/fn")["logStreams"]
    assert stream["logStreamName"] == seen


def test_powertools_metrics_become_cloudwatch_metric_data(tmp_path: Path, sink: logs.CloudWatchSink) -> None:
    env = {"POWERTOOLS_METRICS_NAMESPACE": "sdflow-test", "POWERTOOLS_SERVICE_NAME": "probe"}
    runner, spec = _runner(tmp_path, sink, EMF_HANDLER, env)
    try:
        for count in (2, 3):
            assert runner.invoke(spec, json.dumps({"shard": count, "count": count})).function_error is None
    finally:
        runner.shutdown()
    cloudwatch = client("cloudwatch")
    listed = wait_for(
        lambda: cloudwatch.list_metrics(Namespace="sdflow-test")["Metrics"], what="the EMF metric to be listed"
    )
    assert listed[0]["MetricName"] == "ShardsDone"
    assert {d["Name"]: d["Value"] for d in listed[0]["Dimensions"]} == {"kind": "download", "service": "probe"}
    now = datetime.now(UTC)
    query = {
        "Id": "shards",
        "MetricStat": {
            "Metric": {"Namespace": "sdflow-test", "MetricName": "ShardsDone", "Dimensions": listed[0]["Dimensions"]},
            "Period": 60,
            "Stat": "Sum",
        },
    }
    result = wait_for(
        lambda: (
            sum(
                cloudwatch.get_metric_data(
                    MetricDataQueries=[query], StartTime=now - timedelta(minutes=5), EndTime=now + timedelta(minutes=5)
                )["MetricDataResults"][0]["Values"]
            )
            == 5
        ),
        what="Sum of ShardsDone to reach 5",
    )
    assert result
    assert any('"shard done"' in e["message"] for e in _events("/aws/lambda/fn"))  # the Logger line too


def test_emf_metric_data_multiple_dimension_sets_one_datum_each() -> None:
    document = {
        "_aws": {
            "Timestamp": 1_700_000_000_000,
            "CloudWatchMetrics": [
                {"Namespace": "ns", "Dimensions": [["a"], ["a", "b"]], "Metrics": [{"Name": "m", "Unit": "Count"}]}
            ],
        },
        "a": "1",
        "b": "2",
        "m": [1, 2.5],
    }
    data = logs.emf_metric_data(document)
    assert data is not None
    assert [(ns, d["MetricName"], d["Dimensions"], d["Values"], d["Unit"]) for ns, d in data] == [
        ("ns", "m", [{"Name": "a", "Value": "1"}], [1.0, 2.5], "Count"),
        ("ns", "m", [{"Name": "a", "Value": "1"}, {"Name": "b", "Value": "2"}], [1.0, 2.5], "Count"),
    ]
    assert data[0][1]["Timestamp"] == datetime(2023, 11, 14, 22, 13, 20)


def test_emf_metric_data_plain_json_log_line_is_not_emf() -> None:
    assert logs.emf_metric_data({"level": "INFO", "message": "_aws is a word"}) is None


@pytest.mark.parametrize(
    ("document", "field"),
    [
        ({"_aws": {"Timestamp": 1, "CloudWatchMetrics": {}}}, "_aws.CloudWatchMetrics"),
        ({"_aws": {"CloudWatchMetrics": []}}, "_aws.Timestamp"),
        ({"_aws": {"Timestamp": 1, "CloudWatchMetrics": [{"Metrics": []}]}}, r"\[0\]\.Namespace"),
        (
            {"_aws": {"Timestamp": 1, "CloudWatchMetrics": [{"Namespace": "n", "Metrics": [{"Name": "m"}]}]}},
            "member 'm' must be a number",
        ),
        (
            {
                "_aws": {
                    "Timestamp": 1,
                    "CloudWatchMetrics": [{"Namespace": "n", "Dimensions": [["d"]], "Metrics": [{"Name": "m"}]}],
                },
                "m": 1,
            },
            r"Dimensions\[0\]: dimension 'd' must be a string member",
        ),
    ],
)
def test_emf_metric_data_invalid_document_rejected_naming_field(document: dict[str, Any], field: str) -> None:
    with pytest.raises(logs.EmfError, match=field):
        logs.emf_metric_data(document)


def test_sink_invalid_emf_line_stays_a_log_event_without_metric(sink: logs.CloudWatchSink) -> None:
    write = sink.writer("fn", "2024/01/01/[$LATEST]" + "0" * 32)
    write(b'{"_aws": {"Timestamp": 1, "CloudWatchMetrics": "nope"}}\n')
    sink.flush()
    assert sink.stats["emf_rejected"] == 1
    assert client("cloudwatch").list_metrics()["Metrics"] == []
    assert [e["message"] for e in _events("/aws/lambda/fn")] == [
        '{"_aws": {"Timestamp": 1, "CloudWatchMetrics": "nope"}}'
    ]


def test_sink_existing_template_log_group_kept(sink: logs.CloudWatchSink) -> None:
    client("logs").create_log_group(logGroupName="/aws/lambda/fn")
    client("logs").put_retention_policy(logGroupName="/aws/lambda/fn", retentionInDays=7)
    sink.writer("fn", "s")(b"line\n")
    sink.flush()
    (group,) = client("logs").describe_log_groups(logGroupNamePrefix="/aws/lambda/fn")["logGroups"]
    assert group["retentionInDays"] == 7


def test_report_line_billed_duration_rounded_up_to_the_millisecond() -> None:
    line = report_line("r", 12.01, 128)
    assert line.startswith("REPORT RequestId: r\tDuration: 12.01 ms\tBilled Duration: 13 ms\tMemory Size: 128 MB\t")
    assert re.search(r"\tMax Memory Used: \d+ MB\t$", line)
    assert report_line("r", 0.2, 128, init_ms=250.5).endswith("Init Duration: 250.50 ms\t")
    assert "Billed Duration: 1 ms" in report_line("r", 0.2, 128)


def test_log_stream_name_lambda_format() -> None:
    assert STREAM.match(log_stream_name())
    assert log_stream_name(0).startswith("1970/01/01/[$LATEST]")


def test_function_with_logging_config_logs_to_its_group_in_streams_named_after_it(
    tmp_path: Path, sink: logs.CloudWatchSink
) -> None:
    group = "/aws/lambda/stack-Fn"
    client("logs").create_log_group(logGroupName=group)
    client("logs").put_retention_policy(logGroupName=group, retentionInDays=14)
    runner, spec = _runner(tmp_path, sink, HANDLERS + "\nprint('to the custom group')\n")
    spec = FunctionSpec(**{**spec.__dict__, "log_group": group})
    assert runner.environment_for(spec)["AWS_LAMBDA_LOG_GROUP_NAME"] == group
    try:
        runner.invoke(spec, "{}")
    finally:
        runner.shutdown()
    wait_for(lambda: _events(group, "REPORT"), what="the REPORT line in the custom group")
    assert any("to the custom group" in e["message"] for e in _events(group))
    (stream,) = client("logs").describe_log_streams(logGroupName=group)["logStreams"]
    assert re.match(r"^\d{4}/\d{2}/\d{2}/fn\[\$LATEST\][0-9a-f]{32}$", stream["logStreamName"])
    (described,) = client("logs").describe_log_groups(logGroupNamePrefix=group)["logGroups"]
    assert described["retentionInDays"] == 14
    assert not client("logs").describe_log_groups(logGroupNamePrefix="/aws/lambda/fn")["logGroups"]


def test_moto_gap_put_log_events_window_reads_utcnow() -> None:
    import inspect

    from moto.logs.models import LogsBackend

    source = inspect.getsource(LogsBackend.put_log_events)
    assert "utcnow() + timedelta(hours=2)" in source
    assert "utcnow() - timedelta(days=14)" in source


def test_patch_put_log_events_accepts_lines_of_an_advanced_clock(runtime: Any) -> None:
    from moto.logs.models import logs_backends

    runtime.clock.advance(3 * 86_400)  # the run's lines are stamped three days ahead of the wall clock
    backend = logs_backends["123456789012"]["us-east-1"]
    backend.create_log_group("/aws/lambda/clocked", {})
    backend.create_log_stream("/aws/lambda/clocked", "s")
    _token, rejected = backend.put_log_events(
        "/aws/lambda/clocked", "s", [{"timestamp": int(runtime.clock.time() * 1000), "message": "ahead"}]
    )
    assert rejected == {}
    assert [e.message for e in backend.groups["/aws/lambda/clocked"].streams["s"].events] == ["ahead"]
