"""Evaluate model: the processing job that scores the trained model before anything is deployed.

A processing job of the training image (ContainerEntrypoint ["evaluate"], docs/contracts.md "The
evaluation job") renders the held-out samples' captions (the dataset's held-out split, a ManifestFile
input of Build dataset index's holdout.json) and, with scene adherence, the scene prompts, with the base
and the trained model; scores CLIP score, KID and FID with the run's CLIP model (an S3Prefix input of
evaluation.clip_model_uri) and the scene adherence; and writes `evaluation.json`, `holdout.png` and
`adherence.png` to the job's own output folder. It is started and awaited like the others: the starter
claims the job's name for the task token, job_events answers the token from the job's state-change
event with `{"job_name", "evaluation_uri"}`; Register model reads the metrics from there."""

from __future__ import annotations

import json
from typing import Any

from aws_lambda_powertools import Logger

from sdflow_common import aws, job_control, model_family, names, sagemaker_jobs
from sdflow_common.errors import EvaluationJobFailed, InvalidRunDocument
from sdflow_common.job_start import JobStart, start_job
from sdflow_common.job_starters import CallbackTask, TrainingResult, require_job_settings
from sdflow_common.run_config import RunConfig
from sdflow_common.run_document import EvaluationOptions, RunDocument
from sdflow_common.settings import Settings
from sdflow_common.token_store import TokenStore

logger = Logger(child=True)

EVALUATE_ENTRYPOINT = ["evaluate"]
# Container paths of the evaluation job (ProcessingInput / ProcessingOutput LocalPath).
MODEL_DIR = "/opt/ml/processing/model"
BASE_MODEL_DIR = "/opt/ml/processing/base_model"
PROMPTS_DIR = "/opt/ml/processing/prompts"
HOLDOUT_DIR = "/opt/ml/processing/holdout"
CLIP_MODEL_DIR = "/opt/ml/processing/clip_model"
OUTPUT_DIR = "/opt/ml/processing/evaluation"
EVALUATION_FILE = "evaluation.json"
GRID_FILE = "adherence.png"
# Two models (a Stable Diffusion checkpoint is ~5 GB in fp32) and a few hundred small images.
EVALUATION_VOLUME_GB = 30


class EvaluationTask(CallbackTask):
    config: RunConfig
    training: TrainingResult
    # `$.dataset` (Build dataset index): holdout_manifest_uri and holdout_samples when the run holds samples out.
    dataset: dict[str, Any] = {}


def output_uri(bucket: str, run_id: str, job_name: str) -> str:
    """Per job: a retried or redriven evaluation never mixes its files with an earlier attempt's."""
    return f"s3://{bucket}/runs/{run_id}/evaluation/{job_name}/"


def prompts_key(run_id: str) -> str:
    return f"runs/{run_id}/evaluation/prompts.json"


def _s3_input(name: str, uri: str, local_path: str, data_type: str = "S3Prefix") -> dict[str, Any]:
    return {
        "InputName": name,
        "S3Input": {
            "S3Uri": uri,
            "LocalPath": local_path,
            "S3DataType": data_type,
            "S3InputMode": "File",
            "S3DataDistributionType": "FullyReplicated",
        },
    }


def container_arguments(
    options: EvaluationOptions, prompts_file: str | None, seed: int, *, holdout: bool = False
) -> list[str]:
    """Flags of `evaluate`. Each ContainerArguments item is at most 256 characters, so a prompt
    list travels as a file (ProcessingInput "prompts"), never as an argument. `holdout`: the job has
    the held-out samples' input (--holdout_dir)."""
    arguments = [
        "--model_dir", MODEL_DIR,
        "--base_model_dir", BASE_MODEL_DIR,
        "--output_dir", OUTPUT_DIR,
        "--num_inference_steps", str(options.num_inference_steps),
        "--guidance_scale", str(options.guidance_scale),
        "--seed", str(seed),
        "--scene_adherence", "true" if options.scene_adherence_on else "false",
    ]  # fmt: skip
    if prompts_file:
        arguments += ["--prompts_file", prompts_file]
    if holdout and options.holdout_samples:
        arguments += ["--holdout_dir", HOLDOUT_DIR, "--holdout_samples", str(options.holdout_samples)]
    if options.clip_model_uri:
        arguments += ["--clip_model_dir", CLIP_MODEL_DIR]
    return arguments


def instance_type(document: RunDocument) -> str:
    """evaluation.instance_type as Validate run resolved it; for a run it has not (a test's event), the same
    choice made here: the smallest GPU instance holding the family's pipeline (without the CLIP model, unread)."""
    if document.evaluation.instance_type is not None:
        return document.evaluation.instance_type
    family = document.base_model_family
    found = None if family == "auto" else model_family.evaluation_instance(document, family)[0]
    if found is None:
        raise InvalidRunDocument(
            json.dumps(
                [{"field": "evaluation.instance_type", "message": "is unresolved (Validate run sets it): set it"}]
            )
        )
    return found


def holdout_manifest(dataset: dict[str, Any], options: EvaluationOptions) -> str | None:
    """The held-out split's manifest (Build dataset index), when the run holds samples out and some downloaded."""
    uri = dataset.get("holdout_manifest_uri")
    return uri if isinstance(uri, str) and uri and options.holdout_samples else None


def evaluation_job_request(
    *,
    job_name: str,
    config: RunConfig,
    run_hash: str,
    model_data_url: str,
    prompts_uri: str | None,
    image_uri: str,
    role_arn: str,
    holdout_manifest_uri: str | None = None,
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
    if holdout_manifest_uri:
        # A ManifestFile input: SageMaker copies each listed object to HOLDOUT_DIR/<its key after the prefix>.
        inputs.append(_s3_input("holdout", holdout_manifest_uri, HOLDOUT_DIR, "ManifestFile"))
    if options.clip_model_uri:
        inputs.append(_s3_input("clip_model", options.clip_model_uri, CLIP_MODEL_DIR))
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
                "InstanceType": instance_type(config.run),
                "VolumeSizeInGB": EVALUATION_VOLUME_GB,
            }
        },
        "StoppingCondition": {"MaxRuntimeInSeconds": options.max_runtime_seconds},
        "AppSpecification": {
            "ImageUri": image_uri,
            "ContainerEntrypoint": list(EVALUATE_ENTRYPOINT),
            "ContainerArguments": container_arguments(
                options, prompts_file, config.run.training.seed, holdout=holdout_manifest_uri is not None
            ),
        },
        "NetworkConfig": {"EnableNetworkIsolation": True},
        "RoleArn": role_arn,
        "Tags": sagemaker_jobs.tags(config.run_id, run_hash, step="evaluation"),
    }


def _prompts_uri(task: EvaluationTask, s3: Any) -> str | None:
    """The prompts the job scores, as an S3 object: the document's `prompts_uri` as it is, or its
    `prompts` list written under the run's folder (the same bytes on every attempt); None: the
    image's 48 held-out prompts (or no scene prompts at all, without scene adherence)."""
    options = task.config.run.evaluation
    if not options.scene_adherence_on:
        return None
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
        holdout_manifest_uri=holdout_manifest(task.dataset, config.run.evaluation),
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
            api=job_control.evaluation_jobs(sagemaker),
            name=name,
            request=request,
            context={"output_uri": output_uri(config.bucket, config.run_id, name), "run_id": config.run_id},
            failure=EvaluationJobFailed,
            job_kind="evaluation",
            across_redrives=True,
        )
    )
