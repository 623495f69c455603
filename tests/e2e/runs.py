"""Runs on a no-op local cloud for the fault tests: start one, wait for its end, find its jobs,
its notification and its functions' logs, tell what it left running, and record how long each
fault took to recover from (the closing notes' tables come from RecoveryTable's print)."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

from sdflow.local.cloud import LocalCloud
from sdflow.local.sagemaker.noop import NoOpSageMaker
from sdflow_common import names
from sdflow_common.run_document import parse_s3_uri
from tests.helpers import wait_for


class RecoveryTable:
    """One line per fault: what it was, what the run did, how long recovery took, what was left."""

    def __init__(self) -> None:
        self.lines: dict[str, str] = {}

    def record(self, fault: str, outcome: str, started: float, leftovers: list[str]) -> None:
        self.lines[fault] = f"{fault} | {outcome} | {time.monotonic() - started:.1f} s | {len(leftovers)}"

    def print(self) -> None:
        if self.lines:
            print("\nfault | outcome | time to recover | leftovers")
            for line in self.lines.values():
                print(line)


def run_document(cloud: LocalCloud, **download: Any) -> dict[str, Any]:
    return {
        "dataset": {"prefix": f"s3://{cloud.bucket}/datasets/faults/"},
        "base_model_uri": f"s3://{cloud.bucket}/models/tiny/",
        "download": {"max_concurrency": 3, **download},
        "training": {"instance_type": "ml.m5.xlarge"},
        "endpoint": {"name": "sdflow-faults", "instance_type": "ml.m5.large"},
    }


def start_run(cloud: LocalCloud, name: str, document: Any | None = None) -> str:
    return str(
        cloud.client("stepfunctions").start_execution(
            stateMachineArn=cloud.state_machine_arn, name=name, input=json.dumps(document or run_document(cloud))
        )["executionArn"]
    )


def ended(cloud: LocalCloud, arn: str, timeout_s: float = 180.0) -> dict[str, Any]:
    sfn = cloud.client("stepfunctions")

    def done() -> dict[str, Any] | None:
        described = sfn.describe_execution(executionArn=arn)
        return described if described["status"] != "RUNNING" else None

    return dict(wait_for(done, timeout_s=timeout_s, what=f"execution {arn} to end", interval_s=0.2))


def run_hash_of(cloud: LocalCloud, arn: str) -> str:
    described = cloud.client("stepfunctions").describe_execution(executionArn=arn)
    return names.run_hash(arn, described["startDate"])


def jobs_named(cloud: LocalCloud, kind: str, contains: str, status: str | None = None) -> list[str]:
    sagemaker = cloud.client("sagemaker")
    call = sagemaker.list_processing_jobs if kind == "processing" else sagemaker.list_training_jobs
    key = "ProcessingJobSummaries" if kind == "processing" else "TrainingJobSummaries"
    name_key = "ProcessingJobName" if kind == "processing" else "TrainingJobName"
    found: list[str] = []
    kwargs: dict[str, Any] = {"NameContains": contains, "MaxResults": 100}
    if status:
        kwargs["StatusEquals"] = status
    while True:
        page = call(**kwargs)
        found.extend(job[name_key] for job in page[key])
        if not page.get("NextToken"):
            return found
        kwargs["NextToken"] = page["NextToken"]


def download_jobs(cloud: LocalCloud, contains: str) -> list[str]:
    """The run's download jobs (its processing jobs less the evaluation job, `sdf-ev-…`)."""
    return [name for name in jobs_named(cloud, "processing", contains) if name.startswith(names.DOWNLOAD_PREFIX + "-")]


def wait_for_job(
    cloud: LocalCloud, kind: str, contains: str, timeout_s: float = 60.0, status: str | None = "InProgress"
) -> str:
    def running() -> str | None:
        jobs = jobs_named(cloud, kind, contains, status)
        return jobs[0] if jobs else None

    return str(wait_for(running, timeout_s=timeout_s, what=f"a {kind} job named *{contains}*", interval_s=0.1))


STARTERS = {
    "sdf-dl-": "StartDownloadFunction",
    "sdf-tr-": "StartTrainingFunction",
    "sdf-ev-": "StartEvaluationFunction",
}


def wait_for_started_job(cloud: LocalCloud, kind: str, contains: str, timeout_s: float = 60.0) -> str:
    """A job InProgress whose starter has returned: its check that the run still runs is done.
    A test that stops the run as soon as the job exists races that check, and the starter then
    stops the job itself (RunEnded) before the run's cleanup can."""
    job = wait_for_job(cloud, kind, contains, timeout_s=timeout_s)
    function = STARTERS[job[: len("sdf-xx-")]]

    def started() -> bool:
        lines = (json.loads(line) for line in function_log_lines(cloud, function) if line.startswith("{"))
        return any(line.get("message") == "job started" and line.get("resource_name") == job for line in lines)

    wait_for(started, timeout_s=timeout_s, what=f"{function}'s 'job started' for {job}", interval_s=0.2)
    return job


def started_job_from_log(cloud: LocalCloud, prefix: str, contains: str, timeout_s: float = 60.0) -> str:
    """The name of a job whose starter logged "job started", found from the starter's log alone:
    a test that counts the pipeline's SageMaker List* calls must make none itself."""
    function = STARTERS[prefix]

    def started() -> str | None:
        lines = (json.loads(line) for line in function_log_lines(cloud, function) if line.startswith("{"))
        return next(
            (
                str(line["resource_name"])
                for line in lines
                if line.get("message") == "job started" and contains in str(line.get("resource_name", ""))
            ),
            None,
        )

    return str(
        wait_for(started, timeout_s=timeout_s, what=f"{function}'s 'job started' for *{contains}*", interval_s=0.2)
    )


def leftovers_of(cloud: LocalCloud, sagemaker: NoOpSageMaker) -> list[str]:
    """Whatever still runs or bills: jobs InProgress or Stopping, endpoints changing, held no-op jobs."""
    left = [
        f"{kind} job {name} {status}"
        for kind in ("processing", "training")
        for status in ("InProgress", "Stopping")
        for name in jobs_named(cloud, kind, "sdf-", status)
    ]
    endpoints = cloud.client("sagemaker").list_endpoints()["Endpoints"]
    left += [
        f"endpoint {e['EndpointName']} {e['EndpointStatus']}"
        for e in endpoints
        if e["EndpointStatus"] in ("Creating", "Updating", "RollingBack", "SystemUpdating")
    ]
    if sagemaker.running:
        left.append(f"{sagemaker.running} no-op job(s) held")
    return left


def settled(cloud: LocalCloud, sagemaker: NoOpSageMaker, timeout_s: float = 45.0) -> list[str]:
    """Leftovers once the run's end has been handled (the notify function runs on its status event)."""
    with contextlib.suppress(AssertionError):  # the caller asserts on what is left
        wait_for(lambda: not leftovers_of(cloud, sagemaker), timeout_s=timeout_s, what="nothing left", interval_s=0.5)
    cloud.wait_idle(30.0)
    return leftovers_of(cloud, sagemaker)


def notification(cloud: LocalCloud, execution_name: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """The run's notification as the local SNS records it: subject, message, attributes."""

    def find() -> dict[str, Any] | None:
        mine = [m for m in cloud.sns_messages() if m["attributes"].get("run_id") == execution_name]
        return mine[-1] if mine else None

    return dict(wait_for(find, timeout_s=timeout_s, what=f"the notification of {execution_name}", interval_s=0.2))


def function_log_lines(cloud: LocalCloud, function: str) -> list[str]:
    """A function's log lines in CloudWatch Logs (they arrive in batches: callers wait for theirs)."""
    logs = cloud.client("logs")
    groups = logs.describe_log_groups(logGroupNamePrefix="/aws/lambda/")["logGroups"]
    group = next(g["logGroupName"] for g in groups if function in g["logGroupName"])
    pages = logs.get_paginator("filter_log_events").paginate(logGroupName=group)
    return [e["message"] for page in pages for e in page["events"]]


def s3_object(cloud: LocalCloud, uri: str) -> bytes:
    """The bytes of an object of the local cloud's S3, by its s3:// URI."""
    bucket, key = parse_s3_uri(uri)
    return bytes(cloud.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read())
