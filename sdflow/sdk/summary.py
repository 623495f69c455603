"""What a run did, in one frozen record: read from the execution (its output, or for a run that did
not succeed the last state its history shows), the run's S3 objects and, locally, its job logs:
the same sources as `sdflow status` and the notification."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sdflow import history, progress
from sdflow.runs import UNFINISHED
from sdflow_common import curation, evaluation_report

LOSS_METRICS = ("train:loss", "loss")  # the trainer's metric name (model_registry.LOSS_METRIC_NAME), then a bare one


@dataclass(frozen=True)
class RunSummary:
    """One run: its status, shards, training, model and endpoint; None where the run got no further."""

    name: str
    execution_arn: str
    status: str
    started: datetime
    stopped: datetime | None
    duration_s: float
    shards_total: int | None = None
    shards_succeeded: int | None = None
    shards_failed: int | None = None
    shards_reused: int = 0
    # Shards whose job succeeded but fetched no image: not downloaded (the notification and
    # `sdflow status` count them so too).
    shards_empty: int = 0
    samples: int | None = None
    # What was kept and why ($.dataset.curation; sdflow_common.curation): rows read, filtered, failed,
    # held out, duplicates, kept. None for a run from before the counts or one that got no further.
    data: dict[str, Any] | None = None
    training_job_name: str | None = None
    final_loss: float | None = None
    prompt_adherence: float | None = None
    base_prompt_adherence: float | None = None
    model_data_uri: str | None = None
    model_package_arn: str | None = None
    approval_status: str | None = None
    # The evaluation as Register model recorded it ($.registry.model): {metric: {"base", "trained", "samples",
    # ...}}, the gate's checks ({"metric", "rule", "passed", "value", "limit", ...}), the metrics not computed.
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    gate: list[dict[str, Any]] = field(default_factory=list)
    missing: list[dict[str, str]] = field(default_factory=list)
    holdout_samples: int | None = None
    holdout_grid_uri: str | None = None
    endpoint_name: str | None = None
    failed_state: str | None = None
    error: str | None = None
    cause: str | None = None

    @property
    def succeeded(self) -> bool:
        return self.status == "SUCCEEDED"

    def rows(self) -> list[tuple[str, str]]:
        """(label, text) for each thing known, in the order a person reads them."""
        rows = [("run", self.name), ("status", f"{self.status} after {_duration(self.duration_s)}")]
        if self.shards_total is not None:
            downloaded = (self.shards_succeeded or 0) - self.shards_empty
            shards = f"{downloaded} of {self.shards_total} downloaded"
            shards += f" ({self.shards_reused} reused)" if self.shards_reused else ""
            shards += f", {self.shards_empty} held no image" if self.shards_empty else ""
            shards += f", {self.shards_failed} failed" if self.shards_failed else ""
            shards += f"; {self.samples:,} samples" if self.samples is not None else ""
            rows.append(("shards", shards))
        rows.extend(("data" if i == 0 else "", stage) for i, stage in enumerate(curation.data_lines(self.data)))
        if self.training_job_name:
            loss = f", final loss {self.final_loss:.4f}" if self.final_loss is not None else ""
            rows.append(("training", f"{self.training_job_name}{loss}"))
        rows.extend(self._evaluation_rows())
        for label, value in (
            ("model", self.model_data_uri),
            ("model package", self.model_package_arn),
            ("endpoint", self.endpoint_name),
        ):
            if value:
                rows.append((label, value))
        if self.error or self.failed_state:
            parts = [f"in {self.failed_state}" if self.failed_state else "", self.error or "", self.cause or ""]
            rows.append(("error", ": ".join(part for part in parts if part)[:600]))
        return rows

    def _evaluation_rows(self) -> list[tuple[str, str]]:
        """Each metric base → trained (its name and direction the label), the gate's checks, what was not
        computed and the held-out grid; a run with no registered evaluation, the training job's own score."""
        if not self.metrics:
            if self.prompt_adherence is None:
                return []
            base = f"base {self.base_prompt_adherence:.2f} → " if self.base_prompt_adherence is not None else ""
            return [("prompt adherence", f"{base}trained {self.prompt_adherence:.2f}")]
        rows = [
            (evaluation_report.metric_label(name), evaluation_report.metric_values(name, entry))
            for name, entry in self.metrics.items()
        ]
        checks = evaluation_report.gate_checks({"gate": self.gate})
        if checks:
            rows.append(("quality gate", evaluation_report.gate_summary(checks)))
            rows.extend(("", evaluation_report.gate_line(check)) for check in checks)
        rows.extend(
            (evaluation_report.metric_label(item["metric"]), f"not computed: {item['reason'] or 'no reason given'}")
            for item in self.missing
        )
        if self.holdout_grid_uri:
            rows.append(("held-out grid", f"{self.holdout_grid_uri} (real | base | trained per caption)"))
        return rows

    def __str__(self) -> str:
        width = max(len(label) for label, _ in self.rows())
        return "\n".join(f"{label:<{width}}  {text}" for label, text in self.rows())

    def _repr_html_(self) -> str:
        cells = "".join(
            f"<tr><th style='text-align:left'>{html.escape(label)}</th>"
            f"<td style='text-align:left'>{html.escape(text)}</td></tr>"
            for label, text in self.rows()
        )
        return f"<table>{cells}</table>"


def _empty_shards(dataset: dict[str, Any], ok: int | None) -> int:
    """Build dataset index's `shards_empty`, when it is a count within the succeeded shards."""
    empty = _int(dataset.get("shards_empty"))
    return empty if empty is not None and ok is not None and 0 <= empty <= ok else 0


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes}m {secs}s" if hours else f"{minutes}m {secs}s" if minutes else f"{seconds:.1f} s"


def _last_state(sfn: Any, execution_arn: str) -> dict[str, Any]:
    """The state document as the newest state to exit left it: what the steps had written."""
    runs = [run for run in history.read(history.fetch(sfn, execution_arn)).states.values() if run.output]
    if not runs:
        return {}
    newest = max(runs, key=lambda run: run.event_ids[-1])
    document = history.decode(newest.output)
    return document if isinstance(document, dict) else {}


def _part(document: dict[str, Any], key: str) -> dict[str, Any]:
    value = document.get(key)
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> float | None:
    try:
        return float(value) if value is not None and not isinstance(value, bool) else None
    except (TypeError, ValueError):
        return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def summarize(
    sfn: Any,
    s3: Any,
    bucket: str,
    execution_arn: str,
    workdir: Path | None = None,
    snap: progress.Progress | None = None,
) -> RunSummary:
    """The run's summary; `snap` is a final snapshot the caller already holds (a wait's last one),
    so the history, which runs to many pages for a large run, is not read twice."""
    if snap is None:
        snap = progress.snapshot(sfn, s3, bucket, execution_arn, workdir)
    described = sfn.describe_execution(executionArn=execution_arn)  # after the snapshot: at least as new
    status = str(described["status"])
    output = history.decode(described.get("output")) if described.get("output") else None
    state = output if isinstance(output, dict) else _last_state(sfn, execution_arn)
    dataset, training = _part(state, "dataset"), _part(state, "training")
    model, endpoint = _part(_part(state, "registry"), "model"), _part(state, "endpoint")
    metrics = _part(training, "final_metrics")
    loss = next((_number(metrics[key]) for key in LOSS_METRICS if key in metrics), snap.training_loss)
    adherence = model.get("prompt_adherence", metrics.get("eval:prompt_adherence"))
    base = model.get("base_prompt_adherence", metrics.get("eval:base_prompt_adherence"))
    ok, failed = _int(dataset.get("shards_ok")), _int(dataset.get("shards_failed"))
    total = snap.shards_total
    if total is None and ok is not None:
        total = ok + (failed or 0)
    started, stopped = described["startDate"], described.get("stopDate")
    failed_state = None
    if status not in ("SUCCEEDED", *UNFINISHED):
        failed_state = next((s for s, st in snap.states.items() if st in ("failed", "aborted")), None)
    return RunSummary(
        name=str(described["name"]),
        execution_arn=execution_arn,
        status=status,
        started=started,
        stopped=stopped,
        duration_s=max(0.0, ((stopped or datetime.now(UTC)) - started).total_seconds()),
        shards_total=total,
        shards_succeeded=ok if ok is not None else (snap.shards_done if total is not None else None),
        shards_failed=failed if failed is not None else snap.shards_failed,
        shards_reused=snap.shards_reused,
        shards_empty=_empty_shards(dataset, ok),
        samples=_int(dataset.get("total_samples")),
        data=_part(dataset, "curation") or None,
        training_job_name=training.get("job_name") or snap.training_job,
        final_loss=loss,
        prompt_adherence=_number(adherence),
        base_prompt_adherence=_number(base),
        model_data_uri=training.get("model_data_url"),
        model_package_arn=model.get("model_package_arn"),
        approval_status=model.get("approval_status"),
        metrics=evaluation_report.metrics_of(model),
        gate=[evaluation_report.check_record(check) for check in evaluation_report.gate_checks(model)],
        missing=evaluation_report.missing_of(model),
        holdout_samples=_int(model.get("holdout_samples")),
        holdout_grid_uri=model.get("holdout_grid_uri") or None,
        endpoint_name=endpoint.get("endpoint_name"),
        failed_state=failed_state,
        error=described.get("error"),
        cause=described.get("cause"),
    )
