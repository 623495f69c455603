"""validate_run: the "Validate run" task; returns `$.config` (docs/contracts.md)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from sdflow_common.settings import Settings
from sdflow_common.validate_run import ValidateRunRequest, validate_run

logger = Logger()
tracer = Tracer()
metrics = Metrics()


@logger.inject_lambda_context(correlation_id_path="execution_arn")
@tracer.capture_lambda_handler
@metrics.log_metrics
@event_parser(model=ValidateRunRequest)
def lambda_handler(event: ValidateRunRequest, context: LambdaContext) -> dict[str, Any]:
    settings = Settings.from_env()
    settings.require("data_bucket")
    # InvalidRunDocument / DatasetNotFound propagate: the task fails the execution, and the failure
    # notification (from the execution's status) shows the message naming the field to fix.
    config = validate_run(event, data_bucket=settings.data_bucket, max_shards=settings.max_shards)
    metrics.add_metric(name="RunsValidated", unit=MetricUnit.Count, value=1)
    metrics.add_metric(name="ShardsListed", unit=MetricUnit.Count, value=config["shard_count"])
    resume = config.get("resume")
    if resume is not None:
        # How much a resume saved: shards not downloaded again, a training job not run again.
        metrics.add_metric(name="ShardsReused", unit=MetricUnit.Count, value=resume["shards_reused"])
        metrics.add_metric(name="TrainingReused", unit=MetricUnit.Count, value=int(resume["training_reused"]))
    logger.info(
        "run validated",
        extra={
            "run_id": config["run_id"],
            "shard_count": config["shard_count"],
            "resume": resume,
            "model_family": config["run"]["base_model_family"],
            "training_method": config["run"]["training"]["method"],
        },
    )
    return config
