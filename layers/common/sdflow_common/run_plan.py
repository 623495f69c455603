"""`sdflow plan`: what Validate run would decide for a run document and an execution name, writing nothing.

The same code path as Validate run (validate_run.prepare_run: the document, the run's prefix, the inputs in S3, the
instance quotas, every SageMaker request the run will make), then a summary: the family, backend, plugin and
precision chosen, the shards found, each request's name and instances as the first attempt makes them, and the
memory each GPU instance must hold against what it has; or every refusal with its field and fix."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from sdflow_common import evaluation_checks, inference_memory, memory_estimate, model_family
from sdflow_common.errors import DatasetNotFound, InvalidRunDocument
from sdflow_common.instance_types import gpu_of
from sdflow_common.request_plan import PlannedRequest, Unknowns, planned_requests
from sdflow_common.run_document import RunDocument, problems_of
from sdflow_common.settings import Settings
from sdflow_common.validate_run import ValidateRunRequest, check_base_model, prepare_run

# The keys of each request that name what it creates, in the order they are looked for.
NAME_KEYS = (
    "ProcessingJobName",
    "TrainingJobName",
    "ModelPackageGroupName",
    "ModelName",
    "EndpointConfigName",
    "EndpointName",
)


def execution_arn(state_machine_arn: str, name: str) -> str:
    return state_machine_arn.replace(":stateMachine:", ":execution:", 1) + f":{name}"


def _instances(request: dict[str, Any]) -> tuple[str | None, int | None]:
    """The instance type and count a request asks for (None: it runs on none)."""
    if "ProcessingResources" in request:
        cluster = request["ProcessingResources"]["ClusterConfig"]
        return cluster["InstanceType"], cluster["InstanceCount"]
    if "ResourceConfig" in request:
        return request["ResourceConfig"]["InstanceType"], request["ResourceConfig"]["InstanceCount"]
    if "ProductionVariants" in request:
        variant = request["ProductionVariants"][0]
        return variant["InstanceType"], variant["InitialInstanceCount"]
    return None, None


def request_summary(planned: PlannedRequest) -> dict[str, Any]:
    request = planned.request
    name = next((str(request[key]) for key in NAME_KEYS if key in request), "")
    instance_type, count = _instances(request)
    return {
        "operation": planned.operation,
        "label": planned.label,
        "name": name,
        "instance_type": instance_type,
        "instance_count": count,
    }


def _fit(field: str, instance_type: str | None, need_gib: float | None) -> dict[str, Any] | None:
    gpu = gpu_of(instance_type or "")
    if gpu is None or need_gib is None:
        return None
    usable = memory_estimate.usable_gib(gpu)
    return {
        "field": field,
        "instance_type": instance_type,
        "gpu": gpu.name,
        "need_gib": round(need_gib, 1),
        "usable_gib": round(usable, 1),
        "fits": need_gib <= usable,
    }


def memory_fits(document: RunDocument) -> list[dict[str, Any]]:
    """Per GPU instance of the run (training, evaluation, endpoint): the estimated peak per GPU and what it has."""
    index = check_base_model(document.base_model_uri)
    family, with_t5, variant = index.family, index.with_t5, index.variant
    training = model_family.check_memory(document, family, with_t5=with_t5, variant=variant)
    clip_uri = document.evaluation.clip_model_uri
    clip_bytes = evaluation_checks.read_clip_model(clip_uri).weight_bytes if clip_uri else 0
    resolution = document.training.resolution
    evaluation = inference_memory.evaluation_estimate(
        family, resolution, clip_bytes=clip_bytes, variant=variant, with_t5=with_t5
    )
    serving = inference_memory.estimate(
        family, resolution, inference_memory.SERVING_BYTES, variant=variant, with_t5=with_t5
    )
    fits = [
        _fit("training.instance_type", document.training.instance_type, training.total_gib if training else None),
        _fit("evaluation.instance_type", document.evaluation.instance_type, evaluation.total_gib),
        _fit("endpoint.instance_type", document.endpoint.instance_type, serving.total_gib),
    ]
    return [fit for fit in fits if fit is not None]


def _refused(name: str, problems: list[dict[str, str]]) -> dict[str, Any]:
    return {"would_start": False, "execution_name": name, "problems": problems}


def plan_run(
    run: Any,
    execution_name: str,
    *,
    data_bucket: str,
    max_shards: int,
    state_machine_arn: str,
    settings: Settings | None = None,
) -> dict[str, Any]:
    """What Validate run would decide for `run` started as `execution_name` (see the module docstring)."""
    start = datetime.now(UTC).isoformat(timespec="milliseconds")
    try:
        request = ValidateRunRequest(
            run=run,
            execution_name=execution_name,
            execution_arn=execution_arn(state_machine_arn, execution_name),
            start_time=start,
        )
    except ValidationError:
        message = "must be 1 to 80 characters (StartExecution's name); choose a shorter --name"
        return _refused(execution_name, [{"field": "(execution name)", "message": message}])
    stack = settings or Settings.from_env()
    try:
        prepared = prepare_run(request, data_bucket=data_bucket, max_shards=max_shards, settings=stack)
    except (InvalidRunDocument, DatasetNotFound) as exc:
        return _refused(execution_name, problems_of(exc))
    config = prepared.config
    document = RunDocument.model_validate(config["run"])
    first = planned_requests(config, stack, shards=prepared.shards, unknowns=Unknowns(redrive=0, attempt=0))
    training = document.training
    return {
        "would_start": True,
        "execution_name": execution_name,
        "family": document.base_model_family,
        "method": training.method,
        "backend": training.backend,
        "plugin": training.plugin,
        "precision": training.mixed_precision,
        "shards": config["shard_count"],
        "download_concurrency": document.download.max_concurrency,
        "warnings": config.get("warnings", []),
        "requests": [request_summary(planned) for planned in first],
        "memory": memory_fits(document),
    }
