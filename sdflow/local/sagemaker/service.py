"""SageMaker: jobs and endpoints handed to LocalSageMaker, their status published as AWS does
(SageMaker Runtime's InvokeEndpoint: sagemaker/invoke.py)."""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
from collections.abc import Mapping
from typing import Any

from moto.core.exceptions import JsonRESTError
from moto.sagemaker.exceptions import SagemakerClientError

from sdflow.local.account import ACCOUNT_ID, REGION
from sdflow.local.patching import Patch, add, wrap
from sdflow.local.runtime import (
    Kind,
    PatchError,
    Runtime,
    SageMakerEngine,
    current_clock,
    current_runtime,
    runtime_or_none,
)
from sdflow.local.sagemaker import capacity, limits, quotas

log = logging.getLogger(__name__)


def _epoch_ms(value: Any) -> Any:
    """SageMaker events carry the Describe* response with times as epoch milliseconds."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return int(value.timestamp() * 1000)
    if isinstance(value, dict):
        return {k: _epoch_ms(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_epoch_ms(v) for v in value]
    return value


def _where(key: tuple[Kind, str], default: tuple[str, str]) -> tuple[str, str]:
    runtime = runtime_or_none()
    return runtime.sagemaker_where.get(key, default) if runtime else default


def _request(response: Any) -> dict[str, Any]:
    """The request exactly as the caller sent it (PascalCase, as boto3 passed it)."""
    return dict(json.loads(response.body or "{}"))


def _sagemaker(runtime: Runtime) -> SageMakerEngine | None:
    return runtime.sagemaker


class ResourceLimitExceeded(SagemakerClientError):
    """SageMaker's instance quota error (HTTP 400); message as sagemaker_quotas.QuotaExceeded."""

    code = "ResourceLimitExceeded"


class ThrottlingException(JsonRESTError):
    """A control-plane call over SageMaker's API rate ("Rate exceeded", HTTP 400). Not an error
    shape of SageMaker's service model, so it is sent as a plain JSON error."""

    def __init__(self, message: str) -> None:
        super().__init__("ThrottlingException", message)


def _throttle(runtime: Runtime) -> None:
    try:
        runtime.sagemaker_quotas.take_create_token()
    except quotas.RateExceeded as exc:
        raise ThrottlingException(str(exc)) from None


def _hold_instances(runtime: Runtime, key: tuple[str, str, str], needs: dict[str, int]) -> None:
    """Instances count against the quota only while LocalSageMaker runs the resource (moto alone
    completes jobs at once, so nothing would ever free them)."""
    if runtime.sagemaker is None:
        return
    try:
        runtime.sagemaker_quotas.acquire(key, needs)
    except quotas.QuotaExceeded as exc:
        raise ResourceLimitExceeded(str(exc)) from None


def sagemaker_create_processing_job(inner: Any, self: Any) -> Any:
    """Wraps moto/sagemaker/responses.py SageMakerResponse.create_processing_job.

    moto records the job as Completed at once and runs nothing. Here a duplicate name is
    refused as on AWS (ResourceInUse), the job is recorded InProgress and handed to
    LocalSageMaker.run_processing_job; its status changes come back through
    SageMakerStatusPublisher."""
    request = _request(self)
    limits.check("CreateProcessingJob", request)
    name = request.get("ProcessingJobName", "")
    backend = self.sagemaker_backend
    _throttle(current_runtime())
    if name in backend.processing_jobs:
        from moto.sagemaker.exceptions import ResourceInUseException

        raise ResourceInUseException(
            f"Job name must be unique within an AWS account and region, and a job with this name already "
            f"exists ({backend.processing_jobs[name].arn})"
        )
    _hold_instances(current_runtime(), ("processing", name, ""), quotas.processing_needs(request))
    result = inner(self)
    job = backend.processing_jobs[name]
    # moto keeps neither, and DescribeProcessingJob returns both (ProcessingResources is required
    # in its response): the SageMaker Python SDK sizes its log tailing by the instance count.
    job.processing_resources = request["ProcessingResources"]
    if request.get("Environment"):
        job.environment = request["Environment"]
    sagemaker = _sagemaker(current_runtime())
    if sagemaker is not None:
        job.processing_job_status = "InProgress"
        job.processing_end_time = None
        current_runtime().sagemaker_where[("processing", name)] = (self.current_account, self.region)
        sagemaker.run_processing_job(request)
    return result


def sagemaker_create_training_job(inner: Any, self: Any) -> Any:
    """Wraps moto/sagemaker/responses.py SageMakerResponse.create_training_job.

    As create_processing_job: ResourceInUse for a duplicate name, InProgress / Starting with no
    artifacts, end time or metrics until LocalSageMaker reports them, then
    LocalSageMaker.run_training_job."""
    request = _request(self)
    limits.check("CreateTrainingJob", request)
    name = request.get("TrainingJobName", "")
    backend = self.sagemaker_backend
    _throttle(current_runtime())
    if name in backend.training_jobs:
        from moto.sagemaker.exceptions import ResourceInUseException

        raise ResourceInUseException(
            f"Training job names must be unique within an AWS account and region, and a training job with this "
            f"name already exists ({backend.training_jobs[name].arn})"
        )
    _hold_instances(current_runtime(), ("training", name, ""), quotas.training_needs(request))
    result = inner(self)
    sagemaker = _sagemaker(current_runtime())
    if sagemaker is not None:
        job = backend.training_jobs[name]
        job.training_job_status = "InProgress"
        job.secondary_status = "Starting"
        job.training_end_time = None
        job.training_start_time = None
        job.model_artifacts = None
        job.final_metric_data_list = None
        job.secondary_status_transitions = []
        if "MetricDefinitions" in (request.get("AlgorithmSpecification") or {}):
            # moto overwrites the caller's MetricDefinitions with its own sample.
            job.algorithm_specification["MetricDefinitions"] = request["AlgorithmSpecification"]["MetricDefinitions"]
        current_runtime().sagemaker_where[("training", name)] = (self.current_account, self.region)
        if capacity.take_capacity_failure(current_runtime()):
            capacity.fail_for_capacity(_publisher(current_runtime()), name, current_runtime().clock)
        else:
            sagemaker.run_training_job(request)
    return result


def sagemaker_stop_processing_job(inner: Any, self: Any) -> Any:
    """Wraps moto/sagemaker/responses.py SageMakerResponse.stop_processing_job.

    moto flips the status to Stopped; here the job goes Stopping (with its state-change event)
    and LocalSageMaker stops its processes (the final Stopped comes from the listener)."""
    from moto.core.responses import EmptyResult

    name = self._get_param("ProcessingJobName")
    job = job_or_error(self.sagemaker_backend.processing_jobs, name, "processing job", self)
    sagemaker = _sagemaker(current_runtime())
    if sagemaker is None:
        return inner(self)
    _refuse_unless_in_progress(job.processing_job_status, "processing job")
    _publisher(current_runtime()).job_status_changed("processing", name, "Stopping", {})
    sagemaker.stop_job("processing", name)
    return EmptyResult()


def sagemaker_stop_training_job(self: Any) -> Any:
    """Adds SageMakerResponse.stop_training_job (moto 5.2.5 has none: NotImplemented).

    As StopTrainingJob documents: the job goes Stopping (SecondaryStatus Stopping, with its
    state-change event), SageMaker sends the algorithm SIGTERM and kills it after the grace
    (LocalSageMaker.stop_grace_s; 120 s on AWS), then the job is Stopped."""
    from moto.core.responses import EmptyResult

    name = self._get_param("TrainingJobName")
    job = job_or_error(self.sagemaker_backend.training_jobs, name, "training job", self)
    _refuse_unless_in_progress(job.training_job_status, "training job")
    sagemaker = _sagemaker(current_runtime())
    if sagemaker is not None:
        _publisher(current_runtime()).job_status_changed("training", name, "Stopping", {"SecondaryStatus": "Stopping"})
        sagemaker.stop_job("training", name)
    else:
        job.training_job_status = job.secondary_status = "Stopped"
    return EmptyResult()


def _publisher(runtime: Runtime) -> Any:
    """The StatusListener the local SageMaker reports to (LocalCloud's, with its `published`
    record), or a fresh one when the runtime's SageMaker has none (tests' fakes)."""
    return getattr(runtime.sagemaker, "listener", None) or SageMakerStatusPublisher()


def job_or_error(jobs: Mapping[str, Any], name: str, what: str, response: Any) -> Any:
    """StopProcessingJob / StopTrainingJob document ResourceNotFound for a job that does not exist."""
    from moto.sagemaker.exceptions import ResourceNotFound

    if name not in jobs:
        kind = what.replace(" ", "-")
        arn = f"arn:aws:sagemaker:{response.region}:{response.current_account}:{kind}/{name}"
        raise ResourceNotFound(message=f"Could not find {what} '{arn}'.")
    return jobs[name]


def _refuse_unless_in_progress(status: str, what: str) -> None:
    """AWS refuses to stop a job that is not InProgress with ValidationException "The request
    was rejected because the training job is in status Stopped." (quoted in
    awslabs/benchmark-ai#928)."""
    from moto.sagemaker.exceptions import ValidationError

    if status != "InProgress":
        raise ValidationError(message=f"The request was rejected because the {what} is in status {status}.")


def sagemaker_create_model(inner: Any, self: Any) -> Any:
    """Wraps SageMakerResponse.create_model to keep the request (LocalSageMaker.deploy_endpoint needs it)."""
    request = _request(self)
    limits.check("CreateModel", request)
    result = inner(self)
    current_runtime().recorded_requests[(self.current_account, "model", request.get("ModelName", ""))] = request
    return result


def sagemaker_create_endpoint_config(inner: Any, self: Any) -> Any:
    """Wraps SageMakerResponse.create_endpoint_config to keep the request (for deploy_endpoint)."""
    request = _request(self)
    limits.check("CreateEndpointConfig", request)
    result = inner(self)
    current_runtime().recorded_requests[(self.current_account, "config", request.get("EndpointConfigName", ""))] = (
        request
    )
    return result


def _endpoint_deployment(response: Any, config_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(CreateEndpointConfig request, CreateModel request of its first variant)."""
    from moto.sagemaker.exceptions import ValidationError

    account, backend = response.current_account, response.sagemaker_backend
    config = current_runtime().recorded_requests.get((account, "config", config_name))
    if config is None:
        if config_name not in backend.endpoint_configs:
            arn = f"arn:aws:sagemaker:{response.region}:{account}:endpoint-config/{config_name}"
            raise ValidationError(message=f"Could not find endpoint configuration '{arn}'.")
        config = _strip_describe(backend.describe_endpoint_config(config_name))
    variants = config.get("ProductionVariants") or []
    model_name = variants[0].get("ModelName", "") if variants else ""
    model = current_runtime().recorded_requests.get((account, "model", model_name))
    if model is None:
        if model_name not in backend._models:
            raise ValidationError(message=f'Could not find model "{model_name}".')
        model = _strip_describe(backend.describe_model(model_name))
    return config, model


def _strip_describe(described: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in described.items() if not k.endswith(("Arn", "Time"))}


def sagemaker_create_endpoint(inner: Any, self: Any) -> Any:
    """Wraps moto/sagemaker/responses.py SageMakerResponse.create_endpoint.

    moto creates the endpoint InService at once; here it is Creating and LocalSageMaker starts
    a serving process for the config's model (InService / Failed come from the listener)."""
    from moto.sagemaker.exceptions import ResourceInUseException

    name = self._get_param("EndpointName")
    limits.check("CreateEndpoint", _request(self))
    _throttle(current_runtime())
    if name in self.sagemaker_backend.endpoints:
        arn = self.sagemaker_backend.endpoints[name].arn
        raise ResourceInUseException(f'Cannot create already existing endpoint "{arn}".')
    config_name = self._get_param("EndpointConfigName")
    config, model = _endpoint_deployment(self, config_name)
    _hold_instances(current_runtime(), ("endpoint", name, config_name), quotas.endpoint_needs(config))
    result = inner(self)
    sagemaker = _sagemaker(current_runtime())
    if sagemaker is not None:
        endpoint = self.sagemaker_backend.endpoints[name]
        endpoint.endpoint_status = "Creating"
        current_runtime().sagemaker_where[("endpoint", name)] = (self.current_account, self.region)
        sagemaker.deploy_endpoint(name, config, model)
    return result


def sagemaker_update_endpoint(self: Any) -> Any:
    """Adds SageMakerResponse.update_endpoint (moto 5.2.5 has none).

    As on AWS: only an InService (or Failed) endpoint can be updated; it goes Updating and keeps
    serving its current config until LocalSageMaker reports InService with the new
    EndpointConfigName (or rolls back)."""
    from moto.core.responses import ActionResult
    from moto.sagemaker.exceptions import ValidationError

    name = self._get_param("EndpointName")
    config_name = self._get_param("EndpointConfigName")
    endpoint = self.sagemaker_backend.endpoints.get(name)
    if endpoint is None:
        arn = f"arn:aws:sagemaker:{self.region}:{self.current_account}:endpoint/{name}"
        raise ValidationError(message=f"Could not find endpoint '{arn}'.")
    if endpoint.endpoint_status not in ("InService", "Failed"):
        raise ValidationError(message=f"Cannot update in-progress endpoint '{endpoint.arn}'.")
    config, model = _endpoint_deployment(self, config_name)
    # Blue/green: the new fleet is provisioned while the old one serves, so both count.
    _hold_instances(current_runtime(), ("endpoint", name, config_name), quotas.endpoint_needs(config))
    endpoint.endpoint_status = "Updating"
    endpoint.last_modified_time = current_clock().now()
    sagemaker = _sagemaker(current_runtime())
    current_runtime().sagemaker_where[("endpoint", name)] = (self.current_account, self.region)
    if sagemaker is not None:
        sagemaker.deploy_endpoint(name, config, model)
    else:
        endpoint.endpoint_config_name = config_name
        endpoint.endpoint_status = "InService"
    return ActionResult({"EndpointArn": endpoint.arn})


def sagemaker_delete_endpoint(inner: Any, self: Any) -> Any:
    """Wraps SageMakerResponse.delete_endpoint: the serve process stops and its instances are
    released (moto only forgets the endpoint)."""
    name = self._get_param("EndpointName")
    result = inner(self)
    runtime = current_runtime()
    runtime.sagemaker_quotas.release("endpoint", name)
    sagemaker = _sagemaker(runtime)
    if sagemaker is not None:
        sagemaker.stop_job("endpoint", name)
    return result


def _release_instances(kind: Kind, name: str, status: str, backend: Any) -> None:
    """A job's instances free when it ends; an endpoint's old fleet when an update ends (InService
    with the config now serving), all of them when it fails."""
    runtime = runtime_or_none()
    if runtime is None:
        return
    ended = status == "Failed" if kind == "endpoint" else status in ("Completed", "Failed", "Stopped")
    if ended:
        runtime.sagemaker_quotas.release(kind, name)
    elif kind == "endpoint" and status == "InService" and name in backend.endpoints:
        runtime.sagemaker_quotas.release(kind, name, keep_generation=backend.endpoints[name].endpoint_config_name)


ENDPOINT_EVENT_STATUS = {
    "OutOfService": "OUT_OF_SERVICE",
    "Creating": "CREATING",
    "Updating": "UPDATING",
    "SystemUpdating": "SYSTEM_UPDATING",
    "RollingBack": "ROLLING_BACK",
    "InService": "IN_SERVICE",
    "Deleting": "DELETING",
    "Failed": "FAILED",
    "UpdateRollbackFailed": "UPDATE_ROLLBACK_FAILED",
}
DETAIL_TYPES: dict[Kind, str] = {
    "processing": "SageMaker Processing Job State Change",
    "training": "SageMaker Training Job State Change",
    "endpoint": "SageMaker Endpoint State Change",
}


class SageMakerStatusPublisher:
    """The StatusListener LocalSageMaker reports to: updates moto's job / endpoint objects (so
    Describe* answers the real status, failure reason, artifacts, metrics, config) and puts the
    AWS-shaped "SageMaker … State Change" event on the default bus, where the template's rules
    deliver it to job_events."""

    def __init__(self, account_id: str = ACCOUNT_ID, region: str = REGION) -> None:
        self.account_id = account_id
        self.region = region
        self.lock = threading.Lock()
        self.published: list[dict[str, Any]] = []  # the events sent, for diagnostics and tests

    def job_status_changed(self, kind: Kind, name: str, status: str, fields: dict[str, Any]) -> None:
        from moto.sagemaker.models import sagemaker_backends

        account, region = _where((kind, name), (self.account_id, self.region))
        backend = sagemaker_backends[account][region]
        with self.lock:
            if kind == "processing":
                detail = self._update_processing(backend, name, status, fields)
            elif kind == "training":
                detail = self._update_training(backend, name, status, fields)
            elif kind == "endpoint":
                detail = self._update_endpoint(backend, name, status, fields)
            else:
                raise PatchError(f"unknown SageMaker resource kind {kind!r}")
            if detail is None:
                log.warning("status %s for unknown SageMaker %s %s ignored", status, kind, name)
                return
            _release_instances(kind, name, status, backend)
            event = {
                "Source": "aws.sagemaker",
                "DetailType": DETAIL_TYPES[kind],
                "Detail": json.dumps(_epoch_ms(detail), default=str),
                "Resources": [detail.get("ProcessingJobArn") or detail.get("TrainingJobArn") or detail["EndpointArn"]],
                # Kept with the event id below, so that a redelivery (sdflow/local/faults.py) is the same event.
                "Time": current_clock().time(),
            }
            self.published.append(event)
        from moto.events.models import events_backends

        [entry] = events_backends[account][region].put_events([event])
        event["EventId"] = entry.get("EventId")

    @staticmethod
    def _update_processing(backend: Any, name: str, status: str, fields: Mapping[str, Any]) -> dict[str, Any] | None:
        job = backend.processing_jobs.get(name)
        if job is None:
            return None
        if status == "InProgress" and job.processing_job_status == "Stopping":
            status = "Stopping"  # a stop that came before the job's own start report stands
        job.processing_job_status = status
        for key, attribute in (
            ("FailureReason", "failure_reason"),
            ("ExitMessage", "exit_message"),
            ("ProcessingStartTime", "processing_start_time"),
            ("ProcessingEndTime", "processing_end_time"),
        ):
            if key in fields:
                setattr(job, attribute, fields[key])
        job.last_modified_time = current_clock().now()
        return dict(backend.describe_processing_job(name))

    @staticmethod
    def _update_training(backend: Any, name: str, status: str, fields: Mapping[str, Any]) -> dict[str, Any] | None:
        job = backend.training_jobs.get(name)
        if job is None:
            return None
        now = current_clock().now()
        secondary = fields.get("SecondaryStatus") or {"InProgress": "Training"}.get(status, status)
        if status == "InProgress" and job.training_job_status == "Stopping":
            status = secondary = "Stopping"  # a stop that came before the job's own progress reports stands
        job.training_job_status = status
        if secondary != job.secondary_status:
            for transition in job.secondary_status_transitions:
                transition.setdefault("EndTime", now)
            job.secondary_status_transitions.append({"Status": secondary, "StartTime": now})
        job.secondary_status = secondary
        for key, attribute in (
            ("FailureReason", "failure_reason"),
            ("ModelArtifacts", "model_artifacts"),
            ("FinalMetricDataList", "final_metric_data_list"),
            ("TrainingStartTime", "training_start_time"),
            ("TrainingEndTime", "training_end_time"),
            ("BillableTimeInSeconds", "billable_time_in_seconds"),
        ):
            if key in fields:
                setattr(job, attribute, fields[key])
        job.last_modified_time = now
        return dict(backend.describe_training_job(name))

    @staticmethod
    def _update_endpoint(backend: Any, name: str, status: str, fields: Mapping[str, Any]) -> dict[str, Any] | None:
        endpoint = backend.endpoints.get(name)
        if endpoint is None:
            return None
        endpoint.endpoint_status = status
        if fields.get("EndpointConfigName"):
            endpoint.endpoint_config_name = fields["EndpointConfigName"]
        # Failed says why; InService after a rolled-back update says why too; otherwise none.
        endpoint.failure_reason = fields.get("FailureReason")
        endpoint.last_modified_time = current_clock().now()
        detail = dict(backend.describe_endpoint(name))
        detail["EndpointStatus"] = ENDPOINT_EVENT_STATUS.get(status, status.upper())
        return detail


# Members moto stores as {} or [] when the request left them out, and then returns; AWS omits them.
# An empty VpcConfig (no Subnets) or DataCaptureConfig (no DestinationS3Uri) is invalid to the
# SageMaker Python SDK's typed resources (sagemaker-core), which read Describe* after each Create*.
UNSET_WHEN_EMPTY = ("VpcConfig", "Containers", "DataCaptureConfig")


def _describe_without_unset(operation: str) -> Any:
    """Wraps SageMakerResponse.<operation> (a Describe*) to drop the members the request never set."""

    def describe(inner: Any, self: Any) -> Any:
        from moto.core.responses import ActionResult

        answer = inner(self)
        described = answer.result if isinstance(answer, ActionResult) else None
        if not isinstance(described, dict):
            return answer
        return ActionResult({k: v for k, v in described.items() if not (k in UNSET_WHEN_EMPTY and not v)})

    return describe


def patches() -> list[Patch]:
    from moto.sagemaker.responses import SageMakerResponse

    return [
        wrap(SageMakerResponse, "create_processing_job", sagemaker_create_processing_job),
        wrap(SageMakerResponse, "create_training_job", sagemaker_create_training_job),
        wrap(SageMakerResponse, "stop_processing_job", sagemaker_stop_processing_job),
        add(SageMakerResponse, "stop_training_job", sagemaker_stop_training_job),
        wrap(SageMakerResponse, "create_model", sagemaker_create_model),
        wrap(SageMakerResponse, "create_endpoint_config", sagemaker_create_endpoint_config),
        wrap(SageMakerResponse, "create_endpoint", sagemaker_create_endpoint),
        add(SageMakerResponse, "update_endpoint", sagemaker_update_endpoint),
        wrap(SageMakerResponse, "delete_endpoint", sagemaker_delete_endpoint),
        *(
            wrap(SageMakerResponse, operation, _describe_without_unset(operation))
            for operation in ("describe_model", "describe_endpoint_config", "describe_endpoint")
        ),
    ]
