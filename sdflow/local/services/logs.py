"""CloudWatch Logs and metrics for the local functions: their output as Lambda ships it.

On AWS every line a function writes goes to the log group `/aws/lambda/<function name>`, one log
stream per execution environment named `YYYY/MM/DD/[$LATEST]<id>`, between the runtime's own
START / END / REPORT lines (AWS Lambda operator guide, "How CloudWatch structures logs"); Lambda
creates the group on first use when the template does not. A line that is an embedded metric
format document (Powertools Metrics prints one per invocation) also becomes CloudWatch metric
data (CloudWatch user guide, "Specification: Embedded metric format").

The local workers' output reaches `CloudWatchSink.writer()` line by line
(sdflow/local/lambda_runner.py); lines are buffered and written straight into moto's logs and
cloudwatch backends (no HTTP) by one flusher thread, about once a second, so a 10,000-shard run
(~30,000 invocations) costs one backend call per stream and second, not one per line.
A function with LoggingConfig.LogGroup (template.yaml gives each its own group, with retention)
writes there instead, in streams named YYYY/MM/DD/<function name>[$LATEST]<id> (AWS Lambda
developer guide, "Configuring CloudWatch log groups").
FilterLogEvents' filterPattern follows CloudWatch's filter pattern syntax (services/filter_pattern.py).
Not emulated: expiry by retention (the group's retentionInDays is kept and reported), metric
filters, EMF's own limits beyond what is checked below."""

from __future__ import annotations

import json
import logging
import math
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sdflow.local.patching import Patch, replace, wrap
from sdflow.local.runtime import current_clock
from sdflow.local.services.filter_pattern import FilterPatternError, compile_pattern

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 1.0
# CloudWatch Logs limits (PutLogEvents): a batch holds at most 10,000 events; an event's message
# is at most 256 KiB - 26 bytes of overhead, longer ones are truncated by the agent. Keep both.
MAX_EVENTS_PER_BATCH = 10_000
MAX_EVENT_BYTES = 256 * 1024 - 26
# EMF: at most 100 metrics per directive, 30 dimensions per dimension set, 100 values per metric.
EMF_MAX_METRICS = 100
EMF_MAX_DIMENSIONS = 30
EMF_MAX_VALUES = 100


class EmfError(ValueError):
    """A line that looks like EMF but breaks the spec: AWS extracts no metric from it (the line
    stays a plain log event), so neither does the local cloud; the reason goes to the log."""


def log_group_for(function_name: str) -> str:
    return f"/aws/lambda/{function_name}"


@dataclass
class _Buffer:
    events: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    metrics: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    count: int = 0


class CloudWatchSink:
    """Function output -> moto's CloudWatch Logs (every line) and CloudWatch (EMF lines).

    Implements sdflow.local.lambda_runner.OutputSink. Thread-safe: one writer per worker, one
    flusher thread; close() flushes what is left."""

    def __init__(self, account_id: str, region: str, flush_interval_s: float = FLUSH_INTERVAL_S) -> None:
        self.account_id = account_id
        self.region = region
        self.flush_interval_s = flush_interval_s
        self._buffer = _Buffer()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._flush_lock = threading.Lock()
        self._flusher = threading.Thread(target=self._run, name="sdflow-cloudwatch-flush", daemon=True)
        self._flusher.start()
        self.stats = {"log_events": 0, "metric_values": 0, "emf_rejected": 0}

    # ------------------------------------------------------------------ writers

    def writer(self, function_name: str, log_stream: str, log_group: str | None = None) -> Callable[[bytes], None]:
        """Lines of one execution environment; `log_group` is the function's LoggingConfig.LogGroup
        (the template's group, with its retention) or None for Lambda's default group."""
        key = (log_group or log_group_for(function_name), log_stream)

        def write(raw: bytes) -> None:
            message = raw.decode("utf-8", errors="replace").rstrip("\n")
            datums = self._emf(function_name, message) if message.startswith("{") and '"_aws"' in message else None
            self.append(key[0], key[1], message, int(current_clock().time() * 1000), datums or ())

        return write

    def append(
        self,
        log_group: str,
        log_stream: str,
        message: str,
        timestamp_ms: int,
        metrics: Iterable[tuple[str, dict[str, Any]]] = (),
    ) -> None:
        """One log event, and the (namespace, MetricDatum) pairs taken from it, buffered for the
        flusher. Other emitters with their own group and stream naming (the local SageMaker's jobs,
        sdflow/local/sagemaker/job_logs.py) write here too, so every line still costs no backend call."""
        if len(message.encode()) > MAX_EVENT_BYTES:
            message = message.encode()[:MAX_EVENT_BYTES].decode("utf-8", errors="ignore")
        with self._lock:
            self._buffer.events[(log_group, log_stream)].append({"timestamp": timestamp_ms, "message": message})
            self._buffer.count += 1
            for namespace, metric in metrics:
                self._buffer.metrics[namespace].append(metric)
            full = self._buffer.count >= MAX_EVENTS_PER_BATCH
        if full:
            self._wake.set()

    def _emf(self, function_name: str, message: str) -> list[tuple[str, dict[str, Any]]] | None:
        try:
            document = json.loads(message)
            return emf_metric_data(document)
        except ValueError as exc:  # EmfError included
            self.stats["emf_rejected"] += 1
            log.warning("%s: EMF line not extracted (%s): %.200s", function_name, exc, message)
            return None

    # ------------------------------------------------------------------ flushing

    def _run(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            try:
                self.flush()
            except Exception:  # keep flushing later batches; this one is reported
                log.exception("writing function logs to the local CloudWatch failed")

    def flush(self) -> None:
        """Write everything buffered so far into moto's backends (also called by tests)."""
        from moto.cloudwatch.models import cloudwatch_backends
        from moto.logs.models import logs_backends

        with self._flush_lock:
            with self._lock:
                buffer, self._buffer = self._buffer, _Buffer()
            if not buffer.count and not buffer.metrics:
                return
            logs = logs_backends[self.account_id][self.region]
            for (group, stream), events in buffer.events.items():
                # As Lambda does for a group the template does not create (it creates a custom
                # LoggingConfig group too, given logs:CreateLogGroup, which SAM's role has).
                logs.ensure_log_group(group)
                logs.ensure_log_stream(group, stream)
                events.sort(key=lambda event: event["timestamp"])  # PutLogEvents wants them in order
                for start in range(0, len(events), MAX_EVENTS_PER_BATCH):
                    logs.put_log_events(group, stream, events[start : start + MAX_EVENTS_PER_BATCH])
                self.stats["log_events"] += len(events)
            cloudwatch = cloudwatch_backends[self.account_id][self.region]
            for namespace, metrics in buffer.metrics.items():
                cloudwatch.put_metric_data(namespace, metrics)
                self.stats["metric_values"] += sum(len(m.get("Values", [1])) for m in metrics)

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._flusher.join(10)
        self.flush()


# ---------------------------------------------------------------------- EMF


def emf_metric_data(document: Any) -> list[tuple[str, dict[str, Any]]] | None:
    """(namespace, PutMetricData MetricDatum) pairs from an EMF document; None if it is not EMF.

    Per the spec: `_aws.CloudWatchMetrics` is a list of directives, each with a Namespace,
    Dimensions (a list of dimension sets, each a list of root member names) and Metrics (each a
    Name, optional Unit, whose value is the root member of that name: a number or a list of
    numbers). `_aws.Timestamp` is epoch milliseconds. Every name a directive references must be
    a member of the root. One datum is produced per metric and dimension set."""
    if not isinstance(document, dict) or not isinstance(document.get("_aws"), dict):
        return None
    metadata = document["_aws"]
    directives = metadata.get("CloudWatchMetrics")
    if not isinstance(directives, list):
        raise EmfError("_aws.CloudWatchMetrics must be a list of metric directives")
    timestamp = _timestamp(metadata.get("Timestamp"))
    data: list[tuple[str, dict[str, Any]]] = []
    for index, directive in enumerate(directives):
        data += _directive_data(document, directive, f"_aws.CloudWatchMetrics[{index}]", timestamp)
    return data


def _timestamp(value: Any) -> datetime:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise EmfError("_aws.Timestamp must be a number of milliseconds since the epoch")
    return datetime.fromtimestamp(value / 1000, tz=UTC).replace(tzinfo=None)  # moto compares naive UTC


def _directive_data(
    document: dict[str, Any], directive: Any, where: str, timestamp: datetime
) -> list[tuple[str, dict[str, Any]]]:
    if not isinstance(directive, dict):
        raise EmfError(f"{where} must be an object")
    namespace = directive.get("Namespace")
    if not isinstance(namespace, str) or not namespace:
        raise EmfError(f"{where}.Namespace must be a non-empty string")
    dimension_sets = directive.get("Dimensions", [[]]) or [[]]
    metrics = directive.get("Metrics")
    if not isinstance(metrics, list) or len(metrics) > EMF_MAX_METRICS:
        raise EmfError(f"{where}.Metrics must be a list of at most {EMF_MAX_METRICS} metric definitions")
    dimensions = [_dimensions(document, dims, f"{where}.Dimensions[{i}]") for i, dims in enumerate(dimension_sets)]
    data = []
    for index, metric in enumerate(metrics):
        name, unit, values = _metric(document, metric, f"{where}.Metrics[{index}]")
        for dims in dimensions:
            datum: dict[str, Any] = {"MetricName": name, "Dimensions": dims, "Timestamp": timestamp, "Values": values}
            if unit:
                datum["Unit"] = unit
            data.append((namespace, datum))
    return data


def _dimensions(document: dict[str, Any], names: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(names, list) or len(names) > EMF_MAX_DIMENSIONS:
        raise EmfError(f"{where} must be a list of at most {EMF_MAX_DIMENSIONS} member names")
    dims = []
    for name in names:
        value = document.get(name) if isinstance(name, str) else None
        if not isinstance(value, str):
            raise EmfError(f"{where}: dimension {name!r} must be a string member of the root")
        dims.append({"Name": name, "Value": value})
    return dims


def _metric(document: dict[str, Any], metric: Any, where: str) -> tuple[str, str | None, list[float]]:
    name = metric.get("Name") if isinstance(metric, dict) else None
    if not isinstance(name, str) or not name:
        raise EmfError(f"{where}.Name must be a non-empty string")
    raw = document.get(name)
    values = raw if isinstance(raw, list) else [raw]
    if not values or len(values) > EMF_MAX_VALUES:
        raise EmfError(f"{where}: member {name!r} must hold 1 to {EMF_MAX_VALUES} values")
    numbers = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise EmfError(f"{where}: member {name!r} must be a number or a list of numbers, not {value!r}")
        numbers.append(float(value))
    unit = metric.get("Unit")
    return name, unit if isinstance(unit, str) and unit else None, numbers


# ---------------------------------------------------------------------- the clock


def logs_utcnow() -> datetime:
    """Replaces `utcnow` in moto/logs/models.py (naive UTC, as moto.core.utils.utcnow returns):
    PutLogEvents keeps only events from the last 14 days to 2 hours ahead of it, and an advanced
    local clock stamps lines days ahead of the wall clock; the window must move with the clock."""
    return current_clock().now().astimezone(UTC).replace(tzinfo=None)


class PatternFilter:
    """Replaces EventMessageFilter in moto/logs/models.py, which matches a bare term or phrase only
    and lets every event through for any other pattern (JSON, -exclusion, ?OR): the filter
    patterns the CloudWatch Logs user guide documents (services/filter_pattern.py)."""

    def __init__(self, pattern: str) -> None:
        self._matches = compile_pattern(pattern)

    def matches(self, message: str) -> bool:
        return self._matches(message)


def logs_filter_log_events(inner: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    """Wraps moto/logs/models.py LogsBackend.filter_log_events: a pattern that does not parse is
    refused with InvalidParameterException (AWS refuses it whatever the group holds; moto would
    parse it per event, or never for an empty group)."""
    from moto.logs.exceptions import InvalidParameterException

    pattern = kwargs.get("filter_pattern", args[6] if len(args) > 6 else None)
    try:
        compile_pattern(pattern)
    except FilterPatternError as invalid:
        raise InvalidParameterException(str(invalid)) from None
    return inner(self, *args, **kwargs)


def patches() -> list[Patch]:
    import moto.logs.models as logs_models

    return [
        replace(logs_models, "utcnow", logs_utcnow),
        replace(logs_models, "EventMessageFilter", PatternFilter),
        wrap(logs_models.LogsBackend, "filter_log_events", logs_filter_log_events),
    ]
