"""await_approval: the "Wait for approval" task; parks the task token under the model package's
ARN until its "SageMaker Model Package State Change" event (Approved / Rejected) reaches job_events.

Invoked with `lambda:invoke.waitForTaskToken`; the state's TimeoutSeconds bounds the wait."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from sdflow_common.model_registry import ApprovalTask, await_approval
from sdflow_common.settings import Settings

logger = Logger()
tracer = Tracer()
metrics = Metrics()


@logger.inject_lambda_context(correlation_id_path="execution_arn")
@tracer.capture_lambda_handler
@metrics.log_metrics
@event_parser(model=ApprovalTask)
def lambda_handler(event: ApprovalTask, context: LambdaContext) -> dict[str, Any]:
    result = await_approval(event, Settings.from_env())
    metrics.add_dimension(name="Waiting", value=str(result["waiting"]))
    metrics.add_metric(name="ApprovalsAwaited", unit=MetricUnit.Count, value=1)
    return result
