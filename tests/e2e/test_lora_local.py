"""SDXL and SD 3 LoRA runs end to end through the local cloud with the real image: tiny models of each
family built in code, trained as LoRA (the model folder holds the adapter), evaluated, registered with the
base model as the package's `base_model` channel, deployed, then updated blue/green from the SDXL
adapter to the SD 3 one (the host puts each base where SageMaker would,
/opt/ml/additional-model-data-sources/base_model), and invoked.

The tiny SDXL and SD 3 models are built in code by `sdflow_image.builders.tiny_families`."""

from __future__ import annotations

import io
import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from sdflow import samples
from sdflow.demo import (
    DemoOptions,
    _upload_tree,
    lora_demo_options,
    manifest,
    prepare_inputs,
    run_pipeline,
    show_results,
    wait_for_notification,
)
from sdflow.local.cloud import LocalCloud
from sdflow.local.sagemaker.job_env import image_environment, image_python
from sdflow.runs import start_run
from sdflow.session import Session
from sdflow.watch import watch
from tests.constants import TIME_SCALE

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SMALL = DemoOptions(
    shards=1,
    images_per_shard=12,
    instance_count=1,
    max_train_steps=4,
    vae_steps=0,
    min_prompt_adherence=None,
    eval_inference_steps=2,
    eval_in_training=False,
    clip_steps=None,  # no CLIP model, no held-out split
)
PROMPT = "a red circle on a blue background"


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCloud]:
    workdir = tmp_path_factory.mktemp("lora")
    with samples.ImageServer() as server, LocalCloud(workdir, port=0, time_scale=TIME_SCALE) as local:
        s3 = local.client("s3")
        prepare_inputs(s3, local.bucket, workdir, server, SMALL)
        for family in ("sdxl", "sd3"):
            out = workdir / f"tiny-{family}"
            command = [image_python(), "-m", "sdflow_image.builders", str(out), "--family", family]
            built = subprocess.run(command, env=image_environment(), capture_output=True, text=True, check=False)
            assert built.returncode == 0, built.stderr[-4000:]
            _upload_tree(s3, local.bucket, out, f"models/tiny-{family}/")
        yield local


ENDPOINT = "sdflow-lora"


def run_lora(cloud: LocalCloud, family: str) -> dict[str, Any]:
    document = manifest(cloud.bucket, SMALL)
    document["run_name"] = f"lora-{family}"
    document["base_model_uri"] = f"s3://{cloud.bucket}/models/tiny-{family}/"
    # Min-SNR and noise offset weight the DDPM loss: SD 3 trains on rectified flow (Validate run refuses them).
    document["training"] |= {"method": "lora", "lora": {"rank": 4}, "snr_gamma": 0.0, "noise_offset": 0.0}
    document["endpoint"] |= {"name": ENDPOINT}
    path = cloud.workdir / f"lora-{family}.json"
    path.write_text(json.dumps(document))
    session = Session.for_cloud(cloud)
    execution_arn = start_run(session, path, api=False)
    watch(session, execution_arn, interval=0.5)
    wait_for_notification(cloud, execution_arn.rsplit(":", 1)[-1])
    described = session.client("stepfunctions").describe_execution(executionArn=execution_arn)
    assert described["status"] == "SUCCEEDED", described.get("cause")
    return dict(json.loads(described["output"]))


@pytest.fixture(scope="module")
def sdxl_run(cloud: LocalCloud) -> dict[str, Any]:
    """An SDXL LoRA run that creates the endpoint."""
    return run_lora(cloud, "sdxl")


def model_names(cloud: LocalCloud, uri: str) -> set[str]:
    """The trained model's files: the objects under its uncompressed output's prefix."""
    assert uri.endswith("/output/model/"), uri
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    pages = cloud.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {item["Key"][len(prefix) :] for page in pages for item in page.get("Contents", [])}


def served_base_class(cloud: LocalCloud) -> str:
    """The `_class_name` of the base model the endpoint's current deployment was given."""
    config_name = cloud.client("sagemaker").describe_endpoint(EndpointName=ENDPOINT)["EndpointConfigName"]
    # The endpoint host's folder of this deployment (sdflow/local/sagemaker/endpoints.py).
    found = list(cloud.workdir.rglob(f"endpoints/{ENDPOINT}/{config_name}/opt_ml/additional-model-data-sources"))
    assert found, f"the deployment {config_name} of {ENDPOINT} has no additional-model-data-sources folder"
    return str(json.loads((found[0] / "base_model" / "model_index.json").read_text())["_class_name"])


def assert_serves_png(cloud: LocalCloud) -> None:
    body = json.dumps({"prompt": PROMPT, "num_inference_steps": 2})
    response = cloud.client("sagemaker-runtime").invoke_endpoint(
        EndpointName=ENDPOINT, ContentType="application/json", Accept="image/png", Body=body
    )
    assert response["Body"].read()[:8] == b"\x89PNG\r\n\x1a\n"


def assert_lora_run(cloud: LocalCloud, output: dict[str, Any], family: str) -> None:
    assert output["config"]["run"]["base_model_family"] == family
    names = model_names(cloud, output["training"]["model_data_url"])
    assert {"pytorch_lora_weights.safetensors", "sdflow_model.json"} <= names
    assert not any(name.startswith(("unet/", "transformer/")) for name in names)
    package = cloud.client("sagemaker").describe_model_package(
        ModelPackageName=output["registry"]["model"]["model_package_arn"]
    )
    source = package["InferenceSpecification"]["Containers"][0]["AdditionalModelDataSources"][0]
    assert source["S3DataSource"]["S3Uri"] == f"s3://{cloud.bucket}/models/tiny-{family}/"


def test_lora_sdxl_run_trains_adapter_registers_base_deploys_and_serves(
    cloud: LocalCloud, sdxl_run: dict[str, Any]
) -> None:
    assert_lora_run(cloud, sdxl_run, "sdxl")
    assert served_base_class(cloud) == "StableDiffusionXLPipeline"
    assert_serves_png(cloud)


def test_lora_sd3_run_swaps_the_endpoint_blue_green_to_its_adapter_and_base(
    cloud: LocalCloud, sdxl_run: dict[str, Any]
) -> None:
    sagemaker = cloud.client("sagemaker")
    before = sagemaker.describe_endpoint(EndpointName=ENDPOINT)["EndpointConfigName"]
    output = run_lora(cloud, "sd3")
    assert_lora_run(cloud, output, "sd3")
    assert sagemaker.describe_endpoint(EndpointName=ENDPOINT)["EndpointConfigName"] != before
    assert served_base_class(cloud) == "StableDiffusion3Pipeline"
    assert_serves_png(cloud)


def test_lora_demo_small_run_reports_adapter_size_beside_full_model_and_adherence(
    cloud: LocalCloud, tmp_path: Path
) -> None:
    """`make demo-lora`'s path (manifest, run, summary, endpoint image) on this module's cloud and the
    demo's tiny SD at test size: 4 steps, so the scores are not under test here, only that they and the
    sizes are reported (the adherence the LoRA reaches is `make demo-lora`'s: README)."""
    demo = lora_demo_options()
    options = replace(SMALL, lora=demo.lora, learning_rate=demo.learning_rate)
    result = run_pipeline(cloud, tmp_path, options, out=io.StringIO())
    assert result["progress"].status == "SUCCEEDED"
    out = io.StringIO()
    # prepare_inputs built the demo's base model in the fixture's folder.
    show_results(result, tmp_path, cloud.workdir / "tiny-sd", tmp_path / "lora.png", options, out=out)
    text = out.getvalue()

    adapter = re.search(r"^LoRA adapter: ([0-9.]+) (kB|MB) \(pytorch_lora_weights\.safetensors", text, re.M)
    full = re.search(r"^full model: +([0-9.]+) (kB|MB) \(the base model folder .*tiny-sd", text, re.M)
    assert adapter, text
    assert full, text
    in_bytes = {"kB": 1e3, "MB": 1e6}
    assert float(adapter[1]) * in_bytes[adapter[2]] < float(full[1]) * in_bytes[full[2]]
    assert re.search(r"^LoRA prompt adherence: base [0-9.]+ → LoRA [0-9.]+ ", text, re.M), text
    assert f"LoRA image: {(tmp_path / 'lora.png').resolve()}" in text
    with Image.open(tmp_path / "lora.png") as image:
        assert image.format == "PNG"
