"""What the notification and `sdflow status` tell a person to run or read: commands that paste into a
shell as they are, an invoke line for either AWS CLI, shard counts that agree, causes as sentences."""

from __future__ import annotations

import json
import shlex
from datetime import UTC, datetime
from typing import Any

from sdflow import progress
from sdflow_common import causes, notify
from tests.constants import ACCOUNT, REGION

# Step Functions allows ' ( ) ! in execution names; a shell does not read them as text.
ODD_NAME = "cats'(v1)!"
ODD_ARN = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:sdflow-pipeline-test:{ODD_NAME}"
NOW = datetime(2026, 11, 23, tzinfo=UTC)
CONFIG = {"run_id": "cats-v1-abc", "run": {"run_name": "cats-v1"}}
ENDPOINT = {"endpoint_name": "cats", "endpoint_config_name": "cats-c", "action": "create"}
FIELD_ERRORS = [
    {"field": "dataset.url_column", "message": "column 'url' is not in part-00000.parquet; use one of: URL, TEXT"},
    {"field": "training.instance_count", "message": "Input should be greater than or equal to 1"},
]
# A Lambda function's error as Step Functions passes it on: the report escaped inside errorMessage.
LAMBDA_CAUSE = json.dumps(
    {
        "errorMessage": json.dumps(FIELD_ERRORS),
        "errorType": "InvalidRunDocument",
        "requestId": "0f6b2b1e-4d3c-4b5a-9c8d-7e6f5a4b3c2d",
        "stackTrace": ['  File "/var/task/app.py", line 31, in lambda_handler\n    raise invalid(problems)\n'],
    }
)


def _message(outcome: notify.Outcome, state: dict[str, Any], arn: str = ODD_ARN, **fields: Any) -> str:
    request = notify.NotifyRequest(
        outcome=outcome,
        execution_arn=arn,
        execution_name=arn.rsplit(":", 1)[-1],
        start_time="2026-11-22T10:00:00.000Z",
        stop_time="2026-11-22T10:30:00.000Z",
        state=state,
        **fields,
    )
    return notify.compose(request, now=NOW).message


def _command_lines(text: str, command: str) -> list[list[str]]:
    """Each line of `text` holding `command`, split as a POSIX shell splits it."""
    return [shlex.split(line.strip()) for line in text.splitlines() if line.strip().startswith(command)]


def test_notify_next_commands_quote_an_execution_name_a_shell_would_read() -> None:
    text = _message("failed", {"config": CONFIG}, error="TrainingJobFailed", cause="AlgorithmError: OOM")

    [redrive] = _command_lines(text, "aws stepfunctions redrive-execution")
    [resume] = _command_lines(text, "sdflow resume")

    assert redrive[-2:] == ["--execution-arn", ODD_ARN]
    assert resume[:3] == ["sdflow", "resume", ODD_ARN]


def test_notify_invoke_lines_work_with_aws_cli_v1_and_v2() -> None:
    text = _message("succeeded", {"config": CONFIG, "endpoint": ENDPOINT})

    [invoke] = _command_lines(text, "aws sagemaker-runtime invoke-endpoint")

    # --cli-binary-format is AWS CLI v2 only (v1 refuses it); fileb:// is raw bytes in both.
    assert not any(arg.startswith("--cli-binary-format") for arg in invoke)
    assert invoke[invoke.index("--body") + 1] == "fileb://body.json"
    assert 'echo \'{"prompt": "a photo of a cat"}\' > body.json' in text
    assert "(v1 or v2)" in text
    assert "Invoke:    sdflow invoke cats 'a photo of a cat' -o out.png" in text


def test_notify_shard_without_images_is_not_counted_as_downloaded() -> None:
    dataset = {
        "index_uri": "s3://b/i.json",
        "total_samples": 300,
        "shards_ok": 4,
        "shards_empty": 1,
        "shards_failed": 0,
    }

    text = _message("succeeded", {"config": CONFIG, "dataset": dataset})

    # `sdflow status` reads the index, which lists the 3 shards that hold samples: 3/4.
    assert "Dataset:   3 of 4 shards downloaded, 300 samples; 1 held no image (every URL failed)" in text


def test_notify_lambda_error_cause_reads_as_fields_and_fixes_without_stack_trace() -> None:
    text = _message("failed", {}, running_state="Validate run", error="InvalidRunDocument", cause=LAMBDA_CAUSE)

    assert "  - dataset.url_column: column 'url' is not in part-00000.parquet; use one of: URL, TEXT" in text
    assert "  - training.instance_count: Input should be greater than or equal to 1" in text
    assert "stackTrace" not in text
    assert "app.py" not in text
    assert '\\"' not in text  # nothing escaped
    assert "requestId" not in text
    raw = causes.raw_cause_command(ODD_ARN)
    assert f"the raw cause (stack trace included): {raw}" in text
    assert shlex.split(raw)[-5:] == [ODD_ARN, "--query", "cause", "--output", "text"]


def test_notify_plain_cause_is_shown_as_is_without_raw_cause_line() -> None:
    text = _message("failed", {"config": CONFIG}, error="TrainingJobFailed", cause="AlgorithmError: OOM")

    assert "AlgorithmError: OOM" in text
    assert "raw cause" not in text


def test_status_lambda_error_cause_reads_as_fields_and_says_where_the_raw_cause_is() -> None:
    snap = progress.Progress(execution_arn=ODD_ARN, status="FAILED", error="InvalidRunDocument", cause=LAMBDA_CAUSE)

    lines = progress.render_lines(snap)

    assert "  error: InvalidRunDocument" in lines
    assert "    - training.instance_count: Input should be greater than or equal to 1" in lines
    assert not any("stackTrace" in line or "app.py" in line or '\\"' in line for line in lines)
    assert lines[-1] == f"  raw cause: {causes.raw_cause_command(ODD_ARN)}"
