"""The base model's family at Validate run: read from model_index.json, unknown classes refused,
a stated family checked, the memory estimate applied before any job starts."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sdflow_common import model_family
from sdflow_common.errors import InvalidRunDocument
from sdflow_common.validate_run import ValidateRunRequest, validate_run
from tests.constants import ACCOUNT, REGION
from tests.unit.helpers import DATA_BUCKET, STATE_MACHINE_NAME, AwsWorld
from tests.unit.parquet_files import parquet_bytes

EXECUTION = "family-0123456789abcdef"
EXECUTION_ARN = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:{STATE_MACHINE_NAME}:{EXECUTION}"
MODEL_URI = f"s3://{DATA_BUCKET}/models/base/"


def validate(
    world: AwsWorld, class_name: Any, transformer: dict[str, Any] | None = None, **extra: Any
) -> dict[str, Any]:
    world.put_json("models/base/model_index.json", {"_class_name": class_name})
    if class_name in ("StableDiffusion3Pipeline", "Flux2KleinPipeline"):
        # Validate run reads an SD 3 or FLUX.2 pipeline's transformer config too (SD 3 or SD 3.5; which size).
        world.put_json("models/base/transformer/config.json", transformer or {})
    world.s3.put_object(Bucket=DATA_BUCKET, Key="datasets/a.parquet", Body=parquet_bytes())
    run = {
        "dataset": {"parquet_uris": [f"s3://{DATA_BUCKET}/datasets/a.parquet"]},
        "base_model_uri": MODEL_URI,
        "training": {"instance_type": "ml.m5.xlarge"},
    } | extra
    request = ValidateRunRequest(
        run=run, execution_name=EXECUTION, execution_arn=EXECUTION_ARN, start_time="2026-11-27T09:15:43.512Z"
    )
    return validate_run(request, data_bucket=DATA_BUCKET, max_shards=10)


def refusal(
    world: AwsWorld, class_name: Any, transformer: dict[str, Any] | None = None, **extra: Any
) -> dict[str, str]:
    with pytest.raises(InvalidRunDocument) as caught:
        validate(world, class_name, transformer, **extra)
    return {p["field"]: p["message"] for p in json.loads(str(caught.value))}


@pytest.mark.parametrize(
    ("class_name", "family"),
    [("StableDiffusionPipeline", "sd"), ("StableDiffusionXLPipeline", "sdxl"), ("StableDiffusion3Pipeline", "sd3")],
)
def test_validate_run_family_from_model_index_is_carried_in_config(
    mocked_aws: AwsWorld, class_name: str, family: str
) -> None:
    config = validate(mocked_aws, class_name)
    assert config["run"]["base_model_family"] == family
    stored = mocked_aws.get_json(f"runs/{EXECUTION}/run.json")
    assert stored["run"]["base_model_family"] == family


def test_validate_run_unknown_pipeline_class_is_refused_naming_class_and_families(mocked_aws: AwsWorld) -> None:
    message = refusal(mocked_aws, "FluxPipeline")["base_model_uri"]
    assert "'FluxPipeline'" in message
    assert "StableDiffusionXLPipeline (sdxl)" in message
    assert "StableDiffusion3Pipeline (sd3)" in message


def test_validate_run_model_index_without_class_is_refused(mocked_aws: AwsWorld) -> None:
    assert "no _class_name" in refusal(mocked_aws, None)["base_model_uri"]


def test_validate_run_stated_family_contradicting_model_is_refused(mocked_aws: AwsWorld) -> None:
    message = refusal(mocked_aws, "StableDiffusionPipeline", base_model_family="sdxl")["base_model_family"]
    assert "set base_model_family to 'sd' or 'auto'" in message


def test_validate_run_run_that_cannot_fit_its_gpu_is_refused_naming_changes(mocked_aws: AwsWorld) -> None:
    training = {"instance_type": "ml.g5.xlarge", "plugin": "torch_ddp", "resolution": 256, "train_batch_size": 8}
    found = refusal(mocked_aws, "StableDiffusionXLPipeline", training=training)
    message = found["training"]
    assert "SDXL full run" in message
    assert "NVIDIA A10G" in message
    assert "training.method lora" in message


def test_validate_run_cpu_instance_type_skips_memory_check(mocked_aws: AwsWorld) -> None:
    training = {"instance_type": "ml.m5.xlarge", "plugin": "torch_ddp", "train_batch_size": 1024}
    assert validate(mocked_aws, "StableDiffusion3Pipeline", training=training)["run"]["base_model_family"] == "sd3"


@pytest.mark.parametrize(
    ("class_name", "training", "field"),
    [
        ("StableDiffusionXLPipeline", {"cache_latents": True}, "training.cache_latents"),
        ("StableDiffusion3Pipeline", {"snr_gamma": 5.0}, "training.snr_gamma"),
        ("StableDiffusion3Pipeline", {"noise_offset": 0.1}, "training.noise_offset"),
        (
            "StableDiffusion3Pipeline",
            {"method": "lora", "lora": {"text_encoder": True}},
            "training.lora.text_encoder",
        ),
    ],
)
def test_validate_run_setting_the_family_cannot_train_is_refused_naming_field(
    mocked_aws: AwsWorld, class_name: str, training: dict[str, Any], field: str
) -> None:
    found = refusal(mocked_aws, class_name, training={"instance_type": "ml.m5.xlarge", **training})
    assert "set training." in found[field]


def test_validate_run_sd_family_keeps_cache_latents_and_snr(mocked_aws: AwsWorld) -> None:
    training = {"instance_type": "ml.m5.xlarge", "cache_latents": True, "snr_gamma": 5.0}
    assert validate(mocked_aws, "StableDiffusionPipeline", training=training)["run"]["training"]["cache_latents"]


def test_family_of_index_sd3_saved_without_t5_is_told_apart() -> None:
    index = {"_class_name": "StableDiffusion3Pipeline", "text_encoder_3": [None, None]}
    found = model_family.family_of_index(json.dumps(index).encode(), "s3://b/m/model_index.json")
    assert found == model_family.BaseModelIndex("sd3", with_t5=False)
    index["text_encoder_3"] = ["transformers", "T5EncoderModel"]
    assert model_family.family_of_index(json.dumps(index).encode(), "s3://b/m/model_index.json").with_t5
