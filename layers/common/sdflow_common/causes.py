"""A failure's cause as sentences: what a person reads in the notification and in `sdflow status`.

Step Functions passes a Lambda task's failure on as the cause verbatim: the Lambda error JSON
(`{"errorMessage", "errorType", "requestId", "stackTrace"}`, Lambda developer guide, "AWS Lambda
function errors in Python"), with the message escaped inside it. sdflow's own errors put their
report in errorMessage: Validate run a JSON list of `{"field", "message"}` (the problem and its
fix, sdflow_common.run_document), the other steps a sentence. Shown here: that report, unescaped,
one field a line; never the stack trace or the request id, which stay in the raw cause
(`raw_cause_command`)."""

from __future__ import annotations

import contextlib
import json
import shlex
from typing import Any

CAUSE_LIMIT = 2000


def _report(cause: str) -> Any:
    """The errorMessage of a Lambda error JSON (decoded again when it is JSON itself), else the cause."""
    message: Any = cause
    with contextlib.suppress(TypeError, ValueError):
        decoded = json.loads(cause)
        message = decoded.get("errorMessage", cause) if isinstance(decoded, dict) else decoded
    if isinstance(message, str):
        with contextlib.suppress(ValueError):
            decoded_message = json.loads(message)
            if isinstance(decoded_message, list | dict):
                message = decoded_message
    return message


def _problem_line(item: Any) -> str:
    if isinstance(item, dict) and ("field" in item or "message" in item):
        return f"  - {item.get('field', '?')}: {item.get('message', '')}"
    return f"  - {item}"


def readable_cause(cause: str, limit: int = CAUSE_LIMIT) -> str:
    """The cause as the problem, the field and the fix; the stack trace never."""
    message = _report(cause)
    if isinstance(message, list):
        text = "\n".join(_problem_line(item) for item in message)
    elif isinstance(message, dict):  # a JSON object that is not a Lambda error: its fields, a line each
        text = "\n".join(f"  - {key}: {value}" for key, value in message.items() if key != "stackTrace")
    else:
        text = str(message)
    return text if len(text) <= limit else text[:limit] + " …"


def is_reworded(cause: str) -> bool:
    """Whether readable_cause shows less than the raw cause (then say where the raw one is)."""
    return readable_cause(cause, limit=len(cause) + 1) != cause


def raw_cause_command(execution_arn: str) -> str:
    """The command that prints the execution's raw cause (stack trace included)."""
    return (
        f"aws stepfunctions describe-execution --execution-arn {shlex.quote(execution_arn)} --query cause --output text"
    )
