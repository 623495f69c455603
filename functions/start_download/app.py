"""start_download: the "Download shard" task; starts one SageMaker processing job per shard.

Invoked with `lambda:invoke.waitForTaskToken`; the task's result comes later from job_events."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from sdflow_common.job_starters import DownloadTask, start_download
from sdflow_common.settings import Settings

logger = Logger()
tracer = Tracer()
metrics = Metrics()


@logger.inject_lambda_context(correlation_id_path="execution_arn")
@tracer.capture_lambda_handler
@metrics.log_metrics
@event_parser(model=DownloadTask)
def lambda_handler(event: DownloadTask, context: LambdaContext) -> dict[str, Any]:
    result = start_download(event, Settings.from_env())
    # A re-invoked Lambda (same attempt) finds its job and starts nothing; a retried one may
    # adopt the job an earlier attempt left running.
    if result.get("adopted"):
        name = "DownloadJobsAdopted"
    else:
        name = "DownloadJobsStarted" if result["created"] else "DownloadJobsReinvoked"
    metrics.add_metric(name=name, unit=MetricUnit.Count, value=1)
    return result
