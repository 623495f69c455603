"""The account's SageMaker instance quotas, read from Service Quotas while the run is validated.

A quota (ResourceLimitExceeded) is not a rate limit: it frees only when the jobs holding it end.
So before any job starts, the download concurrency is capped at what the quota lets run at
once, and a dedup job, training job or endpoint larger than its quota is refused with the field to change,
instead of failing after hours of downloads.

SageMaker names each instance quota "<instance type> for <use> usage" (processing job, training
job, spot training job, endpoint) under service code `sagemaker`; ResourceLimitExceeded quotes
the same name. ListServiceQuotas returns applied values and may leave out quotas still at their
default, which ListAWSDefaultServiceQuotas then supplies. Neither action can be scoped to a
resource (Service Authorization Reference, Service Quotas), so template.yaml grants them on "*".

The lookup is advice: when it is denied or fails, the run proceeds uncapped (with a warning) and
the state machine's SageMakerQuotaExceeded retry waits for instances instead."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from aws_lambda_powertools import Logger
from botocore.exceptions import BotoCoreError, ClientError

from sdflow_common import aws
from sdflow_common.dedup_options import DEDUP_INSTANCE_COUNT
from sdflow_common.errors import InvalidRunDocument
from sdflow_common.run_document import RunDocument
from sdflow_common.sagemaker_jobs import DOWNLOAD_INSTANCE_COUNT

logger = Logger(child=True)

SERVICE_CODE = "sagemaker"
QUOTA_LISTINGS = ("list_service_quotas", "list_aws_default_service_quotas")
QUOTA_CHECK_KEY = "quota_check"
INCREASE_ADVICE = "request an increase in the Service Quotas console (service Amazon SageMaker)"


def quota_name(instance_type: str, use: str) -> str:
    return f"{instance_type} for {use} usage"


def lookup(names: Iterable[str], client: Any = None) -> dict[str, int]:
    """The applied (else default) value of each named SageMaker quota that Service Quotas lists."""
    wanted = set(names)
    client = client or aws.client("service-quotas")
    found: dict[str, int] = {}
    for operation in QUOTA_LISTINGS:
        for page in client.get_paginator(operation).paginate(ServiceCode=SERVICE_CODE):
            for quota in page.get("Quotas", []):
                name = quota.get("QuotaName")
                if name in wanted and name not in found and "Value" in quota:
                    found[name] = int(quota["Value"])
            if wanted <= found.keys():
                return found  # SageMaker has well over a thousand quotas: stop paging early
    return found


def _needs(document: RunDocument) -> dict[str, tuple[str, int, str]]:
    """field → (quota name, instances one job or endpoint needs, what that field sets)."""
    training = document.training
    training_use = "spot training job" if training.use_spot else "training job"
    needs = {
        "download.instance_type": (
            quota_name(document.download.instance_type, "processing job"),
            DOWNLOAD_INSTANCE_COUNT,
            "download job",
        ),
        "training.instance_count": (
            quota_name(training.instance_type, training_use),
            training.instance_count,
            "training job",
        ),
        "endpoint.initial_instance_count": (
            quota_name(document.endpoint.instance_type, "endpoint"),
            document.endpoint.initial_instance_count,
            "endpoint",
        ),
    }
    if document.deduplication.enabled:
        # After the downloads, so it never shares the processing quota with them: one instance is all it needs.
        dedup_quota = quota_name(document.deduplication.instance_type, "processing job")
        needs["deduplication.instance_type"] = (dedup_quota, DEDUP_INSTANCE_COUNT, "dedup job")
    return needs


def _too_small(needs: dict[str, tuple[str, int, str]], limits: dict[str, int]) -> list[dict[str, str]]:
    problems = []
    for field, (name, instances, what) in needs.items():
        if name in limits and limits[name] < instances:
            problems.append(
                {
                    "field": field,
                    "message": f"one {what} needs {instances} instance(s) but this account's quota "
                    f"'{name}' is {limits[name]}; {INCREASE_ADVICE}, or choose a smaller count or "
                    "an instance type with enough quota",
                }
            )
    return problems


def apply_instance_quotas(config: dict[str, Any], client: Any = None) -> dict[str, Any]:
    """`$.config` with `run.download.max_concurrency` capped at the processing quota, and what
    was checked under `quota_check` (for the logs and the notification).

    Raises InvalidRunDocument when a job or the endpoint needs more instances than its quota."""
    document = RunDocument.model_validate(config["run"])
    needs = _needs(document)
    try:
        limits = lookup((name for name, _count, _what in needs.values()), client)
    except (ClientError, BotoCoreError) as exc:
        # Denied (no servicequotas permission) or unavailable: the Retry on SageMakerQuotaExceeded
        # still makes the run wait for instances, so this is worth a warning, not a failure.
        logger.warning("instance quotas not checked; max_concurrency left uncapped", extra={"error": str(exc)})
        return {**config, QUOTA_CHECK_KEY: {"status": "skipped", "reason": str(exc)[:300]}}
    problems = _too_small(needs, limits)
    if problems:
        raise InvalidRunDocument(json.dumps(problems))
    check: dict[str, Any] = {"status": "checked", "limits": limits}
    unlisted = sorted({name for name, _count, _what in needs.values()} - limits.keys())
    if unlisted:
        logger.warning("Service Quotas lists no such SageMaker quota; not checked", extra={"quotas": unlisted})
        check["unlisted"] = unlisted
    download_quota, per_job, _what = needs["download.instance_type"]
    requested = document.download.max_concurrency
    if download_quota in limits and requested > limits[download_quota] // per_job:
        applied = limits[download_quota] // per_job
        check["download_max_concurrency"] = {"requested": requested, "applied": applied, "quota": download_quota}
        logger.warning(
            "download.max_concurrency capped at the processing-instance quota",
            extra={"requested": requested, "applied": applied, "quota_name": download_quota},
        )
        run = config["run"]
        config = {**config, "run": {**run, "download": {**run["download"], "max_concurrency": applied}}}
    return {**config, QUOTA_CHECK_KEY: check}
