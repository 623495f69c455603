"""Runs whose end event was lost: the reconciler hands their end to the notify function again.

"Step Functions Execution Status Change" reaches EventBridge best effort (Step Functions
developer guide, "Automating Step Functions event delivery with EventBridge": "Step Functions
sends events to EventBridge on a best-effort basis"). Without its end event a run gets no
notification and no cleanup: its jobs run to MaxRuntime, a deployment is never rolled back. Every
run that waits on a task has a claim in the token table, and a run that ended normally has none
left (job_events deletes a claim when it answers the task, notify's cleanup deletes the rest). So
an execution that has ended while claims of it remain, well after it ended, lost its end event (or
its notify failed past Lambda's retries). A run can also end holding no claim at all, and then
the claims say nothing: a success (the endpoint settled, its claim answered), a quality-gate
failure at Register model (which waits on no task). So the pipeline's executions that ended within
the last END_LOOKBACK_SECONDS (after the grace) are handed over too (recently_ended: one
ListExecutions listing, a page per 1,000 executions; it is sorted by start, not by end, so every
page is read). One DescribeExecution per such run, not per claim; the event is rebuilt from
DescribeExecution as EventBridge would have carried it and sent to notify asynchronously. Notify
is idempotent on (execution, status, redrive count) for two days: a run whose real event came is
handed over again by the passes of its look-back, and those do nothing."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError

from sdflow_common import rollback, sagemaker_jobs
from sdflow_common.token_store import TokenRecord

logger = Logger(child=True)

DETAIL_TYPE = "Step Functions Execution Status Change"
# The real event and notify's own two retries (one, then two minutes apart) come first.
END_GRACE_SECONDS = 300
# How far back a pass looks for runs that ended without claims: three of the reconciler's
# 10-minute periods, so two failed passes in a row still leave one that sees the run.
END_LOOKBACK_SECONDS = 1800
END_STATUSES = frozenset({"SUCCEEDED", "FAILED", "TIMED_OUT", "ABORTED"})
# ListExecutions' largest page (API reference, maxResults: 1-1000).
LIST_PAGE = 1000


def _millis(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return int(value.timestamp() * 1000)
    return int(value)


def status_change_event(described: dict[str, Any]) -> dict[str, Any]:
    """The EventBridge event of an execution's current status, from its DescribeExecution."""
    arn = described["executionArn"]
    region, account = arn.split(":")[3:5]
    stop = _millis(described.get("stopDate"))
    detail = {
        "executionArn": arn,
        "stateMachineArn": described["stateMachineArn"],
        "name": described["name"],
        "status": described["status"],
        "startDate": _millis(described["startDate"]),
        "stopDate": stop,
        "input": described.get("input"),
        "output": described.get("output"),
        "inputDetails": described.get("inputDetails"),
        "outputDetails": described.get("outputDetails"),
        "error": described.get("error"),
        "cause": described.get("cause"),
        "redriveCount": int(described.get("redriveCount") or 0),
        "redriveStatus": described.get("redriveStatus"),
    }
    moment = datetime.fromtimestamp((stop or 0) / 1000, tz=UTC)
    return {
        "version": "0",
        "id": str(uuid.uuid4()),
        "detail-type": DETAIL_TYPE,
        "source": "aws.states",
        "account": account,
        "time": moment.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "region": region,
        "resources": [arn],
        "detail": detail,
    }


def runs_with_claims(records: Iterable[TokenRecord]) -> list[str]:
    """The executions that still hold claims, less claims kept only for a deferred rollback (their
    run's end was handled: job_events finishes the rollback when the endpoint settles)."""
    return sorted({r.execution_arn for r in records if not rollback.is_requested(r)})


def recently_ended(sfn: Any, state_machine_arn: str, *, now: float) -> list[str]:
    """The executions of `state_machine_arn` that ended between END_GRACE_SECONDS and
    END_GRACE_SECONDS + END_LOOKBACK_SECONDS ago (ListExecutions: "Results are sorted by time,
    with the most recent execution first", by start; an execution's item carries its stopDate)."""
    found, token = [], None
    window = (now - END_GRACE_SECONDS - END_LOOKBACK_SECONDS, now - END_GRACE_SECONDS)
    while True:
        try:
            page = sfn.list_executions(
                stateMachineArn=state_machine_arn, maxResults=LIST_PAGE, **({"nextToken": token} if token else {})
            )
        except ClientError as exc:
            if sagemaker_jobs.error_code(exc) != "StateMachineDoesNotExist":
                raise
            # As for claims of an unknown execution (close_lost_ends): no machine, no runs to close.
            logger.warning("the pipeline's state machine does not exist", extra={"state_machine": state_machine_arn})
            return []
        for item in page.get("executions", []):
            stop = _millis(item.get("stopDate"))
            if item.get("status") in END_STATUSES and stop is not None and window[0] <= stop / 1000 < window[1]:
                found.append(str(item["executionArn"]))
        token = page.get("nextToken")
        if not token:
            return found


def close_lost_ends(
    executions: Iterable[str], *, sfn: Any, lambda_client: Any, notify_function: str, now: float
) -> list[str]:
    """Send notify the end of every execution in `executions` that ended more than
    END_GRACE_SECONDS ago; returns the ARNs handed over."""
    closed = []
    for arn in executions:
        try:
            described = sfn.describe_execution(executionArn=arn)
        except ClientError as exc:
            if sagemaker_jobs.error_code(exc) != "ExecutionDoesNotExist":
                raise
            logger.warning("claims of an execution Step Functions does not know", extra={"execution_arn": arn})
            continue
        stop = _millis(described.get("stopDate"))
        if described["status"] in ("RUNNING", "PENDING_REDRIVE") or stop is None:
            continue
        if now - stop / 1000 < END_GRACE_SECONDS:
            continue
        event = status_change_event(described)
        lambda_client.invoke(FunctionName=notify_function, InvocationType="Event", Payload=json.dumps(event))
        logger.warning(
            "run ended without its end being handled; notify invoked",
            extra={"execution_arn": arn, "status": described["status"]},
        )
        closed.append(arn)
    return closed
