"""deploy_endpoint: the "Deploy endpoint" task; creates the endpoint or updates it blue/green.

Invoked with `lambda:invoke.waitForTaskToken`; the task's result comes later from job_events,
on the endpoint's state-change event."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from sdflow_common.job_starters import DeployTask, deploy_endpoint
from sdflow_common.settings import Settings

logger = Logger()
tracer = Tracer()
metrics = Metrics()


@logger.inject_lambda_context(correlation_id_path="execution_arn")
@tracer.capture_lambda_handler
@metrics.log_metrics
@event_parser(model=DeployTask)
def lambda_handler(event: DeployTask, context: LambdaContext) -> dict[str, Any]:
    result = deploy_endpoint(event, Settings.from_env())
    if result["created"]:
        metrics.add_metric(name=f"Endpoint{result['action'].capitalize()}s", unit=MetricUnit.Count, value=1)
    else:
        metrics.add_metric(name="EndpointDeploysReinvoked", unit=MetricUnit.Count, value=1)
    return result
