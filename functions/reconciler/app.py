"""reconciler: scheduled; resolves task tokens whose SageMaker event was lost, stops jobs that outlived their task."""

from __future__ import annotations

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.logging import correlation_paths
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.parser.models import EventBridgeModel
from aws_lambda_powertools.utilities.typing import LambdaContext

from sdflow_common import reconciler
from sdflow_common.settings import Settings

logger = Logger()
tracer = Tracer()
metrics = Metrics()


@logger.inject_lambda_context(correlation_id_path=correlation_paths.EVENT_BRIDGE)
@tracer.capture_lambda_handler
@metrics.log_metrics
@event_parser(model=EventBridgeModel)
def lambda_handler(event: EventBridgeModel, context: LambdaContext) -> dict[str, int]:
    report = reconciler.run(Settings.from_env())
    for name, value in report.counts().items():
        metrics.add_metric(name=f"Reconciler{name.capitalize()}", unit=MetricUnit.Count, value=value)
    report.raise_for_errors()
    return report.counts()
