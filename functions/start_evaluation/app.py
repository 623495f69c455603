"""start_evaluation: the "Evaluate model" task; starts the evaluation processing job.

Invoked with `lambda:invoke.waitForTaskToken`; the task's result (`{"job_name", "evaluation_uri"}`)
comes later from job_events."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from sdflow_common.evaluation import EvaluationTask, start_evaluation
from sdflow_common.job_starters import start_outcome
from sdflow_common.settings import Settings

logger = Logger()
tracer = Tracer()
metrics = Metrics()


@logger.inject_lambda_context(correlation_id_path="execution_arn")
@tracer.capture_lambda_handler
@metrics.log_metrics
@event_parser(model=EvaluationTask)
def lambda_handler(event: EvaluationTask, context: LambdaContext) -> dict[str, Any]:
    result = start_evaluation(event, Settings.from_env())
    metrics.add_dimension(name="Outcome", value=start_outcome(result))
    metrics.add_metric(name="EvaluationJobsStarted", unit=MetricUnit.Count, value=1)
    return result
