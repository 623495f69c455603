"""start_pipeline: S3 "Object Created" (via EventBridge) for manifests/*.json → StartExecution."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger, Metrics, Tracer
from aws_lambda_powertools.logging import correlation_paths
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.parser.models import S3EventNotificationEventBridgeModel
from aws_lambda_powertools.utilities.typing import LambdaContext

from sdflow_common.settings import Settings
from sdflow_common.start_pipeline import ManifestRef, handle_manifest

logger = Logger()
tracer = Tracer()
metrics = Metrics()

_METRIC_BY_STATUS = {
    "started": "RunsStarted",
    "rejected": "ManifestsRejected",
    "duplicate": "DuplicateManifestEvents",
    # ignored / superseded / gone: events that needed no run (a wrong key, an object already replaced)
}
_SKIPPED_METRIC = "ManifestEventsSkipped"


@logger.inject_lambda_context(correlation_id_path=correlation_paths.EVENT_BRIDGE)
@tracer.capture_lambda_handler
@metrics.log_metrics
@event_parser(model=S3EventNotificationEventBridgeModel)
def lambda_handler(event: S3EventNotificationEventBridgeModel, context: LambdaContext) -> dict[str, Any]:
    settings = Settings.from_env()
    settings.require("state_machine_arn", "topic_arn", "data_bucket")
    obj = event.detail.object
    ref = ManifestRef(
        bucket=event.detail.bucket.name,
        key=obj.key,
        version_id=obj.version_id if obj.version_id not in (None, "", "null") else None,
        etag=obj.etag or None,
    )
    outcome = handle_manifest(
        ref,
        state_machine_arn=settings.state_machine_arn,
        topic_arn=settings.topic_arn,
        max_shards=settings.max_shards,
        data_bucket=settings.data_bucket,
    )
    metric = _METRIC_BY_STATUS.get(outcome.status, _SKIPPED_METRIC)
    metrics.add_metric(name=metric, unit=MetricUnit.Count, value=1)
    # An event that started nothing and reported nothing (the object is gone or replaced) is worth
    # a warning: it is the only trace the upload leaves.
    log = logger.warning if outcome.status in ("gone", "superseded") else logger.info
    log("manifest handled", extra={"manifest": ref.uri, **outcome.as_dict()})
    return outcome.as_dict()
