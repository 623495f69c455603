"""register_model: the "Register model" task; registers the trained model as a model package
with its metrics and lineage, and applies the quality gate (QualityGateFailed fails the run)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from sdflow_common.model_registry import RegisterTask, register_model
from sdflow_common.settings import Settings

logger = Logger()
tracer = Tracer()
metrics = Metrics()


@logger.inject_lambda_context(correlation_id_path="execution_arn")
@tracer.capture_lambda_handler
@metrics.log_metrics
@event_parser(model=RegisterTask)
def lambda_handler(event: RegisterTask, context: LambdaContext) -> dict[str, Any]:
    result = register_model(event, Settings.from_env())
    metrics.add_dimension(name="ApprovalStatus", value=result["approval_status"])
    metrics.add_metric(name="PromptAdherence", unit=MetricUnit.NoUnit, value=result["prompt_adherence"])
    return result
