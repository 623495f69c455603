"""The run notification: a message a person can act on, published to the run topic.

It is composed from the "Step Functions Execution Status Change" event (EventBridge) of the
pipeline's execution: the event's status, error and cause; for a run that did not succeed, the
state it was in and what it had built, read back from its execution history
(sdflow_common.execution_history), and what the cleanup stopped or rolled back
(sdflow_common.run_cleanup); for a run that succeeded, its output. The state holds only what the
pipeline itself wrote: `config` (Validate run), `dataset` (Build dataset index), `training`
(Train model), `evaluation` (Evaluate model), `registry` (Register model), `endpoint` (Deploy
endpoint); a line whose data is not there is left out rather
than printed with placeholders."""

from __future__ import annotations

import contextlib
import json
import re
import shlex
from datetime import UTC, datetime
from typing import Any, Literal

from aws_lambda_powertools.utilities.parser.models import EventBridgeModel
from pydantic import BaseModel, ConfigDict, Field

from sdflow_common import aws, causes, curation, evaluation_report, execution_history, model_artifact, run_cleanup
from sdflow_common.run_document import RUN_NAME, printable
from sdflow_common.token_store import TokenStore

# SNS allows 100 characters of subject; a cause can be long, the mail should not be.
SUBJECT_LIMIT = 100
CAUSE_LIMIT = causes.CAUSE_LIMIT

# Which step was running, judged by the results the steps before it wrote: (key, a key its
# result always has, the step that runs next). Only a fallback for when the execution history
# names no state. $.endpoint only exists once the run has succeeded, so it never names a failed step.
_PROGRESS = (
    ("registry", "model", "Deploy endpoint"),
    ("evaluation", "evaluation_uri", "Register model"),
    ("training", "job_name", "Evaluate model"),
    ("dataset", "index_uri", "Train model"),
    ("dedup", "summary_uri", "Build dataset index"),
)
_AFTER_VALIDATION = "Download shards / Build dataset index"
_VALIDATION = "Validate run"
# States that run before anything is started in SageMaker.
_BEFORE_ANY_JOB = frozenset({_VALIDATION, "Prepare input"})

Outcome = Literal["succeeded", "failed", "timed_out", "aborted"]
OUTCOMES: dict[str, Outcome] = {
    "SUCCEEDED": "succeeded",
    "FAILED": "failed",
    "TIMED_OUT": "timed_out",
    "ABORTED": "aborted",
}


# ---------------------------------------------------------------------------- the event


class ExecutionDataDetails(BaseModel):
    """`inputDetails` / `outputDetails`: `included` is false when Step Functions left the data out
    of the event (over EventBridge's size limit; Step Functions developer guide, "EventBridge
    payloads"): DescribeExecution still has it."""

    model_config = ConfigDict(extra="ignore")
    included: bool = True


class ExecutionStatusDetail(BaseModel):
    """The detail of "Step Functions Execution Status Change" (Step Functions developer guide,
    "EventBridge (CloudWatch Events) for Step Functions execution status changes"). Dates are
    epoch milliseconds; input and output are JSON strings or null."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True)

    execution_arn: str = Field(alias="executionArn")
    state_machine_arn: str = Field(alias="stateMachineArn")
    name: str
    status: Literal["RUNNING", "SUCCEEDED", "FAILED", "TIMED_OUT", "ABORTED", "PENDING_REDRIVE"]
    start_date: int = Field(alias="startDate")
    stop_date: int | None = Field(default=None, alias="stopDate")
    input: str | None = None
    output: str | None = None
    input_details: ExecutionDataDetails | None = Field(default=None, alias="inputDetails")
    output_details: ExecutionDataDetails | None = Field(default=None, alias="outputDetails")
    error: str | None = None
    cause: str | None = None
    # Absent from events of executions that were never redriven in some examples: 0 then.
    redrive_count: int = Field(default=0, alias="redriveCount")

    @property
    def outcome(self) -> Outcome | None:
        return OUTCOMES.get(self.status)


class ExecutionStatusChange(EventBridgeModel):
    detail_type: Literal["Step Functions Execution Status Change"] = Field(alias="detail-type")
    detail: ExecutionStatusDetail


def _iso(epoch_ms: int | None) -> str | None:
    if epoch_ms is None:
        return None
    return datetime.fromtimestamp(epoch_ms / 1000, tz=UTC).isoformat().replace("+00:00", "Z")


# ---------------------------------------------------------------------------- the message


class NotifyRequest(BaseModel):
    """Everything the message says, gathered by the handler."""

    model_config = ConfigDict(extra="ignore")

    outcome: Outcome
    execution_arn: str
    execution_name: str
    start_time: str | None = None
    stop_time: str | None = None
    state: dict[str, Any] = Field(default_factory=dict)
    running_state: str | None = None
    error: str | None = None
    cause: str | None = None
    cleanup: list[str] = Field(default_factory=list)
    redrive_count: int = 0

    @classmethod
    def from_event(cls, detail: ExecutionStatusDetail, **found: Any) -> NotifyRequest:
        outcome = detail.outcome
        if outcome is None:
            raise ValueError(f"execution status {detail.status} is not an end of the run; nothing to notify")
        return cls(
            outcome=outcome,
            execution_arn=detail.execution_arn,
            execution_name=detail.name,
            start_time=_iso(detail.start_date),
            stop_time=_iso(detail.stop_date),
            redrive_count=detail.redrive_count,
            **found,
        )


class Notification(BaseModel):
    subject: str
    message: str
    attributes: dict[str, str]

    def log_fields(self) -> dict[str, str]:
        """The message in full for the "notification published" log record: SNS cannot read a
        published message back, so the run console (sdflow/console/jobs.py) and a person
        searching the logs find it there."""
        return {"subject": self.subject, "notification": self.message}


def _duration(start_time: str | None, end: datetime) -> str:
    started = _parse_time(start_time)
    if started is None:
        return "unknown time"
    seconds = max(0, int((end - started).total_seconds()))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes} min"
    if minutes:
        return f"{minutes} min {secs} s"
    return f"{secs} s"


def console_link(execution_arn: str, console_url: str = "") -> str:
    """The run in `console_url`'s run console (`sdflow console`), else in the AWS console."""
    if console_url:
        return f"{console_url.rstrip('/')}/#/runs/{execution_arn.rsplit(':', 1)[-1]}"
    region = execution_arn.split(":")[3] if execution_arn.count(":") >= 3 else "us-east-1"
    return f"https://{region}.console.aws.amazon.com/states/home?region={region}#/v2/executions/details/{execution_arn}"


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


def _data_lines(dataset: dict[str, Any], filters: dict[str, Any] | None) -> list[str]:
    """What was kept and why (sdflow_common.curation): each stage of the funnel on a line of its own."""
    stages = curation.data_lines(dataset.get("curation"), filters)
    return [f"{'Data:' if i == 0 else '':<11}{'' if i == 0 else '→ '}{stage}" for i, stage in enumerate(stages)]


def _dataset_lines(dataset: dict[str, Any], filters: dict[str, Any] | None = None) -> list[str]:
    ok, failed = dataset.get("shards_ok"), dataset.get("shards_failed")
    if not isinstance(ok, int) or not isinstance(failed, int) or ok + failed == 0:
        return []
    # A shard whose job succeeded but fetched no image was not downloaded (`sdflow status` agrees).
    empty = dataset.get("shards_empty")
    empty = empty if isinstance(empty, int) and 0 <= empty <= ok else 0
    samples = dataset.get("total_samples")
    samples_text = f", {samples:,} samples" if isinstance(samples, int) else ""
    # With the counts (below) a shard may hold nothing because the filters or duplicates took every row.
    why = (
        "held nothing to train on" if isinstance(dataset.get("curation"), dict) else "held no image (every URL failed)"
    )
    empty_text = f"; {empty} {why}" if empty else ""
    lines = [f"Dataset:   {ok - empty} of {ok + failed} shards downloaded{samples_text}{empty_text}"]
    for shard in dataset.get("failed_shards", []) or []:
        if isinstance(shard, dict) and shard.get("shard_id"):
            where = f": {shard['parquet_uri']}" if shard.get("parquet_uri") else ""
            lines.append(f"           failed shard {shard['shard_id']}{where}")
        elif isinstance(shard, str):
            lines.append(f"           failed shard {shard}")
    return lines + _data_lines(dataset, filters)


def _training_lines(training: dict[str, Any]) -> list[str]:
    metrics = training.get("final_metrics") or {}
    loss = metrics.get("train:loss", metrics.get("loss")) if isinstance(metrics, dict) else None
    loss_text = ""
    with contextlib.suppress(TypeError, ValueError):
        loss_text = f", final loss {float(loss):.4f}" if loss is not None and loss != "" else ""
    lines = [f"Training:  job {training['job_name']}{loss_text}"]
    adherence = _adherence_text(metrics if isinstance(metrics, dict) else {})
    if adherence:
        lines.append(f"           {adherence}")
    uri = training.get("model_data_url")
    if uri:
        lines.append(f"           model {uri}")
        # Next to the weights: what a person looks at first. An uncompressed model's files are objects of
        # their own (sdflow_common.model_artifact); an older model.tar.gz holds them.
        if model_artifact.is_prefix(str(uri)):
            lines.append(f"           loss curve {uri}loss.png, samples {uri}samples.png")
            lines.append(f"           held-out prompts {uri}adherence.png")
        else:
            lines.append("           loss curve loss.png, samples samples.png, held-out prompts adherence.png (in it)")
    return lines


def _adherence_text(metrics: dict[str, Any]) -> str:
    """`prompt adherence: base 0.10 → trained 0.85 (held-out prompts)` from the training job's metrics."""
    trained, base = metrics.get("eval:prompt_adherence"), metrics.get("eval:base_prompt_adherence")
    if trained is None:
        return ""
    try:
        trained_text = f"{float(trained):.2f}"
        base_text = f"base {float(base):.2f} → " if base is not None else ""
    except (TypeError, ValueError):
        return ""
    return f"prompt adherence: {base_text}trained {trained_text} (held-out prompts)"


def _registered_model(state: dict[str, Any]) -> dict[str, Any] | None:
    """Register model's `$.registry.model`, when the state holds one naming a package."""
    registry = _written(state, "registry", "model")
    model = registry["model"] if registry else None
    return model if isinstance(model, dict) and model.get("model_package_arn") else None


def _model_lines(model: dict[str, Any]) -> list[str]:
    """The registered package and its approval, then the evaluation (evaluation_report): each metric base →
    trained with its direction and sample count, the gate's checks, the metrics not computed, the grids."""
    lines = [f"Model:     {model['model_package_arn']} ({model.get('approval_status', '?')})"]
    evaluation = evaluation_report.model_lines(model)
    if evaluation:
        lines.append("Evaluation: base → trained (↑ higher is better, ↓ lower is better)")
        lines.extend(f"           {line}" for line in evaluation)
    return lines


def _warning_lines(config: dict[str, Any] | None) -> list[str]:
    """What Validate run accepted but the user should know: a few unreadable parquet files (the shards they
    explain), a dataset too small for an automatic held-out split."""
    warnings = (config or {}).get("warnings") or []
    lines = []
    for warning in warnings if isinstance(warnings, list) else []:
        if isinstance(warning, dict):
            lines.append(f"           {warning.get('field', '?')}: {warning.get('message', '')}")
    return ["Warnings:  found when the run was validated", *lines] if lines else []


def sns_subject(text: str) -> str:
    """A valid SNS subject: "UTF-8 text with no line breaks or control characters, and less than 100
    characters long" (SNS Publish API reference). Kept to printable ASCII, as mail subjects are."""
    ascii_only = re.sub(r"[^\x20-\x7e]", "?", text)
    return ascii_only if len(ascii_only) < SUBJECT_LIMIT else ascii_only[: SUBJECT_LIMIT - 4] + "..."


_HEADLINES: dict[Outcome, tuple[str, str]] = {
    "succeeded": ("succeeded", "SUCCEEDED in {duration}."),
    "failed": ("FAILED", "FAILED after {duration}"),
    "timed_out": (
        "TIMED OUT",
        "TIMED OUT after {duration}: the run exceeded its time limit (the state machine's TimeoutSeconds)",
    ),
    "aborted": ("STOPPED", "was STOPPED after {duration} (StopExecution)"),
}


def _parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


# The error the local cloud stops its running executions with when `sdflow local up` ends
# (sdflow/local/stepfunctions/shutdown.py): no StopExecution call, and nothing left to redrive.
LOCAL_CLOUD_STOPPED = "sdflow.LocalCloudStopped"


def _headline(request: NotifyRequest, label: str, now: datetime) -> tuple[str, str]:
    subject_word, text = _HEADLINES[request.outcome]
    if request.error == LOCAL_CLOUD_STOPPED:
        text = "was STOPPED after {duration} (the local cloud stopped)"
    end = _parse_time(request.stop_time) or now
    line = f"sdflow run {label} " + text.format(duration=_duration(request.start_time, end))
    if request.outcome != "succeeded":
        line += f", in state: {_running_step(request)}."
    if request.redrive_count:
        line += f" (redrive {request.redrive_count})"
    return f"[sdflow] Run {label} {subject_word}", line


def _running_step(request: NotifyRequest) -> str:
    return request.running_state or failed_step(request.state)


def _error_lines(request: NotifyRequest) -> list[str]:
    if request.outcome == "aborted" and not request.error and not request.cause:
        return ["Stopped by a StopExecution call that gave no error or cause."]
    default_error = "States.Timeout" if request.outcome == "timed_out" else "UnknownError"
    lines = [f"Error:     {printable(request.error or default_error)}"]
    if request.outcome == "aborted" and request.cause:
        lines.append(f"Stopped by / because: {causes.readable_cause(request.cause)}")
    else:
        lines.append("Cause:")
        lines.append(causes.readable_cause(request.cause or "(no cause given)"))
    if request.cause and causes.is_reworded(request.cause):
        lines.append(
            f"           the raw cause (stack trace included): {causes.raw_cause_command(request.execution_arn)}"
        )
    return lines


def _endpoint_lines(endpoint: dict[str, Any], attributes: dict[str, str]) -> list[str]:
    name = str(endpoint["endpoint_name"])
    attributes["endpoint"] = name
    action = "updated blue/green" if endpoint.get("action") == "update" else "created"
    config_name = f", config {endpoint['endpoint_config_name']}" if endpoint.get("endpoint_config_name") else ""
    # AWS CLI v2 reads a blob argument as base64 unless told otherwise; v1 reads it as raw text and
    # does not know --cli-binary-format. A body from a file (fileb://) is raw bytes in both.
    return [
        f"Endpoint:  {name} ({action}{config_name})",
        f"Invoke:    sdflow invoke {shlex.quote(name)} 'a photo of a cat' -o out.png",
        "           or with the AWS CLI (v1 or v2):",
        """             echo '{"prompt": "a photo of a cat"}' > body.json""",
        f"             aws sagemaker-runtime invoke-endpoint --endpoint-name {shlex.quote(name)} "
        "--content-type application/json --accept image/png --body fileb://body.json out.png",
    ]


def _progress_lines(state: dict[str, Any], attributes: dict[str, str]) -> list[str]:
    config = _config(state)
    if config is None:
        return []
    lines = _warning_lines(config)
    dataset = _written(state, "dataset", "index_uri")
    if dataset:
        filters = ((config.get("run") or {}).get("dataset") or {}).get("filters")
        lines.extend(_dataset_lines(dataset, filters if isinstance(filters, dict) else None))
    training = _written(state, "training", "job_name")
    if training:
        lines.extend(_training_lines(training))
    model = _registered_model(state)
    if model:
        lines.extend(_model_lines(model))
    endpoint = _written(state, "endpoint", "endpoint_name")
    if endpoint:
        lines.extend(_endpoint_lines(endpoint, attributes))
    return lines


def _next_step_lines(request: NotifyRequest) -> list[str]:
    # Pasted into a shell as they are: an execution name may hold characters a shell reads ('()!).
    arn = shlex.quote(request.execution_arn)
    if _running_step(request) in _BEFORE_ANY_JOB and _config(request.state) is None:
        return ["Next:      nothing was started; fix the run document as the cause says and start the run again."]
    if request.error == LOCAL_CLOUD_STOPPED:
        # The local cloud keeps no executions between starts: there is no execution left to redrive or resume.
        return ["Next:      start the local cloud again (sdflow local up) and start the run anew."]
    model = _registered_model(request.state)
    if _running_step(request) == "Wait for approval" and model:
        package = model["model_package_arn"]
        return [
            "Next:      nobody approved the model in time; approve it, then redrive (the run deploys it at once):",
            f"             aws sagemaker update-model-package --model-package-arn {shlex.quote(package)} "
            "--model-approval-status Approved",
            f"             aws stepfunctions redrive-execution --execution-arn {arn}",
        ]
    if request.error in ("QualityGateFailed", "ModelRejected"):
        # A redrive would judge the same model again: the model (or the gate) has to change.
        return [
            "Next:      the model was not deployed; train it longer or on more data, or change the gate, in a run "
            "that reuses every finished shard (and the model, if the training options are unchanged):",
            f"             sdflow resume {arn} --manifest NEW.json",
        ]
    return [
        "Next:      re-run only what did not finish (same input, finished steps kept):",
        f"             aws stepfunctions redrive-execution --execution-arn {arn}",
        "           or start a new run that reuses every finished shard and model (optionally with a new manifest):",
        f"             sdflow resume {arn} [--manifest NEW.json]",
    ]


def compose(request: NotifyRequest, now: datetime | None = None, console_url: str = "") -> Notification:
    now = now or datetime.now(UTC)
    label = _run_label(request)
    subject, headline = _headline(request, label, now)
    attributes = {"outcome": request.outcome, "run_id": printable(request.execution_name)}
    lines = [headline, ""]
    if request.outcome != "succeeded":
        attributes["error"] = printable(
            request.error or ("States.Timeout" if request.outcome == "timed_out" else "UnknownError")
        )
        lines.extend(_error_lines(request))
        lines.append("")
    lines.extend(_progress_lines(request.state, attributes))
    if request.outcome != "succeeded":
        lines.append("Cleanup:   " + ("\n           ".join(request.cleanup) or "nothing to clean up."))
        lines.extend(_next_step_lines(request))
    lines.append(f"Console:   {console_link(request.execution_arn, console_url)}")
    return Notification(subject=sns_subject(subject), message="\n".join(lines) + "\n", attributes=attributes)


def _json_object(text: str | None) -> dict[str, Any]:
    try:
        decoded = json.loads(text) if text else {}
    except ValueError:
        return {}
    return decoded if isinstance(decoded, dict) else {}


def gather(
    detail: ExecutionStatusDetail, *, sfn: Any, sagemaker: Any, store: TokenStore
) -> tuple[NotifyRequest, run_cleanup.CleanupReport | None]:
    """The message's facts; for a run that did not succeed, the cleanup is done first, so the
    message can say what it stopped."""
    if detail.outcome == "succeeded":
        output = detail.output
        if output is None or (detail.output_details is not None and not detail.output_details.included):
            output = sfn.describe_execution(executionArn=detail.execution_arn).get("output")
        return NotifyRequest.from_event(detail, state=_json_object(output)), None
    history = execution_history.read_history(sfn, detail.execution_arn)
    # The training job's claim went when it completed: the state names it, for its warm pool.
    training = _written(history.state, "training", "job_name")
    report = run_cleanup.clean_up_run(
        detail.execution_arn,
        detail.start_date,
        sagemaker=sagemaker,
        store=store,
        sfn=sfn,
        redrive_count=detail.redrive_count,
        training_jobs=[str(training["job_name"])] if training else [],
    )
    request = NotifyRequest.from_event(
        detail,
        state=history.state,
        running_state=history.running_state,
        # The event's own error and cause when it carries them; the history's otherwise.
        error=detail.error or history.error,
        cause=detail.cause or history.cause,
        cleanup=report.lines(),
    )
    return request, report


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
