"""build_index: the "Build dataset index" task; returns `$.dataset` (docs/contracts.md)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from sdflow_common.build_index import BuildIndexRequest, build_index

logger = Logger()
tracer = Tracer()
metrics = Metrics()


@logger.inject_lambda_context(correlation_id_path="config.execution_arn")
@tracer.capture_lambda_handler
@metrics.log_metrics
@event_parser(model=BuildIndexRequest)
def lambda_handler(event: BuildIndexRequest, context: LambdaContext) -> dict[str, Any]:
    # NoUsableShards propagates: too many failed shards must fail the run through its Catch.
    summary = build_index(event)
    metrics.add_metric(name="ShardsSucceeded", unit=MetricUnit.Count, value=summary["shards_ok"])
    metrics.add_metric(name="ShardsFailed", unit=MetricUnit.Count, value=summary["shards_failed"])
    metrics.add_metric(name="SamplesIndexed", unit=MetricUnit.Count, value=summary["total_samples"])
    logger.info("dataset indexed", extra=summary)
    return summary
