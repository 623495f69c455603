"""The local SageMaker's jobs in CloudWatch: their hosts' output as log events, their training
metrics as metric data, where SageMaker puts them.

- Everything a job's container writes to stdout/stderr goes to CloudWatch Logs (SageMaker developer
  guide, "CloudWatch Logs for Amazon SageMaker AI", logging-cloudwatch.html): a training job to the
  group `/aws/sagemaker/TrainingJobs`, stream `[training-job-name]/algo-[instance-number-in-cluster]-
  [epoch_timestamp]`; a processing job to `/aws/sagemaker/ProcessingJobs`, stream
  `[processing-job-name]/[hostname]-[epoch_timestamp]` (a processing host is named algo-N too). The
  timestamp is the host's start, in epoch seconds. SageMaker creates the groups on first use.
- Each value a training job's AlgorithmSpecification.MetricDefinitions regex finds in a line is
  published to the namespace `/aws/sagemaker/TrainingJobs`, metric name = the definition's Name,
  dimension `TrainingJobName=<job name>`, at the line's time ("Amazon CloudWatch Metrics for
  Monitoring and Analyzing Training Jobs", training-metrics.html: Metrics → /aws/sagemaker/
  TrainingJobs → TrainingJobName; the SageMaker Python SDK's TrainingJobAnalytics reads them back
  with that one dimension). The `Host=<job>/algo-N` dimension of that namespace belongs to the
  instance metrics (CPUUtilization, …), which the local SageMaker does not emit.

Lines and metric data go through one CloudWatchSink (sdflow/local/services/logs.py): buffered, one
flusher thread, written into moto's backends in-process, so a chatty trainer costs no backend call
per line. Blank lines are dropped: PutLogEvents takes no empty message.

Not emulated: the execution role's logs:PutLogEvents / cloudwatch:PutMetricData permissions are not
checked (template.yaml grants them; the Lambda sink does not check its functions' roles either), and
neither is CloudWatch's own lag: LocalSageMaker flushes when a job's containers end, so a job's lines
are readable by the time its status changes."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from sdflow.local.runtime import current_clock
from sdflow.local.services.logs import CloudWatchSink

TRAINING_LOG_GROUP = "/aws/sagemaker/TrainingJobs"
PROCESSING_LOG_GROUP = "/aws/sagemaker/ProcessingJobs"
TRAINING_METRICS_NAMESPACE = "/aws/sagemaker/TrainingJobs"
LOG_GROUPS = {"training": TRAINING_LOG_GROUP, "processing": PROCESSING_LOG_GROUP}

# Training metrics in one line: the line, when it was read (aware UTC) -> {metric name: value}.
MetricParser = Callable[[str, datetime], Mapping[str, float]]


def metric_definitions(request: Mapping[str, Any]) -> list[tuple[str, re.Pattern[str]]]:
    """AlgorithmSpecification.MetricDefinitions as (metric name, compiled regex); ValueError names
    the definition that has no Name or no valid Regex."""
    definitions = []
    specs = (request.get("AlgorithmSpecification") or {}).get("MetricDefinitions") or []
    for i, spec in enumerate(specs):
        try:
            definitions.append((spec["Name"], re.compile(spec["Regex"])))
        except (KeyError, re.error) as exc:
            raise ValueError(
                f"AlgorithmSpecification.MetricDefinitions[{i}] needs a Name and a valid Regex: {exc}"
            ) from None
    return definitions


def metric_values(definitions: list[tuple[str, re.Pattern[str]]], line: str) -> dict[str, float]:
    """The values one log line holds, as SageMaker reads them: each regex's first group."""
    found: dict[str, float] = {}
    for metric, regex in definitions:
        match = regex.search(line)
        if match:
            with contextlib.suppress(ValueError, IndexError):
                found[metric] = float(match.group(1))
    return found


def log_stream_name(job_name: str, host: str, started_s: float) -> str:
    return f"{job_name}/{host}-{int(started_s)}"


def training_metric_datum(job_name: str, metric: str, value: float, at: datetime) -> dict[str, Any]:
    """A PutMetricData MetricDatum, as moto's backend takes it (naive UTC timestamps)."""
    return {
        "MetricName": metric,
        "Dimensions": [{"Name": "TrainingJobName", "Value": job_name}],
        "Timestamp": at.astimezone(UTC).replace(tzinfo=None),
        "Values": [value],
    }


class JobLogs:
    """Job output -> the local CloudWatch. Owns its sink unless one is given (the local cloud's,
    shared with the functions' output); thread-safe, as CloudWatchSink is."""

    def __init__(self, account_id: str, region: str, sink: CloudWatchSink | None = None) -> None:
        self._owned = sink is None
        self.sink = sink if sink is not None else CloudWatchSink(account_id, region)
        self.streams: dict[tuple[str, str], str] = {}  # (job name, host) -> its latest stream

    def host_lines(
        self, kind: str, job_name: str, host: str, metrics: MetricParser | None = None
    ) -> Callable[[str], None]:
        """The line callback of one host's ContainerProcess: each line becomes a log event in the
        host's stream, and the values `metrics` finds in it metric data with the line's timestamp."""
        group = LOG_GROUPS[kind]
        stream = self.streams[(job_name, host)] = log_stream_name(job_name, host, current_clock().time())

        def on_line(line: str) -> None:
            at = current_clock().now()
            found = metrics(line, at) if metrics is not None else {}
            if not line.strip():
                return
            data = [
                (TRAINING_METRICS_NAMESPACE, training_metric_datum(job_name, name, value, at))
                for name, value in found.items()
            ]
            self.sink.append(group, stream, line, int(at.timestamp() * 1000), data)

        return on_line

    def flush(self) -> None:
        self.sink.flush()

    def close(self) -> None:
        if self._owned:
            self.sink.close()
        else:
            self.sink.flush()
