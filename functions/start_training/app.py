"""start_training: the "Train model" task; starts the run's SageMaker training job.

Invoked with `lambda:invoke.waitForTaskToken`; the task's result comes later from job_events."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from sdflow_common.job_starters import TrainingTask, start_training
from sdflow_common.settings import Settings

logger = Logger()
tracer = Tracer()
metrics = Metrics()


@logger.inject_lambda_context(correlation_id_path="execution_arn")
@tracer.capture_lambda_handler
@metrics.log_metrics
@event_parser(model=TrainingTask)
def lambda_handler(event: TrainingTask, context: LambdaContext) -> dict[str, Any]:
    result = start_training(event, Settings.from_env())
    # A re-invoked Lambda (same attempt) finds its job and starts nothing; a retried one may
    # adopt the job an earlier attempt left running.
    if result.get("adopted"):
        name = "TrainingJobsAdopted"
    else:
        name = "TrainingJobsStarted" if result["created"] else "TrainingJobsReinvoked"
    metrics.add_metric(name=name, unit=MetricUnit.Count, value=1)
    return result
