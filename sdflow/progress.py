"""What a run is doing right now, read from the same APIs a user has on AWS.

Per-state status comes from the execution history (sdflow.history, the console's reading too),
shard counts from the run's S3 prefix, and the training step and loss from the local training
job's log (the local runtime keeps logs in its work folder; on AWS the console and CloudWatch show them)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdflow import history
from sdflow_common import causes, curation, evaluation_report, names

PIPELINE_STATES = (
    "Validate run",
    "Download shards",
    "Find duplicates",
    "Build dataset index",
    "Train model",
    "Reuse trained model",
    "Evaluate model",
    "Register model",
    "Wait for approval",
    "Deploy endpoint",
)
# `sdflow status` is read in a terminal: the cause's report, clipped shorter than a notification's.
CAUSE_CHARS = 1200
STEP_LOSS = re.compile(r"step=(\d+) loss=([0-9.eE+-]+)")


@dataclass
class Progress:
    execution_arn: str
    status: str
    states: dict[str, str] = field(default_factory=dict)  # sdflow.history's statuses
    attempts: dict[str, int] = field(default_factory=dict)
    shards_total: int | None = None
    shards_done: int = 0
    shards_reused: int = 0  # a resumed run's shards an earlier run downloaded (counted in shards_done)
    shards_failed: int | None = None
    # index.json's `curation`: what was kept and why (rows read, filtered, failed, duplicates, kept).
    curation: dict[str, Any] | None = None
    training_job: str | None = None
    training_step: int | None = None
    training_loss: float | None = None
    output: dict[str, Any] | None = None
    error: str | None = None
    cause: str | None = None

    @property
    def finished(self) -> bool:
        return self.status not in {"RUNNING", "PENDING_REDRIVE"}


def _read_json(s3: Any, bucket: str, key: str) -> Any:
    try:
        return json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    except s3.exceptions.NoSuchKey:
        return None


def _shards(s3: Any, bucket: str, run_id: str, progress: Progress) -> None:
    shards = _read_json(s3, bucket, f"runs/{run_id}/shards.json")
    if shards is None:
        return
    progress.shards_total = len(shards)
    # Reused shards' markers lie in the earlier runs' folders, not below this run's prefix.
    progress.shards_reused = sum(1 for shard in shards if isinstance(shard, dict) and shard.get("cached"))
    index = _read_json(s3, bucket, f"runs/{run_id}/dataset/index.json")
    if index is not None:
        # Once the index exists it has the final counts; no need to list every shard again.
        progress.shards_done = len(index.get("shards", []))
        progress.shards_failed = len(index.get("failed_shards", []))
        found = index.get("curation")
        progress.curation = found if isinstance(found, dict) else None
        return
    paginator = s3.get_paginator("list_objects_v2")
    done = 0
    for page in paginator.paginate(Bucket=bucket, Prefix=f"runs/{run_id}/dataset/shards/"):
        done += sum(1 for obj in page.get("Contents", []) if obj["Key"].endswith("/_SUCCESS"))
    progress.shards_done = done + progress.shards_reused


def _training(workdir: Path | None, execution_arn: str, start_time: Any, progress: Progress) -> None:
    if workdir is None:
        return
    pattern = names.training_job_glob(execution_arn, start_time)
    logs = sorted((workdir / "sagemaker" / "jobs").glob(f"{pattern}/algo-1.log"), key=lambda path: path.stat().st_mtime)
    if not logs:
        return
    log = logs[-1]
    progress.training_job = log.parent.name
    matches = STEP_LOSS.findall(log.read_text(errors="replace")[-20000:])
    if matches:
        step, loss = matches[-1]
        progress.training_step, progress.training_loss = int(step), float(loss)


def snapshot(sfn: Any, s3: Any, bucket: str, execution_arn: str, workdir: Path | None = None) -> Progress:
    description = sfn.describe_execution(executionArn=execution_arn)
    run_id = description["name"]
    progress = Progress(execution_arn=execution_arn, status=description["status"])
    runs = history.read(history.fetch(sfn, execution_arn)).states
    progress.states = {name: run.status for name, run in runs.items() if name in PIPELINE_STATES}
    progress.attempts = {name: run.attempts for name, run in runs.items() if name in PIPELINE_STATES}
    if description.get("output"):
        progress.output = json.loads(description["output"])
    progress.error = description.get("error")
    progress.cause = description.get("cause")
    _shards(s3, bucket, run_id, progress)
    if "Train model" in progress.states:
        _training(workdir, execution_arn, description["startDate"], progress)
    return progress


ICONS = {"succeeded": "✔", "running": "…", "failed": "✘", "caught": "↪", "aborted": "■"}
# Said in words where an icon alone would mislead: a caught failure did not stop the run.
NOTES = {"caught": "  (failed; caught)", "aborted": "  (stopped)"}


def state_lines(progress: Progress) -> dict[str, str]:
    """One line per state that has started, keyed by state name."""
    lines = {}
    for state in PIPELINE_STATES:
        status = progress.states.get(state)
        if status is None:
            continue
        detail = ""
        if state == "Download shards" and progress.shards_total is not None:
            detail = f"  {progress.shards_done}/{progress.shards_total} shards downloaded"
            if progress.shards_reused:
                detail += f" ({progress.shards_reused} reused)"
            if progress.shards_failed:
                detail += f", {progress.shards_failed} failed"
        if state == "Train model" and progress.training_step is not None:
            detail = f"  step {progress.training_step}, loss {progress.training_loss:.4f}"
        if progress.attempts.get(state, 1) > 1:
            detail += f"  (attempt {progress.attempts[state]})"
        detail += NOTES.get(status, "")
        lines[state] = f"  {ICONS.get(status, ' ')} {state:<20}{detail}".rstrip()
    return lines


def model_lines(output: dict[str, Any] | None) -> list[str]:
    """The registered model and its evaluation (each metric base → trained, the gate's checks, what was not
    computed, the grids), as the notification shows them (sdflow_common.evaluation_report)."""
    registry = (output or {}).get("registry")
    model = registry.get("model") if isinstance(registry, dict) else None
    if not isinstance(model, dict) or not model.get("model_package_arn"):
        return []
    lines = [f"  model: {model['model_package_arn']} ({model.get('approval_status', '?')})"]
    evaluation = evaluation_report.model_lines(model)
    if evaluation:
        lines.append("  evaluation, base → trained (↑ higher is better, ↓ lower is better):")
        lines.extend(f"    {line}" for line in evaluation)
    return lines


def data_lines(progress: Progress) -> list[str]:
    """The run's data funnel as the notification words it (sdflow_common.curation), once the index exists."""
    found = progress.curation or {}
    filters = found.get("filters")
    stages = curation.data_lines(found, filters if isinstance(filters, dict) else None)
    return [f"  {'data:' if i == 0 else '':<6}{'' if i == 0 else '→ '}{stage}" for i, stage in enumerate(stages)]


def render_lines(progress: Progress) -> list[str]:
    lines = [f"execution {progress.execution_arn.rsplit(':', 1)[-1]}: {progress.status}"]
    lines += list(state_lines(progress).values())
    lines += data_lines(progress)
    lines += model_lines(progress.output)
    if progress.error:
        lines.append(f"  error: {progress.error}")
        if progress.cause:
            # The report the step wrote, a field a line; the raw cause (a Lambda error's stack
            # trace) is one command away.
            lines.extend(f"  {line}" for line in causes.readable_cause(progress.cause, CAUSE_CHARS).splitlines())
            if causes.is_reworded(progress.cause):
                lines.append(f"  raw cause: {causes.raw_cause_command(progress.execution_arn)}")
    return lines
