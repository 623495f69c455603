"""find_duplicates: the "Find duplicates" task; starts the run's dedup processing job.

Invoked with `lambda:invoke.waitForTaskToken`; the task's result (`{"job_name", "summary_uri"}`, $.dedup)
comes later from job_events."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from sdflow_common.dedup_job import DedupTask, start_dedup
from sdflow_common.job_starters import start_outcome
from sdflow_common.settings import Settings

logger = Logger()
tracer = Tracer()
metrics = Metrics()


@logger.inject_lambda_context(correlation_id_path="execution_arn")
@tracer.capture_lambda_handler
@metrics.log_metrics
@event_parser(model=DedupTask)
def lambda_handler(event: DedupTask, context: LambdaContext) -> dict[str, Any]:
    result = start_dedup(event, Settings.from_env())
    metrics.add_dimension(name="Outcome", value=start_outcome(result))
    metrics.add_metric(name="DedupJobsStarted", unit=MetricUnit.Count, value=1)
    return result
