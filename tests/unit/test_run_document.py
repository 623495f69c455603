"""The run document: every manifest error names its field; defaults; the committed schema is current."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel

from sdflow_common.errors import InvalidRunDocument
from sdflow_common.run_document import (
    MAX_DOCUMENT_BYTES,
    RunDocument,
    json_schema,
    main,
    parse_run_document,
    parse_s3_uri,
    schema_text,
)
from tests.unit.helpers import load_event

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "schemas" / "run-document.schema.json"
BUCKET = "sdflow-data-test"


def minimal() -> dict[str, Any]:
    return {
        "dataset": {"parquet_uris": [f"s3://{BUCKET}/datasets/a.parquet"]},
        "base_model_uri": f"s3://{BUCKET}/models/sd/",
    }


def errors_of(raw: Any, **kwargs: Any) -> list[dict[str, str]]:
    with pytest.raises(InvalidRunDocument) as caught:
        parse_run_document(raw, **kwargs)
    errors = json.loads(str(caught.value))
    assert errors, "InvalidRunDocument must carry at least one problem"
    return errors


def fields_of(raw: Any, **kwargs: Any) -> set[str]:
    return {error["field"] for error in errors_of(raw, **kwargs)}


def test_parse_minimal_document_fills_every_default() -> None:
    document = parse_run_document(minimal())
    assert document.schema_version == 1
    assert document.run_name is None
    assert document.dataset.url_column == "URL"
    assert document.dataset.caption_column == "TEXT"
    assert document.download.image_size == 256
    assert document.download.tolerated_failure_percent == 10.0
    assert document.download.max_concurrency == 10
    assert document.training.instance_count == 1
    assert document.training.use_spot is False
    assert document.training.max_wait_seconds is None
    # Backend and plugin wait for the family (Validate run reads it from the model).
    assert (document.training.backend, document.training.plugin) == ("auto", "auto")
    assert document.training.validation_prompts == ["a photo of a cat"]
    assert document.endpoint.name == "sdflow"


def test_parse_defaults_round_trip_through_json_unchanged() -> None:
    document = parse_run_document(minimal())
    dumped = document.model_dump(mode="json")
    assert RunDocument.model_validate(json.loads(json.dumps(dumped))) == document


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"colour": "blue"}, "colour"),
        (
            {"dataset": {"parquet_uris": [f"s3://{BUCKET}/a.parquet"], "prefixx": "s3://b/x/"}},
            "dataset.prefixx",
        ),
        ({"training": {"epochs": 3}}, "training.epochs"),
        ({"download": {"image_sise": 256}}, "download.image_sise"),
        ({"endpoint": {"instance": "ml.g5.xlarge"}}, "endpoint.instance"),
    ],
)
def test_parse_unknown_field_is_named(patch: dict[str, Any], field: str) -> None:
    raw = {**minimal(), **patch}
    errors = errors_of(raw)
    assert field in {e["field"] for e in errors}
    message = next(e["message"] for e in errors if e["field"] == field)
    assert "unknown field" in message


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"base_model_uri": "https://huggingface.co/runwayml/sd"}, "base_model_uri"),
        ({"base_model_uri": "gs://bucket/models/sd/"}, "base_model_uri"),
        ({"dataset": {"parquet_uris": ["http://example.com/a.parquet"]}}, "dataset.parquet_uris"),
        ({"dataset": {"parquet_uris": ["/local/a.parquet"]}}, "dataset.parquet_uris"),
        ({"dataset": {"prefix": "file:///data/"}}, "dataset.prefix"),
    ],
)
def test_parse_wrong_uri_scheme_names_field_and_expected_form(patch: dict[str, Any], field: str) -> None:
    errors = errors_of({**minimal(), **patch})
    assert [e["field"] for e in errors] == [field]
    assert "s3://<bucket>/<key>" in errors[0]["message"]
    assert not errors[0]["message"].startswith("Value error")


def test_parse_empty_parquet_list_is_rejected() -> None:
    errors = errors_of({**minimal(), "dataset": {"parquet_uris": []}})
    assert errors[0]["field"] == "dataset.parquet_uris"
    assert "empty" in errors[0]["message"]


def test_parse_parquet_uri_naming_a_folder_is_rejected() -> None:
    errors = errors_of({**minimal(), "dataset": {"parquet_uris": [f"s3://{BUCKET}/datasets/"]}})
    assert errors[0]["field"] == "dataset.parquet_uris"
    assert "folder" in errors[0]["message"]


def test_parse_duplicate_parquet_uri_is_rejected() -> None:
    uri = f"s3://{BUCKET}/datasets/a.parquet"
    assert fields_of({**minimal(), "dataset": {"parquet_uris": [uri, uri]}}) == {"dataset.parquet_uris"}


def test_parse_more_shards_than_max_is_rejected_with_both_counts() -> None:
    uris = [f"s3://{BUCKET}/datasets/part-{i:05d}.parquet" for i in range(6)]
    errors = errors_of({**minimal(), "dataset": {"parquet_uris": uris}}, max_shards=5)
    assert errors[0]["field"] == "dataset.parquet_uris"
    assert "6" in errors[0]["message"]
    assert "5" in errors[0]["message"]


def test_parse_exactly_max_shards_is_accepted() -> None:
    uris = [f"s3://{BUCKET}/datasets/part-{i:05d}.parquet" for i in range(5)]
    document = parse_run_document({**minimal(), "dataset": {"parquet_uris": uris}}, max_shards=5)
    assert document.dataset.parquet_uris == uris


def test_parse_document_too_large_for_state_suggests_prefix() -> None:
    uris = [f"s3://{BUCKET}/datasets/{'x' * 60}-{i:06d}.parquet" for i in range(MAX_DOCUMENT_BYTES // 80 + 10)]
    errors = errors_of({**minimal(), "dataset": {"parquet_uris": uris}}, max_shards=100_000)
    assert errors[0]["field"] == "dataset.parquet_uris"
    assert "dataset.prefix" in errors[0]["message"]


@pytest.mark.parametrize(
    ("section", "values", "field"),
    [
        ("download", {"image_size": 16}, "download.image_size"),
        ("download", {"image_size": 4096}, "download.image_size"),
        ("download", {"tolerated_failure_percent": -1}, "download.tolerated_failure_percent"),
        ("download", {"tolerated_failure_percent": 100.5}, "download.tolerated_failure_percent"),
        ("download", {"max_concurrency": 0}, "download.max_concurrency"),
        ("download", {"resize_mode": "stretch"}, "download.resize_mode"),
        ("training", {"instance_count": 0}, "training.instance_count"),
        ("training", {"instance_count": 65}, "training.instance_count"),
        ("training", {"learning_rate": 0}, "training.learning_rate"),
        ("training", {"max_runtime_seconds": 10}, "training.max_runtime_seconds"),
        ("training", {"plugin": "deepspeed"}, "training.plugin"),
        ("training", {"instance_type": "g5.xlarge"}, "training.instance_type"),
        ("training", {"validation_prompts": [""]}, "training.validation_prompts.0"),
        ("endpoint", {"initial_instance_count": 0}, "endpoint.initial_instance_count"),
        ("endpoint", {"name": "-bad name"}, "endpoint.name"),
    ],
)
def test_parse_out_of_range_value_names_field(section: str, values: dict[str, Any], field: str) -> None:
    assert fields_of({**minimal(), section: values}) == {field}


@pytest.mark.parametrize(
    ("section", "instance_type"),
    [
        ("download", "ml.c7i-flex.xlarge"),
        ("training", "ml.p6-b200.48xlarge"),
        ("training", "ml.p6e-gb200.36xlarge"),
        ("endpoint", "ml.m8i-flex.large"),
    ],
)
def test_parse_instance_type_with_hyphenated_family_is_accepted(section: str, instance_type: str) -> None:
    document = parse_run_document({**minimal(), section: {"instance_type": instance_type}})
    assert getattr(document, section).instance_type == instance_type


@pytest.mark.parametrize("instance_type", ["ml.-g5.xlarge", "ml.g5-.xlarge", "ml.g5--x.xlarge", "ml.g5"])
def test_parse_malformed_instance_type_names_field(instance_type: str) -> None:
    assert fields_of({**minimal(), "training": {"instance_type": instance_type}}) == {"training.instance_type"}


def test_parse_several_problems_are_all_reported() -> None:
    raw = {**minimal(), "download": {"image_size": 1}, "training": {"seed": -1}, "extra": 1}
    assert fields_of(raw) == {"download.image_size", "training.seed", "extra"}


def test_parse_spot_without_max_wait_is_rejected() -> None:
    errors = errors_of({**minimal(), "training": {"use_spot": True}})
    assert errors[0]["field"] == "training.max_wait_seconds"
    assert "max_wait_seconds" in errors[0]["message"]


def test_parse_spot_wait_shorter_than_runtime_is_rejected() -> None:
    training = {"use_spot": True, "max_runtime_seconds": 7200, "max_wait_seconds": 3600}
    errors = errors_of({**minimal(), "training": training})
    assert "max_wait_seconds" in errors[0]["message"]


def test_parse_max_wait_without_spot_is_rejected() -> None:
    errors = errors_of({**minimal(), "training": {"max_wait_seconds": 7200}})
    assert "use_spot" in errors[0]["message"]


def test_parse_resolution_above_downloaded_image_size_is_rejected_naming_both() -> None:
    errors = errors_of({**minimal(), "download": {"image_size": 256}, "training": {"resolution": 512}})
    assert errors == [
        {
            "field": "training.resolution",
            "message": "training.resolution=512 is larger than download.image_size=256: every image would be "
            "upsampled to train. Set download.image_size to at least 512, or training.resolution to at most 256",
        }
    ]


@pytest.mark.parametrize(
    ("training", "field", "said"),
    [
        ({"method": "lora", "plugin": "gemini"}, "training.plugin", "set training.plugin to torch_ddp"),
        ({"method": "lora", "plugin": "low_level_zero"}, "training.plugin", "set training.plugin to torch_ddp"),
        (
            {"method": "lora", "backend": "accelerate", "plugin": "fsdp2"},
            "training.plugin",
            "set training.plugin to ddp",
        ),
        ({"plugin": "gemini", "mixed_precision": "no"}, "training.plugin", "training.mixed_precision to 'bf16'"),
        (
            {"backend": "accelerate", "plugin": "fsdp2", "use_ema": True},
            "training.use_ema",
            "training.use_ema to false",
        ),
        ({"method": "lora", "use_ema": True}, "training.use_ema", "set training.use_ema to false"),
        ({"backend": "accelerate", "mixed_precision": "fp16"}, "training.mixed_precision", "'bf16'"),
        ({"lora": {"rank": 8}}, "training.lora", "set training.method to 'lora'"),
        ({"max_wait_seconds": 7200}, "training.max_wait_seconds", "use_spot"),
        ({"use_spot": True, "max_runtime_seconds": 7200, "max_wait_seconds": 3600}, "training.max_wait_seconds", "≥"),
    ],
)
def test_parse_training_rule_across_fields_names_the_field_to_change(
    training: dict[str, Any], field: str, said: str
) -> None:
    [problem] = errors_of({**minimal(), "training": training})
    assert problem["field"] == field
    assert said in problem["message"]


@pytest.mark.parametrize(("image_size", "resize_mode"), [(512, "center_crop"), (1024, "border"), (256, "no")])
def test_parse_resolution_within_downloaded_images_is_accepted(image_size: int, resize_mode: str) -> None:
    raw = {
        **minimal(),
        "download": {"image_size": image_size, "resize_mode": resize_mode},
        "training": {"resolution": 512},
    }
    assert parse_run_document(raw).training.resolution == 512


def test_parse_validation_prompts_over_one_hyperparameter_value_are_rejected_naming_the_limit() -> None:
    prompts = [f"prompt {i} " + "x" * 280 for i in range(10)]  # each valid; 2,971 characters as JSON
    errors = errors_of({**minimal(), "training": {"validation_prompts": prompts}})
    assert [e["field"] for e in errors] == ["training.validation_prompts"]
    assert "SageMaker allows 2500" in errors[0]["message"]
    assert parse_run_document({**minimal(), "training": {"validation_prompts": prompts[:8]}})


@pytest.mark.parametrize("section", ["download", "evaluation"])
def test_parse_processing_max_runtime_over_nine_days_is_rejected(section: str) -> None:
    assert fields_of({**minimal(), section: {"max_runtime_seconds": 777_601}}) == {f"{section}.max_runtime_seconds"}
    assert parse_run_document({**minimal(), section: {"max_runtime_seconds": 777_600}})


def test_parse_spot_with_enough_wait_is_accepted() -> None:
    training = {"use_spot": True, "max_runtime_seconds": 3600, "max_wait_seconds": 7200}
    assert parse_run_document({**minimal(), "training": training}).training.max_wait_seconds == 7200


@pytest.mark.parametrize(
    "dataset",
    [
        {"parquet_uris": [f"s3://{BUCKET}/d/a.parquet"], "prefix": f"s3://{BUCKET}/d/"},
        {"url_column": "URL"},
    ],
    ids=["both", "neither"],
)
def test_parse_dataset_needs_exactly_one_source(dataset: dict[str, Any]) -> None:
    errors = errors_of({**minimal(), "dataset": dataset})
    assert errors[0]["field"] == "dataset"
    assert "exactly one" in errors[0]["message"]


def test_parse_missing_required_fields_are_named() -> None:
    assert fields_of({}) == {"dataset", "base_model_uri"}


@pytest.mark.parametrize("raw", [[], "text", None, 3])
def test_parse_non_object_document_is_rejected(raw: Any) -> None:
    assert fields_of(raw) == {"(document)"}


def test_parse_unknown_schema_version_is_rejected() -> None:
    assert fields_of({**minimal(), "schema_version": 2}) == {"schema_version"}


def test_hyperparameters_are_all_strings_parsed_back_to_their_values() -> None:
    training = parse_run_document(
        {
            **minimal(),
            "base_model_family": "sd",
            "training": {"use_ema": True, "learning_rate": 2e-4, "validation_prompts": ["a", "b c"]},
        }
    ).training
    hyper = training.hyperparameters()
    assert all(isinstance(value, str) for value in hyper.values())
    assert hyper["use_ema"] == "true"
    assert hyper["gradient_checkpointing"] == "true"
    assert float(hyper["learning_rate"]) == pytest.approx(2e-4)
    assert int(hyper["max_train_steps"]) == training.max_train_steps
    assert json.loads(hyper["validation_prompts"]) == ["a", "b c"]
    assert set(hyper) >= {"backend", "plugin", "mixed_precision", "resolution", "seed", "interleave_shards"}


def test_parse_s3_uri_splits_bucket_and_key() -> None:
    assert parse_s3_uri("s3://my-bucket/a/b.parquet") == ("my-bucket", "a/b.parquet")
    with pytest.raises(ValueError, match="s3://<bucket>/<key>"):
        parse_s3_uri("s3:/my-bucket/a")


def test_committed_schema_is_current() -> None:
    assert SCHEMA_PATH.read_text(encoding="utf-8") == schema_text(), (
        "schemas/run-document.schema.json is stale; regenerate it: PYTHONPATH=layers/common "
        ".venv/bin/python -m sdflow_common.run_document --write schemas/run-document.schema.json"
    )
    assert json.loads(SCHEMA_PATH.read_text()) == json_schema()


def test_schema_cli_check_detects_stale_file(tmp_path: Path) -> None:
    target = tmp_path / "schema.json"
    assert main(["--write", str(target)]) == 0
    assert main(["--check", str(target)]) == 0
    target.write_text("{}\n")
    assert main(["--check", str(target)]) == 1


def test_schema_accepts_examples_and_rejects_invalid_one() -> None:
    validator = jsonschema.Draft202012Validator(json_schema())
    for name in ("run_document_minimal.json", "run_document_full.json"):
        assert list(validator.iter_errors(load_event(name))) == [], name
    assert list(validator.iter_errors(load_event("run_document_invalid.json")))


@pytest.mark.parametrize("name", ["run_document_minimal.json", "run_document_full.json"])
def test_example_documents_are_valid(name: str) -> None:
    document = parse_run_document(load_event(name), max_shards=50)
    assert document.base_model_uri.startswith(f"s3://{BUCKET}/")


def test_example_full_document_sets_every_section() -> None:
    raw = load_event("run_document_full.json")
    document = parse_run_document(raw)
    assert document.model_dump(mode="json", exclude_unset=True).keys() == raw.keys()
    defaults = parse_run_document(minimal())
    for section in ("download", "training", "endpoint", "evaluation", "approval"):
        assert getattr(document, section) != getattr(defaults, section), section


def test_example_invalid_document_reports_each_problem() -> None:
    raw = load_event("run_document_invalid.json")
    fields = fields_of(copy.deepcopy(raw))
    assert {
        "base_model_uri",
        "dataset.parquet_uris",
        "download.image_size",
        "training.epochs",
        "colour",
    } <= fields


def _field_paths(model: type[Any], prefix: str = "") -> list[str]:
    paths = []
    for name, field in model.model_fields.items():
        paths.append(f"{prefix}{name}")
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            paths += _field_paths(annotation, f"{prefix}{name}.")
    return paths


def test_docs_describe_every_field() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "run-document.md").read_text(encoding="utf-8")
    paths = _field_paths(RunDocument)
    assert "training.learning_rate" in paths  # the walk reaches nested sections
    for path in paths:
        section, _, name = path.rpartition(".")
        assert f"| `{name}` |" in docs, f"docs/run-document.md does not describe {path}"
        if section:
            assert f"### `{section}`" in docs, f"docs/run-document.md has no section for {section}"


def test_run_document_spot_with_warm_pool_is_rejected_naming_keep_alive() -> None:
    raw = {
        "dataset": {"prefix": "s3://bucket-a/datasets/"},
        "base_model_uri": "s3://bucket-a/models/sd/",
        "training": {"use_spot": True, "max_wait_seconds": 90000, "keep_alive_seconds": 600},
    }
    with pytest.raises(InvalidRunDocument) as excinfo:
        parse_run_document(raw)
    [problem] = json.loads(str(excinfo.value))
    assert problem["field"] == "training.keep_alive_seconds"
    assert "keep_alive_seconds" in problem["message"]


def test_parse_resume_from_execution_arn_is_accepted() -> None:
    arn = "arn:aws:states:eu-west-1:123456789012:execution:sdflow-pipeline:cats-v1"
    assert parse_run_document({**minimal(), "resume_from": arn}).resume_from == arn
    assert parse_run_document(minimal()).resume_from is None


@pytest.mark.parametrize(
    "value",
    [
        "cats-v1",  # a name, not an ARN
        "arn:aws:states:eu-west-1:123456789012:stateMachine:sdflow-pipeline",  # the state machine
        "arn:aws:states:eu-west-1:123456789012:execution:sdflow-pipeline/Download:0a1b",  # a Map child
        "arn:aws:lambda:eu-west-1:123456789012:function:sdflow-validate",
    ],
)
def test_parse_resume_from_that_is_not_an_execution_arn_names_field_and_form(value: str) -> None:
    [problem] = errors_of({**minimal(), "resume_from": value})
    assert problem["field"] == "resume_from"
    assert "arn:aws:states:<region>:<account>:execution:<pipeline>:<name>" in problem["message"]


# --- the evaluation block (held-out split, CLIP model, scene adherence, gate) ----------------------------------


def test_parse_minimal_document_evaluation_defaults_resolve_at_validation() -> None:
    evaluation = parse_run_document(minimal()).evaluation
    assert evaluation.holdout_samples is None  # automatic: Validate run writes the number back
    assert evaluation.clip_model_uri is None
    assert evaluation.scene_adherence is None
    assert evaluation.instance_type is None  # per family: Validate run picks it
    assert evaluation.gate.metrics() == []
    assert evaluation.effective_gate.rules() == []


def test_parse_evaluation_min_prompt_adherence_and_gate_prompt_adherence_together_is_refused() -> None:
    raw = {**minimal(), "evaluation": {"min_prompt_adherence": 0.5, "gate": {"prompt_adherence": {"min": 0.6}}}}
    [error] = errors_of(raw)
    assert error["field"] == "evaluation.gate"
    assert "remove min_prompt_adherence" in error["message"]


def test_parse_evaluation_min_prompt_adherence_is_the_gates_prompt_adherence_min() -> None:
    raw = {**minimal(), "evaluation": {"min_prompt_adherence": 0.5, "gate": {"kid": {"max_change": 0}}}}
    gate = parse_run_document(raw).evaluation.effective_gate
    assert gate.rules() == [("kid", "max_change", 0.0), ("prompt_adherence", "min", 0.5)]


@pytest.mark.parametrize(
    ("evaluation", "field", "expected"),
    [
        ({"gate": {"kid": {}}}, "evaluation.gate.kid", "sets no bound"),
        ({"gate": {"kid": {"max": 1, "min": 2}}}, "evaluation.gate.kid", "min=2.0 is above max=1.0"),
        ({"gate": {"pickscore": {"min": 1}}}, "evaluation.gate.pickscore", "unknown field"),
        ({"gate": {"kid": {"max_chnage": 0}}}, "evaluation.gate.kid.max_chnage", "did you mean `max_change`"),
        ({"holdout_samples": 10_001}, "evaluation.holdout_samples", "less than or equal to 10000"),
        ({"holdout_samples": -1}, "evaluation.holdout_samples", "greater than or equal to 0"),
        ({"clip_model_uri": "clip-vit-l"}, "evaluation.clip_model_uri", "is not an S3 URI"),
        (
            {"scene_adherence": False, "prompts": ["a red circle on a blue background"]},
            "evaluation.scene_adherence",
            "set scene_adherence to true",
        ),
    ],
)
def test_parse_evaluation_bad_new_fields_name_their_field(
    evaluation: dict[str, Any], field: str, expected: str
) -> None:
    errors = {error["field"]: error["message"] for error in errors_of({**minimal(), "evaluation": evaluation})}
    assert expected in errors[field]


@pytest.mark.parametrize(
    ("evaluation", "on"),
    [
        ({}, True),  # no CLIP model: the scene prompts are all there is to score
        ({"clip_model_uri": f"s3://{BUCKET}/models/clip/"}, False),
        ({"clip_model_uri": f"s3://{BUCKET}/models/clip/", "holdout_samples": 0}, True),
        ({"clip_model_uri": f"s3://{BUCKET}/models/clip/", "min_prompt_adherence": 0.5}, True),
        ({"clip_model_uri": f"s3://{BUCKET}/models/clip/", "gate": {"prompt_adherence": {"min": 0.5}}}, True),
        ({"clip_model_uri": f"s3://{BUCKET}/models/clip/", "prompts": ["a red circle on a blue background"]}, True),
        ({"clip_model_uri": f"s3://{BUCKET}/models/clip/", "prompts_uri": f"s3://{BUCKET}/p.json"}, True),
        ({"scene_adherence": False, "min_prompt_adherence": 0.5}, False),
        ({"clip_model_uri": f"s3://{BUCKET}/models/clip/", "scene_adherence": True}, True),
    ],
)
def test_evaluation_scene_adherence_resolution(evaluation: dict[str, Any], on: bool) -> None:
    assert parse_run_document({**minimal(), "evaluation": evaluation}).evaluation.scene_adherence_on is on
