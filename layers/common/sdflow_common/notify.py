"""The run notification: a message a person can act on, published to the run topic."""

from __future__ import annotations

import contextlib
import json
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sdflow_common import aws

# SNS allows 100 characters of subject; a cause can be long, the mail should not be.
SUBJECT_LIMIT = 100
CAUSE_LIMIT = 2000

# Which step was running, judged by what the state already holds (each step adds one key;
# $.endpoint only exists once the run has succeeded, so it never names a failed step).
_PROGRESS = (
    ("training", "Deploy endpoint"),
    ("dataset", "Train model"),
    ("config", "Download shards / Build dataset index"),
)


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


def _run_label(request: NotifyRequest) -> str:
    run = request.state.get("config", {}).get("run", {}) or request.state
    name = run.get("run_name") if isinstance(run, dict) else None
    return f"{name} ({request.execution_name})" if name else request.execution_name


def _dataset_lines(dataset: dict[str, Any]) -> list[str]:
    ok = dataset.get("shards_ok", 0)
    failed = dataset.get("shards_failed", 0)
    lines = [f"Dataset:   {ok} of {ok + failed} shards downloaded, {dataset.get('total_samples', 0):,} samples"]
    for shard in dataset.get("failed_shards", []) or []:
        if isinstance(shard, dict):
            lines.append(f"           failed shard {shard.get('shard_id')}: {shard.get('parquet_uri', '')}")
        else:
            lines.append(f"           failed shard {shard}")
    return lines


def _training_lines(training: dict[str, Any]) -> list[str]:
    metrics = training.get("final_metrics") or {}
    loss = metrics.get("train:loss", metrics.get("loss"))
    loss_text = f", final loss {float(loss):.4f}" if isinstance(loss, int | float | str) and loss != "" else ""
    lines = [f"Training:  job {training.get('job_name', '?')}{loss_text}"]
    if training.get("model_data_url"):
        lines.append(f"           model {training['model_data_url']}")
    return lines


def compose(request: NotifyRequest, now: datetime | None = None) -> Notification:
    now = now or datetime.now(UTC)
    state = request.state
    label = _run_label(request)
    duration = _duration(request.start_time, now)
    attributes = {"outcome": request.outcome, "run_id": request.execution_name}
    lines: list[str] = []
    if request.outcome == "succeeded":
        subject = f"[sdflow] Run {label} succeeded"
        lines.append(f"sdflow run {label} SUCCEEDED in {duration}.")
    else:
        subject = f"[sdflow] Run {label} FAILED"
        step = next((step for key, step in _PROGRESS if key in state), "Validate run")
        error = state.get("error") or {}
        error_name = str(error.get("Error", "UnknownError"))
        attributes["error"] = error_name
        lines.append(f"sdflow run {label} FAILED after {duration}, during: {step}.")
        lines.append("")
        lines.append(f"Error:     {error_name}")
        lines.append("Cause:")
        lines.append(_readable_cause(str(error.get("Cause", "(no cause given)"))))
    lines.append("")
    if isinstance(state.get("dataset"), dict):
        lines.extend(_dataset_lines(state["dataset"]))
    if isinstance(state.get("training"), dict):
        lines.extend(_training_lines(state["training"]))
    endpoint = state.get("endpoint")
    if isinstance(endpoint, dict) and endpoint.get("endpoint_name"):
        name = endpoint["endpoint_name"]
        attributes["endpoint"] = name
        action = "updated blue/green" if endpoint.get("action") == "update" else "created"
        lines.append(f"Endpoint:  {name} ({action}, config {endpoint.get('endpoint_config_name', '?')})")
        lines.append(
            f"Invoke:    aws sagemaker-runtime invoke-endpoint --endpoint-name {name} "
            "--content-type application/json --accept image/png "
            '--body \'{"prompt": "a photo of a cat"}\' --cli-binary-format raw-in-base64-out out.png'
        )
    if request.outcome == "failed":
        lines.append("Nothing was deployed by this run; its jobs ended with it (see the console for each one).")
    lines.append(f"Console:   {console_link(request.execution_arn)}")
    if len(subject) > SUBJECT_LIMIT:
        subject = subject[: SUBJECT_LIMIT - 1] + "…"
    return Notification(subject=subject, message="\n".join(lines) + "\n", attributes=attributes)


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
