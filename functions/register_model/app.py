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
# evaluation.json's metric names as CloudWatch metric names (PromptAdherence as before).
METRIC_NAMES = {"prompt_adherence": "PromptAdherence", "clip_score": "ClipScore", "kid": "KID", "fid": "FID"}


@logger.inject_lambda_context(correlation_id_path="execution_arn")
@tracer.capture_lambda_handler
@metrics.log_metrics
@event_parser(model=RegisterTask)
def lambda_handler(event: RegisterTask, context: LambdaContext) -> dict[str, Any]:
    result = register_model(event, Settings.from_env())
    metrics.add_dimension(name="ApprovalStatus", value=result["approval_status"])
    for name, scores in result["metrics"].items():
        if name in METRIC_NAMES:  # the trained model's score, one CloudWatch metric per evaluation metric
            metrics.add_metric(name=METRIC_NAMES[name], unit=MetricUnit.NoUnit, value=float(scores["trained"]))
    return result
