"""Notify success / Notify failure: publish the run's outcome to the notification topic."""

from __future__ import annotations

import os
from typing import Any

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.idempotency import (
    DynamoDBPersistenceLayer,
    IdempotencyConfig,
    idempotent,
)
from aws_lambda_powertools.utilities.parser import parse
from aws_lambda_powertools.utilities.typing import LambdaContext

from sdflow_common import notify
from sdflow_common.settings import Settings

logger = Logger()
tracer = Tracer()
metrics = Metrics()
# A retried "Notify" state must not mail the user twice: one message per execution and outcome.
persistence = DynamoDBPersistenceLayer(table_name=os.environ.get("IDEMPOTENCY_TABLE", "sdflow-idempotency"))
idempotency_config = IdempotencyConfig(event_key_jmespath="[execution_arn, outcome]", expires_after_seconds=86400)


@logger.inject_lambda_context(correlation_id_path="execution_arn")
@tracer.capture_lambda_handler
@metrics.log_metrics
@idempotent(config=idempotency_config, persistence_store=persistence)
def lambda_handler(event: dict[str, Any], context: LambdaContext) -> dict[str, str]:
    request = parse(event=event, model=notify.NotifyRequest)
    message = notify.compose(request)
    message_id = notify.publish(message, Settings.from_env().topic_arn)
    metrics.add_metric(name=f"Runs{request.outcome.capitalize()}", unit=MetricUnit.Count, value=1)
    logger.info("notification published", extra={"outcome": request.outcome, "message_id": message_id})
    return {"message_id": message_id}
