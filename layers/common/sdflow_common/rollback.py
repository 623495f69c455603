"""Undo the endpoint deployment of a run that ended without succeeding.

A deploy claim (token_store, kind "endpoint") records what the run did to the endpoint:
`action` = create (the run created the endpoint) or update (a blue/green UpdateEndpoint from
`previous_endpoint_config`), and `endpoint_config_name` = the config the run rolled out. When
the run FAILED / TIMED_OUT / ABORTED, that change is undone: an endpoint the run created is
deleted; an endpoint the run updated goes back to its previous config. An endpoint that is
still changing cannot be touched yet — SageMaker refuses UpdateEndpoint on an endpoint that is
not InService or Failed ("Cannot update in-progress endpoint") and a Creating endpoint cannot
be deleted until it leaves Creating — so the claim is marked `rollback=requested` and
job_events rolls it back when the endpoint's state-change event says it settled."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any, Literal

from botocore.exceptions import ClientError

from sdflow_common import sagemaker_jobs
from sdflow_common.token_store import TokenRecord

ROLLBACK_KEY = "rollback"
ROLLBACK_REQUESTED = "requested"
PREVIOUS_CONFIG_KEY = "previous_endpoint_config"
# Statuses during which SageMaker accepts neither DeleteEndpoint nor UpdateEndpoint for this
# purpose: wait for the endpoint's next state-change event.
BUSY_STATUSES = frozenset({"Creating", "Updating", "SystemUpdating", "RollingBack"})
# Run-ending statuses of a Step Functions execution (DescribeExecution `status`).
UNSUCCESSFUL_EXECUTION_STATUSES = frozenset({"FAILED", "TIMED_OUT", "ABORTED"})

Outcome = Literal["deleted", "restored", "deferred", "untouched", "manual"]


@dataclass(frozen=True)
class Rollback:
    """What was done to one endpoint; `text` is the line the notification prints."""

    endpoint: str
    outcome: Outcome
    text: str

    @property
    def keeps_claim(self) -> bool:
        # A deferred rollback needs the claim: job_events finds the request there.
        return self.outcome == "deferred"


def is_requested(record: TokenRecord) -> bool:
    return record.context.get(ROLLBACK_KEY) == ROLLBACK_REQUESTED


def _describe(sagemaker: Any, endpoint: str) -> dict[str, Any] | None:
    try:
        return dict(sagemaker.describe_endpoint(EndpointName=endpoint))
    except ClientError as exc:
        if sagemaker_jobs.is_not_found(exc):
            return None
        raise


def _is_ours(described: dict[str, Any], config_name: str) -> bool:
    pending = described.get("PendingDeploymentSummary") or {}
    return bool(config_name) and config_name in (described.get("EndpointConfigName"), pending.get("EndpointConfigName"))


def roll_back(record: TokenRecord, sagemaker: Any, described: dict[str, Any] | None = None) -> Rollback:
    """Undo the claim's deployment if the endpoint still carries it. Idempotent: a second call
    finds the endpoint deleted or back on its previous config and reports `untouched`."""
    endpoint = record.resource_name
    ours = record.context.get("endpoint_config_name", "")
    action = record.context.get("action", "")
    if not action:
        # The deployer claimed the endpoint but never called CreateEndpoint/UpdateEndpoint.
        return Rollback(endpoint, "untouched", f"endpoint {endpoint}: the run had not started deploying to it")
    described = described if described is not None else _describe(sagemaker, endpoint)
    if described is None:
        return Rollback(endpoint, "untouched", f"endpoint {endpoint} does not exist (nothing to roll back)")
    status = str(described.get("EndpointStatus", ""))
    if status == "Deleting":
        return Rollback(endpoint, "deleted", f"endpoint {endpoint} is being deleted")
    if not _is_ours(described, ours):
        serving = described.get("EndpointConfigName") or "another config"
        return Rollback(endpoint, "untouched", f"endpoint {endpoint} serves {serving}, not this run's {ours}")
    if status in BUSY_STATUSES:
        then = "deleted" if action == "create" else "rolled back"
        return Rollback(endpoint, "deferred", f"endpoint {endpoint} is {status}; it will be {then} when it settles")
    if action == "create":
        return _delete(sagemaker, endpoint)
    return _restore(sagemaker, record, described, status)


def _delete(sagemaker: Any, endpoint: str) -> Rollback:
    try:
        sagemaker.delete_endpoint(EndpointName=endpoint)
    except ClientError as exc:
        if not sagemaker_jobs.is_not_found(exc):
            raise
    return Rollback(endpoint, "deleted", f"endpoint {endpoint} deleted (this run had created it)")


def _restore(sagemaker: Any, record: TokenRecord, described: dict[str, Any], status: str) -> Rollback:
    endpoint = record.resource_name
    previous = record.context.get(PREVIOUS_CONFIG_KEY, "")
    if described.get("EndpointConfigName") != record.context.get("endpoint_config_name"):
        # Settled on another config: SageMaker already rolled the update back itself.
        return Rollback(endpoint, "untouched", f"endpoint {endpoint} is back on {described.get('EndpointConfigName')}")
    if not previous:
        return Rollback(
            endpoint,
            "manual",
            f"endpoint {endpoint} serves this run's config {record.context.get('endpoint_config_name')} and its "
            "previous config is unknown; roll it back by hand: aws sagemaker update-endpoint "
            f"--endpoint-name {endpoint} --endpoint-config-name <previous config>",
        )
    if status not in ("InService", "Failed"):
        return Rollback(
            endpoint,
            "manual",
            f"endpoint {endpoint} is {status}; SageMaker cannot update it. Fix or delete it by hand, then "
            f"aws sagemaker update-endpoint --endpoint-name {shlex.quote(endpoint)} "
            f"--endpoint-config-name {shlex.quote(previous)}",
        )
    sagemaker.update_endpoint(EndpointName=endpoint, EndpointConfigName=previous)
    return Rollback(endpoint, "restored", f"endpoint {endpoint} rolled back to config {previous}")


def execution_ended_unsuccessfully(sfn: Any, execution_arn: str) -> bool:
    """True when the execution that owns a claim FAILED, TIMED_OUT or ABORTED (or is gone).

    A stale token alone does not say so: a duplicate event of a deployment that succeeded also
    meets an answered token, and that deployment must stay."""
    try:
        status = sfn.describe_execution(executionArn=execution_arn)["status"]
    except ClientError as exc:
        if sagemaker_jobs.error_code(exc) == "ExecutionDoesNotExist":
            return True
        raise
    return status in UNSUCCESSFUL_EXECUTION_STATUSES
