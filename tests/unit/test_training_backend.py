"""training.backend and the accelerate plugins: defaults by family and method, refusals that name the field and
the fix, the families Validate run tells apart by transformer/config.json, and the image each backend's jobs
and model package use."""

from __future__ import annotations

import copy
import json
from typing import Any

# The X-Ray SDK opens its UDP emitter's socket on first import: import it before sockets are disabled.
import aws_xray_sdk.core  # noqa: F401
import pytest

from sdflow_common import model_family, training_options
from sdflow_common.errors import DatasetNotFound, InvalidRunDocument
from sdflow_common.evaluation import EvaluationTask, evaluation_job_request
from sdflow_common.model_registry import RegisterTask, model_package_request
from sdflow_common.run_document import parse_run_document
from sdflow_common.settings import Settings
from sdflow_common.validate_run import ValidateRunRequest, validate_run
from tests.constants import ACCOUNT, REGION
from tests.helpers import load_function_module
from tests.unit.helpers import (
    ACCELERATE_IMAGE_URI,
    DATA_BUCKET,
    STATE_MACHINE_NAME,
    TRAINING_IMAGE_URI,
    AwsWorld,
    FakeLambdaContext,
    load_event,
)
from tests.unit.job_requests import assert_valid_request, training_name
from tests.unit.parquet_files import parquet_bytes

EXECUTION = "backend-0123456789abcdef"
EXECUTION_ARN = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:{STATE_MACHINE_NAME}:{EXECUTION}"
MODEL_URI = f"s3://{DATA_BUCKET}/models/base/"
CLASS_OF_FAMILY = {
    "sd": ("StableDiffusionPipeline", None),
    "sdxl": ("StableDiffusionXLPipeline", None),
    "sd3": ("StableDiffusion3Pipeline", {"num_layers": 24}),
    "sd35": ("StableDiffusion3Pipeline", {"num_layers": 38, "qk_norm": "rms_norm"}),
    "flux2": ("Flux2KleinPipeline", {"num_attention_heads": 32}),
    "qwenimage": ("QwenImagePipeline", None),
}


def document(family: str = "auto", **training: Any) -> dict[str, Any]:
    return {
        "dataset": {"parquet_uris": [f"s3://{DATA_BUCKET}/datasets/a.parquet"]},
        "base_model_uri": MODEL_URI,
        "base_model_family": family,
        "training": training,
    }


def problems(raw: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(InvalidRunDocument) as caught:
        parse_run_document(raw)
    return {p["field"]: p["message"] for p in json.loads(str(caught.value))}


def put_model(world: AwsWorld, class_name: str, transformer: dict[str, Any] | None) -> None:
    world.put_json("models/base/model_index.json", {"_class_name": class_name})
    if transformer is not None:
        world.put_json("models/base/transformer/config.json", transformer)


def validate(world: AwsWorld, **training: Any) -> dict[str, Any]:
    world.s3.put_object(Bucket=DATA_BUCKET, Key="datasets/a.parquet", Body=parquet_bytes())
    run = document(**{"instance_type": "ml.m5.xlarge", **training})
    # Every job on CPU, as the training: the default ml.g5.xlarge cannot hold the new families' evaluation or
    # endpoint pipeline (model_family.check_instances).
    run |= {"evaluation": {"instance_type": "ml.m5.xlarge"}, "endpoint": {"instance_type": "ml.m5.large"}}
    del run["base_model_family"]
    request = ValidateRunRequest(
        run=run, execution_name=EXECUTION, execution_arn=EXECUTION_ARN, start_time="2026-11-27T09:15:43.512Z"
    )
    return validate_run(request, data_bucket=DATA_BUCKET, max_shards=10)


def refusal(world: AwsWorld, **training: Any) -> dict[str, str]:
    with pytest.raises(InvalidRunDocument) as caught:
        validate(world, **training)
    return {p["field"]: p["message"] for p in json.loads(str(caught.value))}


# ---------------------------------------------------------------------------- defaults


@pytest.mark.parametrize(("family", "backend"), sorted(training_options.BACKEND_OF_FAMILY.items()))
@pytest.mark.parametrize(
    ("method", "colossalai_plugin", "accelerate_plugin"), [("full", "gemini", "fsdp2"), ("lora", "torch_ddp", "ddp")]
)
def test_backend_default_by_family_and_plugin_by_method(
    family: str, backend: str, method: str, colossalai_plugin: str, accelerate_plugin: str
) -> None:
    training = parse_run_document(document(family, method=method)).training
    assert training.backend == backend
    assert training.plugin == (accelerate_plugin if backend == "accelerate" else colossalai_plugin)
    assert training.mixed_precision == ("bf16" if backend == "accelerate" else "fp16")


def test_backend_of_unresolved_family_waits_for_validate_run_and_leaves_hyperparameters_to_the_image() -> None:
    training = parse_run_document(document()).training
    assert (training.backend, training.plugin) == ("auto", "auto")
    assert not {"backend", "plugin"} & set(training.hyperparameters())


def test_backend_accelerate_named_for_an_sd3_model_trains_there_with_its_plugin_and_given_precision() -> None:
    training = parse_run_document(document("sd3", backend="accelerate", mixed_precision="no")).training
    assert (training.backend, training.plugin, training.mixed_precision) == ("accelerate", "fsdp2", "no")
    hyperparameters = training.hyperparameters()
    assert (hyperparameters["backend"], hyperparameters["plugin"]) == ("accelerate", "fsdp2")


def test_backend_accelerate_in_fp16_is_refused_naming_bf16() -> None:
    message = problems(document("flux2", mixed_precision="fp16"))["training.mixed_precision"]
    assert "set training.mixed_precision to 'bf16'" in message


def test_backend_fsdp2_with_ema_is_refused_naming_ddp_and_use_ema() -> None:
    message = problems(document("flux2", use_ema=True))["training.use_ema"]
    assert "set training.plugin to 'ddp'" in message
    assert "training.use_ema to false" in message


def test_backend_rules_cover_every_family_plugin_and_method() -> None:
    families = set(model_family.FAMILY_OF_CLASS.values()) | {"sd35"}
    assert set(training_options.BACKEND_OF_FAMILY) == families
    assert set(training_options.NEW_STACK_FAMILIES) == {
        f for f, backend in training_options.BACKEND_OF_FAMILY.items() if backend == "accelerate"
    }
    for backend, plugins in training_options.DEFAULT_PLUGIN.items():
        assert set(plugins) == {"full", "lora"}
        assert set(plugins.values()) <= set(training_options.PLUGINS_OF_BACKEND[backend])
    for backend, precision in training_options.DEFAULT_MIXED_PRECISION.items():
        assert precision in training_options.MIXED_PRECISIONS_OF_BACKEND[backend]


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("family", training_options.NEW_STACK_FAMILIES)
def test_backend_colossalai_for_a_new_family_is_refused_naming_accelerate(family: str) -> None:
    message = problems(document(family, backend="colossalai"))["training.backend"]
    assert "diffusers 0.29" in message
    assert "set training.backend to 'accelerate'" in message


@pytest.mark.parametrize("plugin", ["torch_ddp", "low_level_zero", "gemini"])
def test_backend_accelerate_with_a_colossalai_plugin_is_refused_naming_both_fixes(plugin: str) -> None:
    message = problems(document(backend="accelerate", plugin=plugin))["training.plugin"]
    assert f"'{plugin}' is a plugin of the colossalai backend" in message
    assert "set training.backend to 'colossalai', or training.plugin to one of ddp, fsdp2" in message


@pytest.mark.parametrize("plugin", ["ddp", "fsdp2"])
def test_backend_colossalai_with_an_accelerate_plugin_is_refused_naming_both_fixes(plugin: str) -> None:
    message = problems(document(backend="colossalai", plugin=plugin))["training.plugin"]
    assert "set training.backend to 'accelerate'" in message
    assert "torch_ddp, low_level_zero, gemini" in message


def test_backend_default_of_an_sd_model_with_an_accelerate_plugin_is_refused() -> None:
    assert "set training.backend to 'accelerate'" in problems(document("sd", plugin="fsdp2"))["training.plugin"]


def test_backend_lora_with_fsdp2_is_refused_naming_ddp() -> None:
    message = problems(document("flux2", method="lora", plugin="fsdp2"))["training.plugin"]
    assert "gains nothing from sharding" in message
    assert "set training.plugin to ddp" in message


def test_backend_full_with_ddp_is_accepted() -> None:
    assert parse_run_document(document("flux2", plugin="ddp")).training.plugin == "ddp"


# ---------------------------------------------------------------------------- Validate run


@pytest.mark.parametrize("family", sorted(CLASS_OF_FAMILY))
def test_validate_run_resolves_family_backend_and_plugin_into_the_run(mocked_aws: AwsWorld, family: str) -> None:
    put_model(mocked_aws, *CLASS_OF_FAMILY[family])
    run = validate(mocked_aws)["run"]
    backend = training_options.BACKEND_OF_FAMILY[family]
    assert run["base_model_family"] == family
    assert run["training"]["backend"] == backend
    assert run["training"]["plugin"] == training_options.DEFAULT_PLUGIN[backend]["full"]
    assert mocked_aws.get_json(f"runs/{EXECUTION}/run.json")["run"]["training"]["backend"] == backend


def test_validate_run_new_family_on_colossalai_is_refused_once_the_model_says_what_it_is(
    mocked_aws: AwsWorld,
) -> None:
    put_model(mocked_aws, *CLASS_OF_FAMILY["sd35"])
    assert "set training.backend to 'accelerate'" in refusal(mocked_aws, backend="colossalai")["training.backend"]


def test_validate_run_sd_model_with_fsdp2_is_refused_naming_plugin(mocked_aws: AwsWorld) -> None:
    put_model(mocked_aws, *CLASS_OF_FAMILY["sd"])
    assert "set training.backend to 'accelerate'" in refusal(mocked_aws, plugin="fsdp2")["training.plugin"]


def test_validate_run_sd3_model_without_transformer_config_is_not_found_naming_the_file(mocked_aws: AwsWorld) -> None:
    put_model(mocked_aws, "StableDiffusion3Pipeline", None)
    with pytest.raises(DatasetNotFound) as caught:
        validate(mocked_aws)
    [problem] = json.loads(str(caught.value))
    assert problem["field"] == "base_model_uri"
    assert problem["message"].startswith(f"{MODEL_URI}transformer/config.json does not exist or is not readable")


def test_validate_run_transformer_config_that_is_no_json_object_is_refused(mocked_aws: AwsWorld) -> None:
    mocked_aws.put_json("models/base/model_index.json", {"_class_name": "Flux2KleinPipeline"})
    mocked_aws.s3.put_object(Bucket=DATA_BUCKET, Key="models/base/transformer/config.json", Body=b"[1, 2")
    assert "transformer/config.json is not a JSON object" in refusal(mocked_aws)["base_model_uri"]


def test_validate_run_stated_sd3_for_an_sd35_model_is_refused(mocked_aws: AwsWorld) -> None:
    put_model(mocked_aws, *CLASS_OF_FAMILY["sd35"])
    mocked_aws.s3.put_object(Bucket=DATA_BUCKET, Key="datasets/a.parquet", Body=parquet_bytes())
    raw = document("sd3", instance_type="ml.m5.xlarge")
    request = ValidateRunRequest(
        run=raw, execution_name=EXECUTION, execution_arn=EXECUTION_ARN, start_time="2026-11-27T09:15:43.512Z"
    )
    with pytest.raises(InvalidRunDocument) as caught:
        validate_run(request, data_bucket=DATA_BUCKET, max_shards=10)
    assert "set base_model_family to 'sd35' or 'auto'" in str(caught.value)


@pytest.mark.parametrize(
    ("transformer", "family", "variant"),
    [
        ({"qk_norm": None, "num_layers": 24}, "sd3", ""),
        ({"qk_norm": "rms_norm", "num_layers": 38}, "sd35", ""),
        ({"qk_norm": "rms_norm", "dual_attention_layers": [0, 1, 2]}, "sd35", "medium"),
    ],
)
def test_family_of_transformer_tells_sd3_from_sd35_large_and_medium(
    transformer: dict[str, Any], family: str, variant: str
) -> None:
    index = model_family.BaseModelIndex("sd3", with_t5=False)
    found = model_family.family_of_transformer(index, json.dumps(transformer).encode(), "s3://b/m/transformer/c")
    assert (found.family, found.variant, found.with_t5) == (family, variant, False)


@pytest.mark.parametrize(("heads", "variant"), [(24, "4b"), (32, ""), (None, "")])
def test_family_of_transformer_tells_flux2_4b_from_9b(heads: int | None, variant: str) -> None:
    index = model_family.BaseModelIndex("flux2", with_t5=False)
    body = json.dumps({"num_attention_heads": heads}).encode()
    assert model_family.family_of_transformer(index, body, "s3://b/m/transformer/c").variant == variant


@pytest.mark.parametrize(
    ("family", "training", "field", "words"),
    [
        ("flux2", {"snr_gamma": 5.0}, "training.snr_gamma", "a FLUX.2 [klein] model trains on rectified flow"),
        ("qwenimage", {"noise_offset": 0.1}, "training.noise_offset", "a Qwen-Image model"),
        ("sd3", {"cache_latents": True}, "training.cache_latents", "set training.cache_latents to false"),
        (
            "qwenimage",
            {"method": "lora", "lora": {"text_encoder": True}},
            "training.lora.text_encoder",
            "on the transformer only",
        ),
    ],
)
def test_validate_run_new_family_setting_it_cannot_train_is_refused_naming_field(
    mocked_aws: AwsWorld, family: str, training: dict[str, Any], field: str, words: str
) -> None:
    put_model(mocked_aws, *CLASS_OF_FAMILY[family])
    assert words in refusal(mocked_aws, **training)[field]


@pytest.mark.parametrize("family", ["flux2", "qwenimage", "sd35"])
def test_validate_run_new_family_keeps_cache_latents(mocked_aws: AwsWorld, family: str) -> None:
    put_model(mocked_aws, *CLASS_OF_FAMILY[family])
    config = validate(mocked_aws, cache_latents=True)
    assert config["run"]["base_model_family"] == family
    assert config["run"]["training"]["cache_latents"] is True


def test_cache_families_validate_run_and_image_agree() -> None:
    """Validate run refuses cache_latents for the families the training job refuses it for (train.py's
    check_family), and for no other: the layer cannot import the image, so they are held equal here."""
    from sdflow_image.training import train

    assert model_family.CACHE_FAMILIES == train.CACHE_FAMILIES


# ---------------------------------------------------------------------------- the backend's image


def on_accelerate(event: dict[str, Any]) -> dict[str, Any]:
    """The event's run as a FLUX.2 run, on the accelerate backend by default."""
    event = copy.deepcopy(event)
    run = event["config"]["run"]
    run["base_model_family"] = "flux2"
    # The colossalai run's plugin and precision (fp16) are not the accelerate backend's: its defaults instead.
    dropped = ("plugin", "backend", "mixed_precision", "use_ema")
    run["training"] = {k: v for k, v in run["training"].items() if k not in dropped}
    return event


def test_settings_image_uri_per_backend(aws_env: None) -> None:
    settings = Settings.from_env()
    assert settings.image_uri("colossalai") == TRAINING_IMAGE_URI
    assert settings.image_uri("auto") == TRAINING_IMAGE_URI
    assert settings.image_uri("accelerate") == ACCELERATE_IMAGE_URI


def test_settings_image_uri_of_accelerate_without_its_variable_names_it(
    aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ACCELERATE_IMAGE_URI")
    with pytest.raises(RuntimeError, match="ACCELERATE_IMAGE_URI is not set"):
        Settings.from_env().image_uri("accelerate")


@pytest.mark.parametrize(("accelerate", "image"), [(False, TRAINING_IMAGE_URI), (True, ACCELERATE_IMAGE_URI)])
def test_start_training_job_runs_the_image_of_the_runs_backend(
    mocked_aws: AwsWorld, events_execution: str, accelerate: bool, image: str
) -> None:
    event = load_event("start_training_task.json")
    event = on_accelerate(event) if accelerate else event
    load_function_module("start_training").lambda_handler(event, FakeLambdaContext())
    job = mocked_aws.sagemaker.describe_training_job(TrainingJobName=training_name(event))
    assert job["AlgorithmSpecification"]["TrainingImage"] == image
    assert job["HyperParameters"]["backend"] == ("accelerate" if accelerate else "colossalai")
    assert job["HyperParameters"]["plugin"] == ("fsdp2" if accelerate else "gemini")


@pytest.mark.parametrize(("accelerate", "image"), [(False, TRAINING_IMAGE_URI), (True, ACCELERATE_IMAGE_URI)])
def test_start_evaluation_job_runs_the_image_of_the_runs_backend(
    mocked_aws: AwsWorld, events_execution: str, accelerate: bool, image: str
) -> None:
    event = load_event("start_evaluation_task.json")
    event = on_accelerate(event) if accelerate else event
    result = load_function_module("start_evaluation").lambda_handler(event, FakeLambdaContext())
    job = mocked_aws.sagemaker.describe_processing_job(ProcessingJobName=result["resource_name"])
    assert job["AppSpecification"]["ImageUri"] == image


def test_evaluation_job_request_of_an_accelerate_run_is_valid(aws_env: None) -> None:
    task = EvaluationTask.model_validate(on_accelerate(load_event("start_evaluation_task.json")))
    request = evaluation_job_request(
        job_name="sdf-ev-x-r0-a0",
        config=task.config,
        run_hash="abc",
        model_data_url=task.training.model_data_url,
        prompts_uri=None,
        image_uri=Settings.from_env().image_uri(task.config.run.training.backend),
        role_arn="arn:aws:iam::123456789012:role/job",
    )
    assert request["AppSpecification"]["ImageUri"] == ACCELERATE_IMAGE_URI
    assert_valid_request("CreateProcessingJob", request)


@pytest.mark.parametrize(
    ("accelerate", "image", "backend", "family"),
    [(False, TRAINING_IMAGE_URI, "colossalai", "sd"), (True, ACCELERATE_IMAGE_URI, "accelerate", "flux2")],
)
def test_model_package_serves_the_image_of_the_runs_backend_and_records_backend_image_and_family(
    aws_env: None, accelerate: bool, image: str, backend: str, family: str
) -> None:
    event = load_event("register_model_task.json")
    event = on_accelerate(event) if accelerate else event
    scores = {"prompt_adherence": 0.8, "base_prompt_adherence": 0.1, "prompts": 48}
    request = model_package_request(
        RegisterTask.model_validate(event), Settings.from_env(), "sdf-g", "Approved", scores
    )
    assert request["InferenceSpecification"]["Containers"][0]["Image"] == image
    metadata = request["CustomerMetadataProperties"]
    assert metadata["sdflow:training_backend"] == backend
    assert metadata["sdflow:image"] == image
    assert metadata["sdflow:model_family"] == family
    assert_valid_request("CreateModelPackage", request)


def test_backend_rules_validate_run_and_image_agree() -> None:
    """Validate run (the layer) and the training job (backends/rules.py) refuse and default alike:
    the layer cannot import the image, so the two rule sets are held equal here. Only colossalai's
    full default differs on purpose: the run document's gemini, the image flag's torch_ddp."""
    from sdflow_common import training_options as layer
    from sdflow_image.backends import rules as image

    assert layer.BACKENDS == image.BACKENDS
    assert layer.NEW_STACK_FAMILIES == image.NEW_STACK_FAMILIES
    assert layer.BACKEND_OF_FAMILY == image.BACKEND_OF_FAMILY
    assert layer.PLUGINS_OF_BACKEND == image.PLUGINS_OF_BACKEND
    assert layer.MIXED_PRECISIONS_OF_BACKEND == image.MIXED_PRECISIONS_OF_BACKEND
    assert layer.DEFAULT_PLUGIN["accelerate"] == image.DEFAULT_PLUGIN["accelerate"]
    assert layer.DEFAULT_PLUGIN["colossalai"]["lora"] == image.DEFAULT_PLUGIN["colossalai"]["lora"]
    refused = {**layer.LORA_REFUSALS, **layer.LORA_REFUSALS_ACCELERATE}
    assert set(refused) == set(image.LORA_REFUSALS)
    assert set(layer.LORA_PLUGINS) == set(image.PLUGINS) - set(image.LORA_REFUSALS)
