"""The run notification: a message a person can act on, published to the run topic.

It reads only what the pipeline itself wrote into the state: `config` (Validate run), `dataset`
(Build dataset index), `training` (Train model), `endpoint` (Deploy endpoint) and `error` (the
Catch). The execution input never reaches it (the first state drops it), and a line whose data
is not there is left out rather than printed with placeholders."""

from __future__ import annotations

import contextlib
import json
import re
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sdflow_common import aws
from sdflow_common.run_document import RUN_NAME, printable

# SNS allows 100 characters of subject; a cause can be long, the mail should not be.
SUBJECT_LIMIT = 100
CAUSE_LIMIT = 2000

# Which step was running, judged by the results the steps before it wrote: (key, a key its
# result always has, the step that runs next). $.endpoint only exists once the run has
# succeeded, so it never names a failed step.
_PROGRESS = (
    ("training", "job_name", "Deploy endpoint"),
    ("dataset", "index_uri", "Train model"),
)
_AFTER_VALIDATION = "Download shards / Build dataset index"
_VALIDATION = "Validate run"


class NotifyRequest(BaseModel):
    """Payload of the "Notify success" / "Notify failure" states."""

    model_config = ConfigDict(extra="ignore")

    outcome: Literal["succeeded", "failed"]
    execution_arn: str
    execution_name: str
    start_time: str | None = None
    state: dict[str, Any] = Field(default_factory=dict)


class Notification(BaseModel):
    subject: str
    message: str
    attributes: dict[str, str]


def _duration(start_time: str | None, now: datetime) -> str:
    if not start_time:
        return "unknown time"
    started = datetime.fromisoformat(start_time.replace("Z", "+00:00"))
    if started.tzinfo is None:
        started = started.replace(tzinfo=UTC)
    seconds = max(0, int((now - started).total_seconds()))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes} min"
    if minutes:
        return f"{minutes} min {secs} s"
    return f"{secs} s"


def console_link(execution_arn: str) -> str:
    region = execution_arn.split(":")[3] if execution_arn.count(":") >= 3 else "us-east-1"
    return f"https://{region}.console.aws.amazon.com/states/home?region={region}#/v2/executions/details/{execution_arn}"


def _readable_cause(cause: str) -> str:
    """Lambda errors arrive as JSON with errorMessage; validation errors as a JSON list of fields."""
    message: Any = cause
    try:
        decoded = json.loads(cause)
        message = decoded.get("errorMessage", cause) if isinstance(decoded, dict) else decoded
    except (TypeError, ValueError):
        pass
    if isinstance(message, str):
        with contextlib.suppress(ValueError):
            message = json.loads(message)
    if isinstance(message, list):
        lines = [
            f"  - {item.get('field', '?')}: {item.get('message', item)}" if isinstance(item, dict) else f"  - {item}"
            for item in message
        ]
        message = "\n".join(lines)
    text = str(message)
    return text if len(text) <= CAUSE_LIMIT else text[:CAUSE_LIMIT] + " …"


def _written(state: dict[str, Any], key: str, marker: str) -> dict[str, Any] | None:
    """`state[key]` when it is the result the pipeline wrote there (a dict holding `marker`)."""
    value = state.get(key)
    return value if isinstance(value, dict) and marker in value else None


def _config(state: dict[str, Any]) -> dict[str, Any] | None:
    return _written(state, "config", "run_id")


def failed_step(state: dict[str, Any]) -> str:
    if _config(state) is None:
        return _VALIDATION
    return next((step for key, marker, step in _PROGRESS if _written(state, key, marker)), _AFTER_VALIDATION)


def _run_label(request: NotifyRequest) -> str:
    config = _config(request.state) or {}
    run = config.get("run")
    name = run.get("run_name") if isinstance(run, dict) else None
    execution = printable(request.execution_name)
    if isinstance(name, str) and re.fullmatch(RUN_NAME, name):
        return f"{name} ({execution})"
    return execution


def _dataset_lines(dataset: dict[str, Any]) -> list[str]:
    ok, failed = dataset.get("shards_ok"), dataset.get("shards_failed")
    if not isinstance(ok, int) or not isinstance(failed, int) or ok + failed == 0:
        return []
    samples = dataset.get("total_samples")
    samples_text = f", {samples:,} samples" if isinstance(samples, int) else ""
    lines = [f"Dataset:   {ok} of {ok + failed} shards downloaded{samples_text}"]
    for shard in dataset.get("failed_shards", []) or []:
        if isinstance(shard, dict) and shard.get("shard_id"):
            where = f": {shard['parquet_uri']}" if shard.get("parquet_uri") else ""
            lines.append(f"           failed shard {shard['shard_id']}{where}")
        elif isinstance(shard, str):
            lines.append(f"           failed shard {shard}")
    return lines


def _training_lines(training: dict[str, Any]) -> list[str]:
    metrics = training.get("final_metrics") or {}
    loss = metrics.get("train:loss", metrics.get("loss")) if isinstance(metrics, dict) else None
    loss_text = ""
    with contextlib.suppress(TypeError, ValueError):
        loss_text = f", final loss {float(loss):.4f}" if loss is not None and loss != "" else ""
    lines = [f"Training:  job {training['job_name']}{loss_text}"]
    if training.get("model_data_url"):
        lines.append(f"           model {training['model_data_url']}")
    return lines


def _warning_lines(config: dict[str, Any] | None) -> list[str]:
    """Problems Validate run tolerated (a few unreadable parquet files): the shards they explain."""
    warnings = (config or {}).get("warnings") or []
    lines = []
    for warning in warnings if isinstance(warnings, list) else []:
        if isinstance(warning, dict):
            lines.append(f"           {warning.get('field', '?')}: {warning.get('message', '')}")
    return (
        ["Warnings:  found when the run was validated (within download.tolerated_failure_percent)", *lines]
        if lines
        else []
    )


def sns_subject(text: str) -> str:
    """A valid SNS subject: "UTF-8 text with no line breaks or control characters, and less than 100
    characters long" (SNS Publish API reference). Kept to printable ASCII, as mail subjects are."""
    ascii_only = re.sub(r"[^\x20-\x7e]", "?", text)
    return ascii_only if len(ascii_only) < SUBJECT_LIMIT else ascii_only[: SUBJECT_LIMIT - 4] + "..."


def compose(request: NotifyRequest, now: datetime | None = None) -> Notification:
    now = now or datetime.now(UTC)
    state = request.state
    label = _run_label(request)
    duration = _duration(request.start_time, now)
    attributes = {"outcome": request.outcome, "run_id": printable(request.execution_name)}
    lines: list[str] = []
    step = failed_step(state)
    if request.outcome == "succeeded":
        subject = f"[sdflow] Run {label} succeeded"
        lines.append(f"sdflow run {label} SUCCEEDED in {duration}.")
    else:
        subject = f"[sdflow] Run {label} FAILED"
        error = _written(state, "error", "Error") or {}
        error_name = printable(str(error.get("Error", "UnknownError")))
        attributes["error"] = error_name
        lines.append(f"sdflow run {label} FAILED after {duration}, during: {step}.")
        lines.append("")
        lines.append(f"Error:     {error_name}")
        lines.append("Cause:")
        lines.append(_readable_cause(str(error.get("Cause", "(no cause given)"))))
    lines.append("")
    config = _config(state)
    dataset = _written(state, "dataset", "index_uri") if config else None
    training = _written(state, "training", "job_name") if config else None
    lines.extend(_warning_lines(config))
    if dataset:
        lines.extend(_dataset_lines(dataset))
    if training:
        lines.extend(_training_lines(training))
    endpoint = _written(state, "endpoint", "endpoint_name") if config else None
    if endpoint:
        name = str(endpoint["endpoint_name"])
        attributes["endpoint"] = name
        action = "updated blue/green" if endpoint.get("action") == "update" else "created"
        config_name = f", config {endpoint['endpoint_config_name']}" if endpoint.get("endpoint_config_name") else ""
        lines.append(f"Endpoint:  {name} ({action}{config_name})")
        lines.append(
            f"Invoke:    aws sagemaker-runtime invoke-endpoint --endpoint-name {name} "
            "--content-type application/json --accept image/png "
            '--body \'{"prompt": "a photo of a cat"}\' --cli-binary-format raw-in-base64-out out.png'
        )
    if request.outcome == "failed" and step == _VALIDATION:
        lines.append("Nothing was started: fix the run document as the cause says and start the run again.")
    elif request.outcome == "failed":
        lines.append("Nothing was deployed by this run; its jobs ended with it (see the console for each one).")
    lines.append(f"Console:   {console_link(request.execution_arn)}")
    return Notification(subject=sns_subject(subject), message="\n".join(lines) + "\n", attributes=attributes)


def publish(notification: Notification, topic_arn: str) -> str:
    response = aws.client("sns").publish(
        TopicArn=topic_arn,
        Subject=notification.subject,
        Message=notification.message,
        MessageAttributes={
            key: {"DataType": "String", "StringValue": value} for key, value in notification.attributes.items()
        },
    )
    return str(response["MessageId"])
