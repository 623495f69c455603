"""A failure's error and cause as a person reads them: the problem, the fields and the fixes.

One reading for every place a person sees a failure: the notification, `sdflow status` and the
run console. Step Functions passes a Lambda task's failure on as the cause verbatim: the Lambda
error JSON (`{"errorMessage", "errorType", "requestId", "stackTrace"}`, Lambda developer guide,
"AWS Lambda function errors in Python"), with the message escaped inside it. sdflow's own errors
put their report in errorMessage: Validate run a JSON list of `{"field", "message"}` (the problem
and its fix, sdflow_common.run_document), the other steps a sentence. Read here: the problem
(the error's own docstring, or Step Functions' error name said as a sentence), then that report
unescaped, one field a line; never the stack trace or the request id, which stay in the raw
cause (`raw_cause_command`, the console's "Raw cause" disclosure)."""

from __future__ import annotations

import json
import shlex
from typing import Any

from sdflow_common import errors

CAUSE_LIMIT = 2000
# Step Functions' own error names (Developer Guide, "Error names"), said as the problem.
STATES_ERRORS = {
    "States.ALL": "The step failed.",
    "States.TaskFailed": "The step's task failed.",
    "States.Timeout": "The step ran longer than its time limit (or stopped sending heartbeats).",
    "States.HeartbeatTimeout": "The step stopped sending heartbeats.",
    "States.Runtime": "Step Functions could not process the step's data (a path or a parameter did not resolve).",
    "States.DataLimitExceeded": "A step's input or output was larger than Step Functions' 256 KiB limit.",
    "States.ExceedToleratedFailureThreshold": "More of the Map's child executions failed than the run tolerates.",
    "States.ItemReaderFailed": "The Map could not read its item list from S3.",
    "States.ResultWriterFailed": "The Map could not write its results to S3.",
    "States.Permissions": "The state machine's role lacks a permission the step needs.",
    "States.BranchFailed": "A branch of the step failed.",
    "States.NoChoiceMatched": "No rule of the Choice state matched its input.",
    "Lambda.Unknown": "The step's Lambda function ended without an answer (out of memory or time).",
    "Lambda.ServiceException": "Lambda failed to run the step's function.",
    "Lambda.TooManyRequestsException": "Lambda throttled the step's function.",
}


def _json(text: Any) -> Any:
    if not isinstance(text, str):
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def _problems(decoded: Any) -> list[dict[str, str]] | None:
    """The `[{"field", "message"}]` report validation writes, or None when it is not one."""
    if not isinstance(decoded, list) or not decoded or not all(isinstance(item, dict) for item in decoded):
        return None
    if not all("message" in item for item in decoded):
        return None
    return [{"field": str(item.get("field") or "(document)"), "message": str(item["message"])} for item in decoded]


def _plain(text: str) -> str:
    """A message without a Python traceback: the traceback's last line is what was raised."""
    if "Traceback (most recent call last)" in text:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        text = lines[-1] if lines else ""
    return text.strip()


def _sentence_of(value: Any) -> str:
    """Any other structured cause, as `key: value; ...` rather than JSON with escaped quotes."""
    if isinstance(value, dict):
        return "; ".join(f"{key}: {_sentence_of(item)}" for key, item in value.items() if key != "stackTrace")
    if isinstance(value, list):
        return ", ".join(_sentence_of(item) for item in value)
    return str(value)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + " …"


def title_of(error: str | None) -> str | None:
    """The problem an error name stands for: the pipeline's named errors say it in their docstring."""
    if not error:
        return None
    if error in STATES_ERRORS:
        return STATES_ERRORS[error]
    found = getattr(errors, error, None)
    if isinstance(found, type) and issubclass(found, errors.SdflowError) and found.__doc__:
        return " ".join(found.__doc__.split())
    return None


def read(error: str | None, cause: str | None, limit: int = CAUSE_LIMIT) -> dict[str, Any] | None:
    """{"error", "title", "problems": [{"field", "message"}] | null, "message": str | null};
    None when there is neither an error nor a cause."""
    if not error and not cause:
        return None
    text, named = cause or "", error
    decoded = _json(text)
    if isinstance(decoded, dict) and "errorMessage" in decoded:  # Lambda's error document
        named = str(decoded["errorType"]) if decoded.get("errorType") else error
        text = str(decoded.get("errorMessage") or "")
        decoded = _json(text)
    problems = _problems(decoded)
    message: str | None = None
    if problems is None:
        message = _clip(_sentence_of(decoded) if isinstance(decoded, dict | list) else _plain(text), limit)
    title = title_of(named) or title_of(error)
    return {"error": error or named, "title": title, "problems": problems, "message": message or None}


def readable_cause(cause: str, limit: int = CAUSE_LIMIT) -> str:
    """The cause as text: the message, or one `  - field: fix` line per problem; never the stack trace."""
    reading = read(None, cause, limit)
    if reading is None:
        return ""
    if reading["problems"] is not None:
        return _clip("\n".join(f"  - {p['field']}: {p['message']}" for p in reading["problems"]), limit)
    return str(reading["message"] or "")


def is_reworded(cause: str) -> bool:
    """Whether readable_cause shows less than the raw cause (then say where the raw one is)."""
    return readable_cause(cause, limit=len(cause) + 1) != cause.strip()


def raw_cause_command(execution_arn: str) -> str:
    """The command that prints the execution's raw cause (stack trace included)."""
    return (
        f"aws stepfunctions describe-execution --execution-arn {shlex.quote(execution_arn)} --query cause --output text"
    )
