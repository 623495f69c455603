"""Evaluate model: the processing job that scores the trained model before anything is deployed.

A processing job of the training image (ContainerEntrypoint ["evaluate"], docs/contracts.md "The
evaluation job") renders the evaluation prompts with the base and the trained model, reads each
image's colours and shape, and writes `evaluation.json` and `adherence.png` (base | trained per
prompt) to the job's own output folder. It is started and awaited like the others: the starter
claims the job's name for the task token, job_events answers the token from the job's state-change
event with `{"job_name", "evaluation_uri"}`; Register model reads the score from there."""

from __future__ import annotations

import json
from typing import Any

from aws_lambda_powertools import Logger

from sdflow_common import aws, job_control, names, sagemaker_jobs
from sdflow_common.errors import EvaluationJobFailed
from sdflow_common.job_start import JobStart, start_job
from sdflow_common.job_starters import CallbackTask, TrainingResult, require_job_settings
from sdflow_common.run_document import EvaluationOptions
from sdflow_common.settings import Settings
from sdflow_common.token_store import TokenStore
from sdflow_common.validate_run import RunConfig

logger = Logger(child=True)

EVALUATE_ENTRYPOINT = ["evaluate"]
# Container paths of the evaluation job (ProcessingInput / ProcessingOutput LocalPath).
MODEL_DIR = "/opt/ml/processing/model"
BASE_MODEL_DIR = "/opt/ml/processing/base_model"
PROMPTS_DIR = "/opt/ml/processing/prompts"
OUTPUT_DIR = "/opt/ml/processing/evaluation"
EVALUATION_FILE = "evaluation.json"
GRID_FILE = "adherence.png"
# Two models (a Stable Diffusion checkpoint is ~5 GB in fp32) and a few hundred small images.
EVALUATION_VOLUME_GB = 30


class EvaluationTask(CallbackTask):
    config: RunConfig
    training: TrainingResult


def output_uri(bucket: str, run_id: str, job_name: str) -> str:
    """Per job: a retried or redriven evaluation never mixes its files with an earlier attempt's."""
    return f"s3://{bucket}/runs/{run_id}/evaluation/{job_name}/"


def prompts_key(run_id: str) -> str:
    return f"runs/{run_id}/evaluation/prompts.json"


def _s3_input(name: str, uri: str, local_path: str) -> dict[str, Any]:
    return {
        "InputName": name,
        "S3Input": {
            "S3Uri": uri,
            "LocalPath": local_path,
            "S3DataType": "S3Prefix",
            "S3InputMode": "File",
            "S3DataDistributionType": "FullyReplicated",
        },
    }


def container_arguments(options: EvaluationOptions, prompts_file: str | None, seed: int) -> list[str]:
    """Flags of `evaluate`. Each ContainerArguments item is at most 256 characters, so a prompt
    list travels as a file (ProcessingInput "prompts"), never as an argument."""
    arguments = [
        "--model_dir", MODEL_DIR,
        "--base_model_dir", BASE_MODEL_DIR,
        "--output_dir", OUTPUT_DIR,
        "--num_inference_steps", str(options.num_inference_steps),
        "--guidance_scale", str(options.guidance_scale),
        "--seed", str(seed),
    ]  # fmt: skip
    if prompts_file:
        arguments += ["--prompts_file", prompts_file]
    return arguments


def evaluation_job_request(
    *,
    job_name: str,
    config: RunConfig,
    run_hash: str,
    model_data_url: str,
    prompts_uri: str | None,
    image_uri: str,
    role_arn: str,
) -> dict[str, Any]:
    """CreateProcessingJob for Evaluate model. Network isolation on: the job reads only its inputs
    (SageMaker downloads them) and writes only its output folder (SageMaker uploads it at the end)."""
    options = config.run.evaluation
    inputs = [
        # An uncompressed model's prefix: its files land in MODEL_DIR as they are, nothing to untar.
        _s3_input("model", model_data_url, MODEL_DIR),
        _s3_input("base_model", config.run.base_model_uri, BASE_MODEL_DIR),
    ]
    prompts_file = None
    if prompts_uri:
        inputs.append(_s3_input("prompts", prompts_uri, PROMPTS_DIR))
        prompts_file = f"{PROMPTS_DIR}/{prompts_uri.rsplit('/', 1)[-1]}"
    return {
        "ProcessingJobName": job_name,
        "ProcessingInputs": inputs,
        "ProcessingOutputConfig": {
            "Outputs": [
                {
                    "OutputName": "evaluation",
                    "S3Output": {
                        "S3Uri": output_uri(config.bucket, config.run_id, job_name),
                        "LocalPath": OUTPUT_DIR,
                        "S3UploadMode": "EndOfJob",
                    },
                }
            ]
        },
        "ProcessingResources": {
            "ClusterConfig": {
                "InstanceCount": 1,
                "InstanceType": options.instance_type,
                "VolumeSizeInGB": EVALUATION_VOLUME_GB,
            }
        },
        "StoppingCondition": {"MaxRuntimeInSeconds": options.max_runtime_seconds},
        "AppSpecification": {
            "ImageUri": image_uri,
            "ContainerEntrypoint": list(EVALUATE_ENTRYPOINT),
            "ContainerArguments": container_arguments(options, prompts_file, config.run.training.seed),
        },
        "NetworkConfig": {"EnableNetworkIsolation": True},
        "RoleArn": role_arn,
        "Tags": sagemaker_jobs.tags(config.run_id, run_hash, step="evaluation"),
    }


def _prompts_uri(task: EvaluationTask, s3: Any) -> str | None:
    """The prompts the job scores, as an S3 object: the document's `prompts_uri` as it is, or its
    `prompts` list written under the run's folder (the same bytes on every attempt); None: the
    image's 48 held-out prompts."""
    options = task.config.run.evaluation
    if options.prompts_uri:
        return options.prompts_uri
    if options.prompts is None:
        return None
    key = prompts_key(task.config.run_id)
    s3.put_object(
        Bucket=task.config.bucket,
        Key=key,
        Body=json.dumps(list(options.prompts), indent=1).encode(),
        ContentType="application/json",
    )
    return f"s3://{task.config.bucket}/{key}"


def start_evaluation(
    task: EvaluationTask,
    settings: Settings,
    *,
    store: TokenStore | None = None,
    sagemaker: Any = None,
    sfn: Any = None,
    s3: Any = None,
) -> dict[str, Any]:
    """Start the evaluation job of a trained model (docs/contracts.md "The evaluation job")."""
    require_job_settings(settings)
    config = task.config
    name = names.evaluation_job_name(task.run_hash, config.run_id, task.redrive, task.attempt)
    prompts_uri = _prompts_uri(task, s3 or aws.client("s3"))
    request = evaluation_job_request(
        job_name=name,
        config=config,
        run_hash=task.run_hash,
        model_data_url=task.training.model_data_url,
        prompts_uri=prompts_uri,
        # The trained model loads only in its backend's stack (a FLUX.2 model needs today's diffusers).
        image_uri=settings.image_uri(config.run.training.backend),
        role_arn=settings.sagemaker_role_arn,
    )
    sagemaker = sagemaker or aws.client("sagemaker")
    return start_job(
        JobStart(
            store=store or TokenStore.from_settings(settings),
            sfn=sfn or aws.client("stepfunctions"),
            task=task,
            api=job_control.processing_jobs(sagemaker),
            name=name,
            request=request,
            context={"output_uri": output_uri(config.bucket, config.run_id, name), "run_id": config.run_id},
            failure=EvaluationJobFailed,
            job_kind="evaluation",
            across_redrives=True,
        )
    )
