"""model_checks at both doors (Validate run and start_pipeline's S3 upload): a base model missing a component its
model_index.json lists, LoRA target modules the denoiser lacks, a resolution off the family's multiple, and a
dataset too small for the run, each refused (or said) before any job starts."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sdflow_common import lora_modules, model_checks
from sdflow_common.errors import DatasetNotFound, InvalidRunDocument
from sdflow_common.start_pipeline import ManifestRef, handle_manifest, rejected_key
from sdflow_common.validate_run import ValidateRunRequest, validate_run
from tests.unit.helpers import DATA_BUCKET, STATE_MACHINE_ARN, AwsWorld
from tests.unit.parquet_files import parquet_bytes

MODEL = "models/base/"
MODEL_URI = f"s3://{DATA_BUCKET}/{MODEL}"
PARQUET_URI = f"s3://{DATA_BUCKET}/datasets/a.parquet"
# model_index.json of SDXL base 1.0 as diffusers saves it (force_zeros_for_empty_prompt is a setting).
SDXL_INDEX = {
    "_class_name": "StableDiffusionXLPipeline",
    "_diffusers_version": "0.29.0",
    "force_zeros_for_empty_prompt": True,
    "scheduler": ["diffusers", "EulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "CLIPTokenizer"],
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}
SD3_INDEX = {
    "_class_name": "StableDiffusion3Pipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
    "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
    "text_encoder_3": [None, None],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "CLIPTokenizer"],
    "tokenizer_3": [None, None],
    "transformer": ["diffusers", "SD3Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}
FLUX2_INDEX = {"_class_name": "Flux2KleinPipeline"}
# SD 1.5's, with its safety checker and the image processor that feeds it.
SD15_INDEX = {
    "_class_name": "StableDiffusionPipeline",
    "feature_extractor": ["transformers", "CLIPImageProcessor"],
    "requires_safety_checker": True,
    "safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"],
    "scheduler": ["diffusers", "PNDMScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}
# The files each kind of component is saved with (diffusers' and transformers' save_pretrained).
FILES = {
    "diffusers": ("config.json", "diffusion_pytorch_model.safetensors"),
    "transformers": ("config.json", "model.safetensors"),
    "scheduler": ("scheduler_config.json",),
    "tokenizer": ("tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json"),
    "processor": ("preprocessor_config.json",),
    "stable_diffusion": ("config.json", "model.safetensors"),
}


def component_files(library: str, class_name: str) -> tuple[str, ...]:
    if class_name.endswith("Scheduler"):
        return FILES["scheduler"]
    if "Tokenizer" in class_name:
        return FILES["tokenizer"]
    if class_name.endswith("Processor"):
        return FILES["processor"]
    return FILES[library]


def put_model(world: AwsWorld, index: dict[str, Any], *, leave_out: tuple[str, ...] = ()) -> None:
    """A diffusers folder whose components have their files, but the `leave_out` paths ("text_encoder_2/" a
    whole folder, "vae/config.json" one file)."""
    world.put_json(f"{MODEL}model_index.json", index)
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list) or value[0] is None:
            continue
        for file in component_files(*value):
            path = f"{name}/{file}"
            if path not in leave_out and f"{name}/" not in leave_out:
                world.s3.put_object(Bucket=DATA_BUCKET, Key=f"{MODEL}{path}", Body=b"{}")
    if index["_class_name"] == "Flux2KleinPipeline":
        world.put_json(f"{MODEL}transformer/config.json", {"num_attention_heads": 32})


def run_document(**training: Any) -> dict[str, Any]:
    return {
        "dataset": {"parquet_uris": [PARQUET_URI]},
        "base_model_uri": MODEL_URI,
        "training": {"instance_type": "ml.m5.xlarge", "train_batch_size": 1, **training},
        "evaluation": {"instance_type": "ml.m5.xlarge"},
        "endpoint": {"instance_type": "ml.m5.xlarge"},
    }


@pytest.fixture
def world(mocked_aws: AwsWorld) -> AwsWorld:
    mocked_aws.s3.put_object(Bucket=DATA_BUCKET, Key="datasets/a.parquet", Body=parquet_bytes(64))
    return mocked_aws


def validate(raw: dict[str, Any]) -> dict[str, Any]:
    request = ValidateRunRequest(
        run=raw, execution_name="r-1", execution_arn="arn:x", start_time="2026-01-01T00:00:00Z"
    )
    return validate_run(request, data_bucket=DATA_BUCKET, max_shards=50)


def refused_at_both_doors(world: AwsWorld, raw: dict[str, Any]) -> list[dict[str, str]]:
    """The problems Validate run refuses `raw` with, checked to be those start_pipeline's upload door reports."""
    with pytest.raises((InvalidRunDocument, DatasetNotFound)) as caught:
        validate(raw)
    at_validate: list[dict[str, str]] = json.loads(str(caught.value))
    put = world.s3.put_object(Bucket=DATA_BUCKET, Key="manifests/run.json", Body=json.dumps(raw).encode())
    ref = ManifestRef(DATA_BUCKET, "manifests/run.json", put.get("VersionId"), put["ETag"].strip('"'))
    outcome = handle_manifest(
        ref, state_machine_arn=STATE_MACHINE_ARN, topic_arn=world.topic_arn, max_shards=50, data_bucket=DATA_BUCKET
    )
    assert outcome.status == "rejected"
    assert world.get_json(rejected_key("manifests/run.json"))["errors"] == at_validate
    return at_validate


def by_field(problems: list[dict[str, str]]) -> dict[str, str]:
    return {p["field"]: p["message"] for p in problems}


# --- every component model_index.json lists ------------------------------------------------------------------


def test_model_sdxl_without_text_encoder_2_is_refused_at_both_doors_naming_uri_component_and_fix(
    world: AwsWorld,
) -> None:
    put_model(world, SDXL_INDEX, leave_out=("text_encoder_2/",))
    [problem] = refused_at_both_doors(world, run_document())
    assert problem["field"] == "base_model_uri"
    message = problem["message"]
    assert f"{MODEL_URI}model_index.json lists the component text_encoder_2 (CLIPTextModelWithProjection)" in message
    assert f"{MODEL_URI}text_encoder_2/ does not exist" in message
    assert f"aws s3 sync <model>/text_encoder_2/ {MODEL_URI}text_encoder_2/" in message


@pytest.mark.parametrize(
    ("leave_out", "component", "missing"),
    [
        (("unet/diffusion_pytorch_model.safetensors",), "unet", "has no weights"),
        (("vae/config.json",), "vae", "has no config.json"),
        (("scheduler/scheduler_config.json",), "scheduler", "does not exist"),
        (("tokenizer/tokenizer_config.json", "tokenizer/vocab.json"), "tokenizer", "has no its tokenizer files"),
        (("tokenizer_2/",), "tokenizer_2", "does not exist"),
    ],
)
def test_model_component_lacking_a_file_is_refused_naming_what_is_missing(
    world: AwsWorld, leave_out: tuple[str, ...], component: str, missing: str
) -> None:
    put_model(world, SDXL_INDEX, leave_out=leave_out)
    with pytest.raises(InvalidRunDocument) as caught:
        validate(run_document())
    message = by_field(json.loads(str(caught.value)))["base_model_uri"]
    assert f"the component {component} " in message
    assert f"{MODEL_URI}{component}/ {missing}" in message


def test_model_every_component_missing_is_named_once(world: AwsWorld) -> None:
    put_model(world, SDXL_INDEX, leave_out=("text_encoder/", "vae/"))
    with pytest.raises(InvalidRunDocument) as caught:
        validate(run_document())
    messages = [p["message"] for p in json.loads(str(caught.value)) if p["field"] == "base_model_uri"]
    assert len(messages) == 2
    assert "component text_encoder " in messages[0]
    assert "component vae " in messages[1]


def test_model_only_variant_weights_is_refused_naming_the_files_found(world: AwsWorld) -> None:
    put_model(world, SDXL_INDEX, leave_out=("unet/diffusion_pytorch_model.safetensors",))
    world.s3.put_object(Bucket=DATA_BUCKET, Key=f"{MODEL}unet/diffusion_pytorch_model.fp16.safetensors", Body=b"")
    with pytest.raises(InvalidRunDocument) as caught:
        validate(run_document())
    assert "diffusion_pytorch_model.fp16.safetensors" in by_field(json.loads(str(caught.value)))["base_model_uri"]


def test_model_sharded_weights_missing_a_shard_is_refused_naming_it(world: AwsWorld) -> None:
    put_model(world, SDXL_INDEX, leave_out=("unet/diffusion_pytorch_model.safetensors",))
    for name in ("diffusion_pytorch_model.safetensors.index.json", "diffusion_pytorch_model-00001-of-00003.safetensors",
                 "diffusion_pytorch_model-00003-of-00003.safetensors"):  # fmt: skip
        world.s3.put_object(Bucket=DATA_BUCKET, Key=f"{MODEL}unet/{name}", Body=b"")
    with pytest.raises(InvalidRunDocument) as caught:
        validate(run_document())
    assert "(00002 of 3)" in by_field(json.loads(str(caught.value)))["base_model_uri"]


def test_model_complete_sharded_and_without_t5_is_accepted(world: AwsWorld) -> None:
    put_model(world, SD3_INDEX, leave_out=("transformer/diffusion_pytorch_model.safetensors",))
    world.put_json(f"{MODEL}transformer/config.json", {"num_layers": 24})
    for name in ("diffusion_pytorch_model.safetensors.index.json", "diffusion_pytorch_model-00001-of-00002.safetensors",
                 "diffusion_pytorch_model-00002-of-00002.safetensors"):  # fmt: skip
        world.s3.put_object(Bucket=DATA_BUCKET, Key=f"{MODEL}transformer/{name}", Body=b"")
    assert validate(run_document())["run"]["base_model_family"] == "sd3"


def test_model_sd15_with_safety_checker_is_accepted_and_without_its_processor_config_refused(world: AwsWorld) -> None:
    put_model(world, SD15_INDEX)
    assert validate(run_document())["run"]["base_model_family"] == "sd"
    world.s3.delete_object(Bucket=DATA_BUCKET, Key=f"{MODEL}feature_extractor/preprocessor_config.json")
    world.s3.put_object(Bucket=DATA_BUCKET, Key=f"{MODEL}feature_extractor/README.md", Body=b"")
    with pytest.raises(InvalidRunDocument) as caught:
        validate(run_document())
    assert (
        f"{MODEL_URI}feature_extractor/ has no preprocessor_config.json or processor_config.json"
        in by_field(json.loads(str(caught.value)))["base_model_uri"]
    )


# --- LoRA target modules ---------------------------------------------------------------------------------------


def test_lora_targets_not_in_the_denoiser_are_refused_at_both_doors_with_the_valid_names(world: AwsWorld) -> None:
    put_model(world, SDXL_INDEX)
    raw = run_document(method="lora", lora={"target_modules": ["to_q", "to_qq", "no_such_proj"]})
    found = by_field(refused_at_both_doors(world, raw))
    assert set(found) == {"training.lora.target_modules.1", "training.lora.target_modules.2"}
    assert "'to_qq' names no Linear or Conv2d module in the sdxl denoiser" in found["training.lora.target_modules.1"]
    for name in ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "net.2"):
        assert name in found["training.lora.target_modules.2"]


def test_lora_target_naming_a_module_lora_cannot_adapt_is_refused_naming_it(world: AwsWorld) -> None:
    put_model(world, FLUX2_INDEX)
    raw = run_document(method="lora", plugin="ddp", lora={"target_modules": ["to_out", "attn"]})
    found = by_field(refused_at_both_doors(world, raw))
    assert (
        "'to_out' also names transformer_blocks.0.attn.to_out, a module LoRA cannot adapt"
        in found["training.lora.target_modules.0"]
    )
    assert "'attn' names no Linear or Conv2d module in the flux2 denoiser" in found["training.lora.target_modules.1"]


@pytest.mark.parametrize(
    "targets",
    [
        ["to_q", "to_out.0"],
        ["attn1.to_q", "mid_block.attentions.0.transformer_blocks.9.attn2.to_k", "proj_in", "conv1"],
    ],
)
def test_lora_targets_as_peft_matches_them_are_accepted(world: AwsWorld, targets: list[str]) -> None:
    put_model(world, SDXL_INDEX)
    config = validate(run_document(method="lora", lora={"target_modules": targets}))
    assert config["run"]["training"]["lora"]["target_modules"] == targets


def test_lora_targets_of_flux2_4b_are_checked_against_the_4b_transformer(world: AwsWorld) -> None:
    put_model(world, FLUX2_INDEX)
    world.put_json(f"{MODEL}transformer/config.json", {"num_attention_heads": 24})
    raw = run_document(
        method="lora", plugin="ddp", lora={"target_modules": ["single_transformer_blocks.23.attn.to_out"]}
    )
    # the 9B has 24 single blocks, the 4B 20
    assert (
        "names no Linear or Conv2d module in the flux2 denoiser"
        in by_field(refused_at_both_doors(world, raw))["training.lora.target_modules.0"]
    )


def test_lora_module_names_of_every_family_and_variant_are_held() -> None:
    for family, variant in [("sd", ""), ("sdxl", ""), ("sd3", ""), ("sd35", ""), ("sd35", "medium"), ("flux2", ""),
                            ("flux2", "4b"), ("qwenimage", "")]:  # fmt: skip
        names = lora_modules.module_names(family, variant)
        assert names is not None, (family, variant)
        assert names.problem("to_q") is None
        assert names.problem("to_qq") is not None


def test_lora_modules_compress_expands_to_exactly_its_names() -> None:
    names = {"a.0.b", "a.1.b", "a.2.b", "a.4.b", "a.0.c", "x", "y.3.z.1", "y.3.z.2", "y.5.z.1"}
    templates = lora_modules.compress(names)
    assert lora_modules.expand(templates) == names
    assert "a.{0-2,4}.b" in templates


# --- resolution ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("index", "resolution", "multiple", "choices"),
    [(SDXL_INDEX, 36, 8, "32 or 40"), (SD3_INDEX, 40, 16, "32 or 48"), (FLUX2_INDEX, 1000, 16, "992 or 1008")],
)
def test_resolution_off_the_family_multiple_is_refused_at_both_doors_with_nearest_values(
    world: AwsWorld, index: dict[str, Any], resolution: int, multiple: int, choices: str
) -> None:
    put_model(world, index)
    if index is SD3_INDEX:
        world.put_json(f"{MODEL}transformer/config.json", {"num_layers": 24})
    extra = {"plugin": "ddp", "method": "lora"} if index is FLUX2_INDEX else {}
    raw = {**run_document(resolution=resolution, **extra), "download": {"image_size": 1024}}
    message = by_field(refused_at_both_doors(world, raw))["training.resolution"]
    assert f"is {resolution}, and a " in message
    assert f"multiple of {multiple} pixels" in message
    assert message.endswith(f"set training.resolution to {choices}")


def test_resolution_nearest_multiples_stay_within_the_schema_range() -> None:
    assert model_checks.nearest_multiples(2047, 16) == [2032, 2048]
    assert model_checks.nearest_multiples(36, 16) == [32, 48]
    assert model_checks.nearest_multiples(33, 64) == [64]


# --- the dataset against the batch -----------------------------------------------------------------------------


def test_dataset_fewer_rows_than_training_processes_is_refused_at_both_doors(world: AwsWorld) -> None:
    world.s3.put_object(Bucket=DATA_BUCKET, Key="datasets/a.parquet", Body=parquet_bytes(3))
    put_model(world, SDXL_INDEX)
    raw = run_document(instance_count=4)  # four one-process CPU instances
    message = by_field(refused_at_both_doors(world, raw))["training.instance_count"]
    assert "the dataset has 3 rows, fewer than the 4 training processes" in message


def test_dataset_smaller_than_the_global_batch_is_said_in_the_warnings(world: AwsWorld) -> None:
    world.s3.put_object(Bucket=DATA_BUCKET, Key="datasets/a.parquet", Body=parquet_bytes(10))
    put_model(world, SDXL_INDEX)
    config = validate(run_document(instance_count=2, train_batch_size=8))
    [warning] = [w for w in config["warnings"] if w["field"] == "training.train_batch_size"]
    assert "global batch is 16 samples (8 per GPU x 2 processes)" in warning["message"]
    assert "at most 5" in warning["message"]


def test_dataset_batch_global_batch_counts_every_gpu_of_every_instance(world: AwsWorld) -> None:
    put_model(world, SDXL_INDEX)
    config = validate(run_document(instance_type="ml.g5.12xlarge", instance_count=2, train_batch_size=16))
    [warning] = [w for w in config["warnings"] if w["field"] == "training.train_batch_size"]
    assert "global batch is 128 samples (16 per GPU x 8 processes)" in warning["message"]


def test_dataset_holding_one_global_batch_has_no_batch_warning(world: AwsWorld) -> None:
    put_model(world, SDXL_INDEX)
    config = validate(run_document(instance_count=2, train_batch_size=8))
    assert [w for w in config["warnings"] if w["field"] == "training.train_batch_size"] == []
