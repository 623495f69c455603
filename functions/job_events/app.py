"""job_events: SageMaker state-change events → SendTaskSuccess / SendTaskFailure.

EventBridge rules for processing-job (download, evaluation), training-job, endpoint and
model-package (approval) state changes target this function; the detail-type picks the event's
model (sdflow_common.job_events)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.logging import correlation_paths
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from sdflow_common.job_events import (
    SageMakerStateChange,
    SageMakerStateChangeEvent,
    TaskResolver,
    resolve_event,
)
from sdflow_common.settings import Settings

logger = Logger()
tracer = Tracer()
metrics = Metrics()


@logger.inject_lambda_context(correlation_id_path=correlation_paths.EVENT_BRIDGE)
@tracer.capture_lambda_handler
@metrics.log_metrics
@event_parser(model=SageMakerStateChange)
def lambda_handler(event: SageMakerStateChangeEvent, context: LambdaContext) -> dict[str, Any]:
    resolution = resolve_event(event, TaskResolver.from_settings(Settings.from_env()))
    metrics.add_dimension(name="Outcome", value=resolution.outcome)
    metrics.add_metric(name=f"{resolution.kind.capitalize()}Events", unit=MetricUnit.Count, value=1)
    return resolution.as_dict()
