"""Find duplicates: the processing job that finds the samples repeated across the run's shards.

One processing job of the first training image (the download job's: ContainerEntrypoint ["dedup"],
docs/contracts.md "The dedup job") reads shards.json (the Download Map's item list) and every listed shard's
`_SUCCESS` and `hashes.parquet`, and writes `dropped/<shard>.json` and, last, `summary.json` under the run's
`dataset/dedup/` folder. It reads and writes S3 itself with the job's role (boto3, like the download job), so
it has no ProcessingInput or ProcessingOutput: SageMaker's File-mode inputs would copy every shard's folder,
tars included, to the volume. It is started and awaited like the others: the starter claims the job's name
for the task token (job_start.start_job), job_events answers the token from the job's state-change event with
`{"job_name", "summary_uri"}` ($.dedup); Build dataset index reads summary.json from there."""

from __future__ import annotations

from typing import Any

from sdflow_common import aws, job_control, names, sagemaker_jobs
from sdflow_common.dedup_options import DEDUP_INSTANCE_COUNT
from sdflow_common.errors import DedupJobFailed
from sdflow_common.job_start import JobStart, start_job
from sdflow_common.job_starters import CallbackTask, require_job_settings
from sdflow_common.run_config import RunConfig
from sdflow_common.settings import Settings
from sdflow_common.token_store import TokenStore

DEDUP_ENTRYPOINT = ["dedup"]
# Hash partitions the job spills to its volume (contract §3, the container's default): each is loaded
# alone, so the largest group a process holds is about 1/64 of the run's hashes.
DEDUP_PARTITIONS = 64
SUMMARY_FILE = "summary.json"


class DedupTask(CallbackTask):
    """Find duplicates' payload: the callback fields and `$.config`."""

    config: RunConfig


def output_uri(bucket: str, run_id: str) -> str:
    """`runs/<run>/dataset/dedup/`: one folder per run. Every attempt writes the same files, summary.json last,
    so a summary is only ever there for a finished pass, and it names each dropped file it counts."""
    return f"s3://{bucket}/runs/{run_id}/dataset/dedup/"


def summary_uri(bucket: str, run_id: str) -> str:
    return f"{output_uri(bucket, run_id)}{SUMMARY_FILE}"


def shards_manifest_uri(config: RunConfig) -> str:
    """shards.json, which Validate run wrote and the Download Map read: the shards and their order."""
    return f"s3://{config.bucket}/{config.shard_list_key}"


def container_arguments(config: RunConfig) -> list[str]:
    """Flags of `dedup` (contract §3); --work_dir is left to its default, the job's volume."""
    return [
        "--shards_manifest", shards_manifest_uri(config),
        "--output_uri", output_uri(config.bucket, config.run_id),
        "--processes", str(config.run.deduplication.processes),
        "--partitions", str(DEDUP_PARTITIONS),
    ]  # fmt: skip


# The run document field each part of the request comes from (request_plan: AWS's member path → field; the rest
# is the execution's, the image and role the stack's). The --processes value is the 6th ContainerArguments item.
DOCUMENT_FIELDS = (
    ("processingResources.clusterConfig.instanceType", "deduplication.instance_type"),
    ("processingResources.clusterConfig.volumeSizeInGB", "deduplication.volume_size_gb"),
    ("stoppingCondition", "deduplication.max_runtime_seconds"),
    ("appSpecification.containerArguments.6.member", "deduplication.processes"),
)


def dedup_job_request(
    *, job_name: str, config: RunConfig, run_hash: str, image_uri: str, role_arn: str
) -> dict[str, Any]:
    """CreateProcessingJob for Find duplicates. No network isolation: the container reads the shards' hash
    files and writes its outputs through S3 itself (see the module docstring)."""
    options = config.run.deduplication
    return {
        "ProcessingJobName": job_name,
        "ProcessingResources": {
            "ClusterConfig": {
                "InstanceCount": DEDUP_INSTANCE_COUNT,
                "InstanceType": options.instance_type,
                "VolumeSizeInGB": options.volume_size_gb,
            }
        },
        "StoppingCondition": {"MaxRuntimeInSeconds": options.max_runtime_seconds},
        "AppSpecification": {
            "ImageUri": image_uri,
            "ContainerEntrypoint": list(DEDUP_ENTRYPOINT),
            "ContainerArguments": container_arguments(config),
        },
        "NetworkConfig": {"EnableNetworkIsolation": False},
        "RoleArn": role_arn,
        "Tags": sagemaker_jobs.tags(config.run_id, run_hash, step="dedup"),
    }


def start_dedup(
    task: DedupTask,
    settings: Settings,
    *,
    store: TokenStore | None = None,
    sagemaker: Any = None,
    sfn: Any = None,
) -> dict[str, Any]:
    """Start the run's dedup job (docs/contracts.md "The dedup job")."""
    require_job_settings(settings)
    config = task.config
    name = names.dedup_job_name(task.run_hash, config.run_id, task.redrive, task.attempt)
    request = dedup_job_request(
        job_name=name,
        config=config,
        run_hash=task.run_hash,
        # The download job's image: the dedup package ships in the first image only.
        image_uri=settings.training_image_uri,
        role_arn=settings.sagemaker_role_arn,
    )
    return start_job(
        JobStart(
            store=store or TokenStore.from_settings(settings),
            sfn=sfn or aws.client("stepfunctions"),
            task=task,
            api=job_control.dedup_jobs(sagemaker or aws.client("sagemaker")),
            name=name,
            request=request,
            context={
                "output_uri": output_uri(config.bucket, config.run_id),
                "summary_uri": summary_uri(config.bucket, config.run_id),
                "run_id": config.run_id,
            },
            failure=DedupJobFailed,
            job_kind="dedup",
            # The run's one dedup job: a redrive adopts the one an ended run left running.
            across_redrives=True,
        )
    )
