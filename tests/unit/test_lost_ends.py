"""A run whose end event was lost: the reconciler hands its end to notify, once, as EventBridge would have."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from sdflow_common import lost_ends, notify, rollback
from sdflow_common.token_store import TokenRecord
from tests.constants import ACCOUNT, REGION
from tests.unit.sagemaker_fake import client_error

PIPELINE = f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:sdflow-pipeline-test"
FAILED_RUN = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:sdflow-pipeline-test:cats-v1"
NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC).timestamp()


def _described(arn: str, status: str, stopped_ago_s: float | None, redrive_count: int = 0) -> dict[str, Any]:
    described: dict[str, Any] = {
        "executionArn": arn,
        "stateMachineArn": PIPELINE,
        "name": arn.rsplit(":", 1)[1],
        "status": status,
        "startDate": datetime.fromtimestamp(NOW - 7200, tz=UTC),
        "input": json.dumps({"run_name": "cats"}),
        "inputDetails": {"included": True},
        "redriveCount": redrive_count,
    }
    if stopped_ago_s is not None:
        described["stopDate"] = datetime.fromtimestamp(NOW - stopped_ago_s, tz=UTC)
    if status == "FAILED":
        described.update(error="TrainingJobFailed", cause="training job sdf-tr-cats ended Failed: OOM")
    return described


class FakeStepFunctions:
    def __init__(self, *executions: dict[str, Any], page_size: int = 100) -> None:
        self.executions = {e["executionArn"]: e for e in executions}
        self.described: list[str] = []
        self.page_size = page_size
        self.listed: list[dict[str, Any]] = []

    def list_executions(self, **params: Any) -> dict[str, Any]:
        """ListExecutions of one state machine: newest start first, `maxResults` a page, `nextToken`."""
        self.listed.append(params)
        items = sorted(self.executions.values(), key=lambda e: e["startDate"], reverse=True)
        start = int(params.get("nextToken") or 0)
        limit = min(params.get("maxResults") or 100, self.page_size)
        page = [
            {
                key: e[key]
                for key in (
                    "executionArn",
                    "stateMachineArn",
                    "name",
                    "status",
                    "startDate",
                    "stopDate",
                    "redriveCount",
                )
                if key in e
            }
            for e in items[start : start + limit]
        ]
        answer: dict[str, Any] = {"executions": page}
        if start + limit < len(items):
            answer["nextToken"] = str(start + limit)
        return answer

    def describe_execution(self, executionArn: str) -> dict[str, Any]:
        self.described.append(executionArn)
        if executionArn not in self.executions:
            message = f"Execution Does Not Exist: '{executionArn}'"
            raise client_error("ExecutionDoesNotExist", message, "DescribeExecution")
        return self.executions[executionArn]


class FakeLambda:
    def __init__(self) -> None:
        self.invoked: list[dict[str, Any]] = []

    def invoke(self, **params: Any) -> dict[str, Any]:
        self.invoked.append(params)
        return {"StatusCode": 202}


def _record(arn: str, name: str, context: dict[str, str] | None = None) -> TokenRecord:
    return TokenRecord(name, f"token-{name}", arn, "download", 0, 0, 0, context or {})


def _close(sfn: FakeStepFunctions, lambda_client: FakeLambda, *arns: str) -> list[str]:
    return lost_ends.close_lost_ends(
        arns, sfn=sfn, lambda_client=lambda_client, notify_function="sdflow-NotifyFunction", now=NOW
    )


def test_close_lost_ends_run_ended_past_the_grace_sends_notify_its_end_event() -> None:
    sfn, lambda_client = FakeStepFunctions(_described(FAILED_RUN, "FAILED", 600, redrive_count=2)), FakeLambda()

    closed = _close(sfn, lambda_client, FAILED_RUN)

    assert closed == [FAILED_RUN]
    [call] = lambda_client.invoked
    assert call["FunctionName"] == "sdflow-NotifyFunction"
    assert call["InvocationType"] == "Event", "asynchronous, as EventBridge invokes notify"
    event = notify.ExecutionStatusChange.model_validate(json.loads(call["Payload"]))
    assert event.detail.execution_arn == FAILED_RUN
    assert event.detail.outcome == "failed"
    assert event.detail.redrive_count == 2, "notify's idempotency key: a late real event does nothing twice"
    assert event.detail.error == "TrainingJobFailed"
    assert event.detail.stop_date == int((NOW - 600) * 1000)
    assert event.source == "aws.states"


@pytest.mark.parametrize(
    ("status", "stopped_ago_s"),
    [("RUNNING", None), ("PENDING_REDRIVE", None), ("FAILED", lost_ends.END_GRACE_SECONDS - 30)],
)
def test_close_lost_ends_run_running_or_just_ended_is_left_to_its_own_event(
    status: str, stopped_ago_s: float | None
) -> None:
    sfn, lambda_client = FakeStepFunctions(_described(FAILED_RUN, status, stopped_ago_s)), FakeLambda()

    assert _close(sfn, lambda_client, FAILED_RUN) == []
    assert lambda_client.invoked == []


def test_close_lost_ends_execution_unknown_is_skipped_and_the_others_closed() -> None:
    unknown = FAILED_RUN.replace("cats-v1", "gone")
    sfn, lambda_client = FakeStepFunctions(_described(FAILED_RUN, "ABORTED", 3600)), FakeLambda()

    assert _close(sfn, lambda_client, unknown, FAILED_RUN) == [FAILED_RUN]


def test_runs_with_claims_one_entry_per_run_and_no_deferred_rollback() -> None:
    other = FAILED_RUN.replace("cats-v1", "dogs-v1")
    deferred = {rollback.ROLLBACK_KEY: rollback.ROLLBACK_REQUESTED}
    records = [_record(FAILED_RUN, f"sdf-dl-{i}") for i in range(500)]
    records.append(_record(other, "sdflow-dogs", deferred))

    assert lost_ends.runs_with_claims(records) == [FAILED_RUN], "one DescribeExecution per run, not per claim"


def test_recently_ended_run_without_claims_is_found_from_the_executions_list() -> None:
    """Issue 32 item 3: a run that holds no claims when it ends (a success; a gate failure at
    Register model, which waits on nothing) and whose end event was lost is found by listing the
    pipeline's executions: those that ended within the look-back (after the grace) are handed to
    notify, which is idempotent per (execution, status, redrive count)."""
    succeeded = FAILED_RUN.replace("cats-v1", "cats-ok")
    gate = FAILED_RUN.replace("cats-v1", "cats-gate")
    old = FAILED_RUN.replace("cats-v1", "cats-old")
    recent = FAILED_RUN.replace("cats-v1", "cats-recent")
    sfn = FakeStepFunctions(
        _described(succeeded, "SUCCEEDED", 600),
        _described(gate, "FAILED", lost_ends.END_GRACE_SECONDS + lost_ends.END_LOOKBACK_SECONDS - 60),
        _described(old, "FAILED", lost_ends.END_GRACE_SECONDS + lost_ends.END_LOOKBACK_SECONDS + 60),
        _described(recent, "ABORTED", lost_ends.END_GRACE_SECONDS - 60),
        _described(FAILED_RUN, "RUNNING", None),
        page_size=2,
    )

    found = lost_ends.recently_ended(sfn, PIPELINE, now=NOW)

    assert sorted(found) == sorted([succeeded, gate])
    assert all(call["stateMachineArn"] == PIPELINE for call in sfn.listed)
    assert len(sfn.listed) == 3, "every page is read: the list is sorted by start, not by end"


def test_close_lost_ends_run_without_claims_whose_end_was_lost_gets_its_notice() -> None:
    succeeded = FAILED_RUN.replace("cats-v1", "cats-ok")
    sfn, lambda_client = FakeStepFunctions(_described(succeeded, "SUCCEEDED", 600)), FakeLambda()

    closed = _close(sfn, lambda_client, *lost_ends.recently_ended(sfn, PIPELINE, now=NOW))

    assert closed == [succeeded]
    [call] = lambda_client.invoked
    assert json.loads(call["Payload"])["detail"]["status"] == "SUCCEEDED"
