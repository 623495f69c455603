"""An SD 3 LoRA run on the accelerate backend end to end through the local cloud with the real image code in
the second job environment (.venv-accelerate): the tiny SD 3 model built in code in that environment
(`sdflow_image.builders.tiny_model --family sd3`, sdflow_image.builders.tiny_families), trained with `training.backend:
accelerate`, plugin ddp, method lora (the archive holds the adapter), evaluated and served by the second
image, and invoked.

The local SageMaker runs every job and model whose image is the stack's AccelerateImageUri in .venv-accelerate
(sdflow/local/sagemaker/job_env.py accelerate_python), so this module needs `make setup`'s second venv."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from sdflow import samples
from sdflow.demo import DemoOptions, _upload_tree, manifest, prepare_inputs, wait_for_notification
from sdflow.local.cloud import LocalCloud
from sdflow.local.sagemaker.job_env import accelerate_python, image_environment
from sdflow.runs import start_run
from sdflow.session import Session
from sdflow.watch import watch
from tests.constants import TIME_SCALE

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SMALL = DemoOptions(
    shards=1,
    images_per_shard=12,
    instance_count=1,
    max_train_steps=2,
    vae_steps=0,
    min_prompt_adherence=None,
    eval_inference_steps=2,
    eval_in_training=False,
    clip_steps=None,  # no CLIP model, no held-out split
)
ENDPOINT = "sdflow-accelerate"


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCloud]:
    workdir = tmp_path_factory.mktemp("accelerate")
    with samples.ImageServer() as server, LocalCloud(workdir, port=0, time_scale=TIME_SCALE) as local:
        s3 = local.client("s3")
        prepare_inputs(s3, local.bucket, workdir, server, SMALL)
        out = workdir / "tiny-sd3"
        # Built by the stack that trains and serves it: transformers 5 does not read the T5 tokenizer files
        # transformers 4.51 (the first image's) writes.
        command = [accelerate_python(), "-m", "sdflow_image.builders", str(out), "--family", "sd3"]
        built = subprocess.run(command, env=image_environment(), capture_output=True, text=True, check=False)
        assert built.returncode == 0, built.stderr[-4000:]
        _upload_tree(s3, local.bucket, out, "models/tiny-sd3/")
        yield local


def run_on_accelerate(cloud: LocalCloud) -> dict[str, Any]:
    document = manifest(cloud.bucket, SMALL)
    document["run_name"] = "accelerate-sd3"
    document["base_model_uri"] = f"s3://{cloud.bucket}/models/tiny-sd3/"
    # Min-SNR and noise offset weight the DDPM loss: SD 3 trains on rectified flow (Validate run refuses them).
    document["training"] |= {
        "backend": "accelerate",
        "plugin": "ddp",
        "method": "lora",
        "lora": {"rank": 4},
        "snr_gamma": 0.0,
        "noise_offset": 0.0,
    }
    document["endpoint"] |= {"name": ENDPOINT}
    path = cloud.workdir / "accelerate-sd3.json"
    path.write_text(json.dumps(document))
    session = Session.for_cloud(cloud)
    execution_arn = start_run(session, path, api=False)
    watch(session, execution_arn, interval=0.5)
    wait_for_notification(cloud, execution_arn.rsplit(":", 1)[-1])
    described = session.client("stepfunctions").describe_execution(executionArn=execution_arn)
    assert described["status"] == "SUCCEEDED", described.get("cause")
    return dict(json.loads(described["output"]))


def model_names(cloud: LocalCloud, uri: str) -> set[str]:
    """The trained model's files: the objects under its uncompressed output's prefix."""
    assert uri.endswith("/output/model/"), uri
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    pages = cloud.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {item["Key"][len(prefix) :] for page in pages for item in page.get("Contents", [])}


def test_accelerate_sd3_lora_ddp_run_trains_evaluates_and_serves_on_the_second_image(cloud: LocalCloud) -> None:
    output = run_on_accelerate(cloud)
    training = output["config"]["run"]["training"]
    assert (output["config"]["run"]["base_model_family"], training["backend"]) == ("sd3", "accelerate")
    second = cloud.deployment.outputs["AccelerateImageUri"] if cloud.deployment is not None else ""
    sagemaker = cloud.client("sagemaker")
    job = sagemaker.describe_training_job(TrainingJobName=output["training"]["job_name"])
    assert job["AlgorithmSpecification"]["TrainingImage"] == second
    assert {"pytorch_lora_weights.safetensors", "sdflow_model.json"} <= model_names(
        cloud, output["training"]["model_data_url"]
    )
    evaluation = sagemaker.describe_processing_job(ProcessingJobName=output["evaluation"]["job_name"])
    assert evaluation["AppSpecification"]["ImageUri"] == second
    package = sagemaker.describe_model_package(ModelPackageName=output["registry"]["model"]["model_package_arn"])
    assert package["InferenceSpecification"]["Containers"][0]["Image"] == second
    assert package["CustomerMetadataProperties"]["sdflow:training_backend"] == "accelerate"

    body = json.dumps({"prompt": "a red circle on a blue background", "num_inference_steps": 2})
    response = cloud.client("sagemaker-runtime").invoke_endpoint(
        EndpointName=ENDPOINT, ContentType="application/json", Accept="image/png", Body=body
    )
    assert response["Body"].read()[:8] == b"\x89PNG\r\n\x1a\n"
