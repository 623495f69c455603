"""training.method and training.lora: defaults as diffusers' LoRA examples, strict checks naming the field,
and the hyperparameters the image reads (the contract of docs/contracts.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sdflow_common import sagemaker_jobs
from sdflow_common.errors import InvalidRunDocument
from sdflow_common.run_document import HYPERPARAMETER_VALUE_LIMIT, RunDocument, parse_run_document
from tests.unit.job_requests import assert_valid_request

BUCKET = "sdflow-data-test"


def document(**training: Any) -> dict[str, Any]:
    return {
        "dataset": {"parquet_uris": [f"s3://{BUCKET}/datasets/a.parquet"]},
        "base_model_uri": f"s3://{BUCKET}/models/sdxl/",
        "training": training,
    }


def problems(raw: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(InvalidRunDocument) as caught:
        parse_run_document(raw)
    return {p["field"]: p["message"] for p in json.loads(str(caught.value))}


def request(run: RunDocument) -> Any:
    return sagemaker_jobs.training_job_request(
        job_name="sdf-0123456789-train-r0-a0",
        run_id="run-1",
        run_hash="0123456789",
        bucket=BUCKET,
        dataset_prefix_uri=f"s3://{BUCKET}/runs/run-1/dataset/",
        run=run,
        image_uri="123456789012.dkr.ecr.eu-west-1.amazonaws.com/sdflow:latest",
        role_arn="arn:aws:iam::123456789012:role/sdflow",
    )


def test_training_method_default_is_full_with_lora_defaults_in_hyperparameters() -> None:
    options = parse_run_document(document() | {"base_model_family": "sdxl"}).training
    hyperparameters = options.hyperparameters()
    assert options.method == "full"
    assert options.plugin == "gemini"
    assert hyperparameters["training_method"] == "full"
    assert hyperparameters["lora_rank"] == "4"


def test_training_lora_without_block_takes_diffusers_defaults_and_torch_ddp() -> None:
    options = parse_run_document(document(method="lora") | {"base_model_family": "sdxl"}).training
    assert options.plugin == "torch_ddp"
    assert (
        options.hyperparameters().items()
        >= {
            "training_method": "lora",
            "lora_rank": "4",
            "lora_alpha": "4",
            "lora_dropout": "0",
            "lora_target_modules": "",
            "train_text_encoder_lora": "false",
        }.items()
    )


def test_training_lora_block_is_emitted_as_strings() -> None:
    lora = {"rank": 16, "alpha": 8.5, "dropout": 0.1, "target_modules": ["to_q", "to_out.0"], "text_encoder": True}
    hyperparameters = parse_run_document(document(method="lora", lora=lora)).training.hyperparameters()
    assert hyperparameters["lora_rank"] == "16"
    assert hyperparameters["lora_alpha"] == "8.5"
    assert hyperparameters["lora_dropout"] == "0.1"
    assert hyperparameters["lora_target_modules"] == "to_q,to_out.0"
    assert hyperparameters["train_text_encoder_lora"] == "true"


def test_training_lora_with_gemini_is_refused_naming_the_plugin_that_can() -> None:
    found = problems(document(method="lora", plugin="gemini"))
    message = found["training.plugin"]
    assert "support_lora() False" in message
    assert "set training.plugin to torch_ddp" in message


def test_training_lora_with_low_level_zero_is_refused_with_the_reason() -> None:
    message = problems(document(method="lora", plugin="low_level_zero"))["training.plugin"]
    assert "Booster.enable_lora" in message
    assert "set training.plugin to torch_ddp" in message


@pytest.mark.parametrize("plugin", ["torch_ddp", "low_level_zero", "gemini"])
def test_lora_plugin_rule_validate_run_and_image_agree(plugin: str) -> None:
    """Validate run refuses what the training job would refuse at its start, and nothing more: the
    layer cannot import the image, so the two tables are held equal here."""
    from sdflow_common import training_options
    from sdflow_image.families import base

    assert (plugin in training_options.LORA_PLUGINS) == (base.lora_plugin_refusal(plugin) is None)
    assert (plugin in training_options.LORA_REFUSALS) == (plugin in base.LORA_REFUSALS)


def test_training_lora_block_with_full_method_is_refused() -> None:
    assert "set training.method to 'lora'" in problems(document(lora={"rank": 8}))["training.lora"]


def test_training_gemini_in_fp32_is_refused() -> None:
    assert "fp16 or bf16" in problems(document(mixed_precision="no", backend="colossalai"))["training.plugin"]


@pytest.mark.parametrize(
    ("lora", "field", "words"),
    [
        ({"rank": 0}, "training.lora.rank", "greater than or equal to 1"),
        ({"dropout": 1}, "training.lora.dropout", "less than 1"),
        ({"alpha": 0}, "training.lora.alpha", "greater than 0"),
        ({"target_modules": []}, "training.lora.target_modules", "family's default"),
        ({"target_modules": ["to_q", "to_q"]}, "training.lora.target_modules", "twice"),
        ({"target_modules": ["to q"]}, "training.lora.target_modules.0", "dotted path"),
        ({"rnak": 8}, "training.lora.rnak", "did you mean `rank`"),
    ],
)
def test_training_lora_bad_value_names_field_and_fix(lora: dict[str, Any], field: str, words: str) -> None:
    found = problems(document(method="lora", lora=lora))
    assert words in found[field]


def test_training_lora_targets_over_hyperparameter_limit_are_refused() -> None:
    targets = [f"block_{i:03d}.attn.to_q_projection_{'x' * 40}" for i in range(60)]
    assert len(",".join(targets)) > HYPERPARAMETER_VALUE_LIMIT
    assert (
        str(HYPERPARAMETER_VALUE_LIMIT)
        in problems(document(method="lora", lora={"target_modules": targets}))["training.lora.target_modules"]
    )


def test_training_request_carries_family_base_model_and_lora_within_sagemaker_limits() -> None:
    raw = document(method="lora", lora={"target_modules": ["to_k", "to_q", "to_v", "to_out.0"]})
    run = parse_run_document(raw | {"base_model_family": "sdxl"})
    built = request(run)
    hyperparameters = built["HyperParameters"]
    assert hyperparameters["model_family"] == "sdxl"
    assert hyperparameters["base_model_uri"] == f"s3://{BUCKET}/models/sdxl/"
    assert hyperparameters["training_method"] == "lora"
    assert_valid_request("CreateTrainingJob", dict(built))


def test_training_request_of_unresolved_family_leaves_model_family_out() -> None:
    hyperparameters = request(parse_run_document(document()))["HyperParameters"]
    assert "model_family" not in hyperparameters
    assert hyperparameters["base_model_uri"] == f"s3://{BUCKET}/models/sdxl/"


def test_training_lora_with_ema_is_refused() -> None:
    assert "set training.use_ema to false" in problems(document(method="lora", use_ema=True))["training.use_ema"]
