"""notify: the pipeline's "Step Functions Execution Status Change" events → cleanup + one SNS message.

An EventBridge rule (template.yaml, NotifyFunction) sends every SUCCEEDED / FAILED / TIMED_OUT /
ABORTED change of the pipeline's executions here. A run that did not succeed is cleaned up first
(its jobs stopped, its endpoint deployment rolled back: sdflow_common.run_cleanup), then the
message says what failed and what was stopped.

Idempotency (Powertools, the stack's idempotency table), keyed by (execution ARN, status,
redrive count): a duplicate event does nothing twice, and a redriven execution that ends again
is a new end. When part of the cleanup fails, the message still goes out (once: `publish_once`
has its own idempotency record) and the handler raises CleanupIncomplete, so the event is
retried and the cleanup tried again."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.idempotency import (
    DynamoDBPersistenceLayer,
    IdempotencyConfig,
    idempotent,
    idempotent_function,
)
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from sdflow_common import aws, notify
from sdflow_common.run_cleanup import CleanupIncomplete
from sdflow_common.settings import Settings
from sdflow_common.token_store import TokenStore

logger = Logger()
tracer = Tracer()
metrics = Metrics()
settings = Settings.from_env()
TABLE = settings.idempotency_table or "sdflow-idempotency"
# One persistence layer per idempotent callable: Powertools configures the layer with the
# callable's key expression on every call, so a shared one would lose the handler's key to the
# nested publish_once's.
# Both on the process's one DynamoDB client: a layer left to itself makes a boto3 session of its
# own, which parses botocore's endpoint data and the DynamoDB model again (~13 MB a session).
persistence = DynamoDBPersistenceLayer(table_name=TABLE, boto3_client=aws.client("dynamodb"))
publish_persistence = DynamoDBPersistenceLayer(table_name=TABLE, boto3_client=aws.client("dynamodb"))
RUN_END_KEY = "[detail.executionArn, detail.status, detail.redriveCount]"
# EventBridge retries a failed delivery for up to a day (the rule's MaximumEventAgeInSeconds).
idempotency_config = IdempotencyConfig(event_key_jmespath=RUN_END_KEY, expires_after_seconds=2 * 86400)
publish_config = IdempotencyConfig(
    event_key_jmespath="[execution_arn, status, redrive_count]", expires_after_seconds=2 * 86400
)


@idempotent_function(data_keyword_argument="run_end", config=publish_config, persistence_store=publish_persistence)
def publish_once(*, run_end: dict[str, Any], notification: notify.Notification, topic_arn: str) -> str:
    return notify.publish(notification, topic_arn)


@logger.inject_lambda_context(correlation_id_path="detail.executionArn")
@tracer.capture_lambda_handler
@metrics.log_metrics
@idempotent(config=idempotency_config, persistence_store=persistence)
@event_parser(model=notify.ExecutionStatusChange)
def lambda_handler(event: notify.ExecutionStatusChange, context: LambdaContext) -> dict[str, Any]:
    publish_config.register_lambda_context(context)
    detail = event.detail
    if detail.outcome is None:
        logger.info("not an end of the run; ignored", extra={"status": detail.status})
        return {"ignored": detail.status}
    settings.require("topic_arn", "token_table")
    request, report = notify.gather(
        detail,
        sfn=aws.client("stepfunctions"),
        sagemaker=aws.client("sagemaker"),
        store=TokenStore.from_settings(settings),
    )
    run_end = {"execution_arn": detail.execution_arn, "status": detail.status, "redrive_count": detail.redrive_count}
    notification = notify.compose(request, console_url=settings.console_url)
    message_id = publish_once(run_end=run_end, notification=notification, topic_arn=settings.topic_arn)
    metrics.add_dimension(name="status", value=detail.status)
    metrics.add_metric(name="RunsEnded", unit=MetricUnit.Count, value=1)
    cleanup = report.as_dict() if report else {}
    extra = {"status": detail.status, "message_id": message_id, **notification.log_fields(), **cleanup}
    logger.info("notification published", extra=extra)
    if report is not None and report.errors:
        metrics.add_metric(name="CleanupIncomplete", unit=MetricUnit.Count, value=1)
        raise CleanupIncomplete("; ".join(report.errors))
    return {"message_id": message_id, "status": detail.status, **cleanup}
