"""Evaluate model's CreateProcessingJob request: the held-out split as a ManifestFile input, the CLIP model as an
S3Prefix input, the flags that go with them, scene adherence as resolved, the per-family instance; and the state
that passes `$.dataset` to it."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from sdflow_common import evaluation
from sdflow_common.evaluation import EvaluationTask, evaluation_job_request, holdout_manifest
from sdflow_common.run_document import parse_run_document
from tests.unit.helpers import DATA_BUCKET, TRAINING_IMAGE_URI, AwsWorld, load_event
from tests.unit.job_requests import assert_valid_request

HOLDOUT_MANIFEST = f"s3://{DATA_BUCKET}/runs/r/dataset/holdout.json"
CLIP_URI = f"s3://{DATA_BUCKET}/models/clip/"
ASL = Path(__file__).resolve().parents[2] / "statemachines" / "pipeline.asl.json"


def task(dataset: dict[str, Any] | None = None, **evaluation_block: Any) -> EvaluationTask:
    event = copy.deepcopy(load_event("start_evaluation_task.json"))
    event["config"]["run"]["evaluation"] = {"instance_type": "ml.g5.xlarge", **evaluation_block}
    if dataset is not None:
        event["dataset"] = dataset
    return EvaluationTask.model_validate(event)


def request(found: EvaluationTask) -> dict[str, Any]:
    made = evaluation_job_request(
        job_name="sdf-ev-x-r0-a0",
        config=found.config,
        run_hash="abc",
        model_data_url=found.training.model_data_url,
        prompts_uri=None,
        image_uri=TRAINING_IMAGE_URI,
        role_arn="arn:aws:iam::123456789012:role/job",
        holdout_manifest_uri=holdout_manifest(found.dataset, found.config.run.evaluation),
    )
    assert_valid_request("CreateProcessingJob", made)
    return made


def inputs_of(made: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["InputName"]: item["S3Input"] for item in made["ProcessingInputs"]}


def flag(arguments: list[str], name: str) -> str | None:
    return arguments[arguments.index(name) + 1] if name in arguments else None


def test_evaluation_request_holdout_and_clip_model_become_inputs_and_flags() -> None:
    found = task(
        {"holdout_samples": 300, "holdout_manifest_uri": HOLDOUT_MANIFEST},
        holdout_samples=256,
        clip_model_uri=CLIP_URI,
        scene_adherence=False,
    )
    made = request(found)

    inputs = inputs_of(made)
    assert inputs["holdout"]["S3DataType"] == "ManifestFile"
    assert inputs["holdout"]["S3Uri"] == HOLDOUT_MANIFEST
    assert inputs["holdout"]["LocalPath"] == evaluation.HOLDOUT_DIR
    assert inputs["clip_model"]["S3DataType"] == "S3Prefix"
    assert (inputs["clip_model"]["S3Uri"], inputs["clip_model"]["LocalPath"]) == (CLIP_URI, evaluation.CLIP_MODEL_DIR)
    arguments = made["AppSpecification"]["ContainerArguments"]
    assert flag(arguments, "--holdout_dir") == "/opt/ml/processing/holdout"
    assert flag(arguments, "--holdout_samples") == "256"
    assert flag(arguments, "--clip_model_dir") == "/opt/ml/processing/clip_model"
    assert flag(arguments, "--scene_adherence") == "false"


@pytest.mark.parametrize(
    ("dataset", "samples"),
    [
        ({}, 256),
        ({"holdout_samples": 0, "holdout_manifest_uri": None}, 256),
        ({"holdout_manifest_uri": HOLDOUT_MANIFEST}, 0),
    ],
)
def test_evaluation_request_without_held_out_files_or_samples_has_no_holdout_input(
    dataset: dict[str, Any], samples: int
) -> None:
    made = request(task(dataset, holdout_samples=samples, clip_model_uri=CLIP_URI, scene_adherence=True))
    assert "holdout" not in inputs_of(made)
    arguments = made["AppSpecification"]["ContainerArguments"]
    assert "--holdout_dir" not in arguments
    assert "--holdout_samples" not in arguments
    assert flag(arguments, "--scene_adherence") == "true"


def test_evaluation_request_without_clip_model_has_no_clip_input_and_scores_scenes() -> None:
    made = request(task({"holdout_manifest_uri": HOLDOUT_MANIFEST}, holdout_samples=64))
    assert set(inputs_of(made)) == {"model", "base_model", "holdout"}
    arguments = made["AppSpecification"]["ContainerArguments"]
    assert "--clip_model_dir" not in arguments
    assert flag(arguments, "--scene_adherence") == "true"  # no CLIP model: the scene prompts are scored


def test_start_evaluation_without_scene_adherence_writes_no_prompts(mocked_aws: AwsWorld) -> None:
    found = task({}, holdout_samples=64, clip_model_uri=CLIP_URI, scene_adherence=False)
    assert evaluation._prompts_uri(found, mocked_aws.s3) is None


@pytest.mark.parametrize(("family", "expected"), [("sd", "ml.g4dn.xlarge"), ("sdxl", "ml.g4dn.xlarge")])
def test_evaluation_instance_type_unresolved_is_the_familys_smallest_fitting(family: str, expected: str) -> None:
    raw = load_event("start_evaluation_task.json")["config"]["run"] | {"base_model_family": family}
    assert evaluation.instance_type(parse_run_document(raw)) == expected
    resolved = parse_run_document(raw | {"evaluation": {"instance_type": "ml.g6.xlarge"}})
    assert evaluation.instance_type(resolved) == "ml.g6.xlarge"


def test_evaluate_model_state_passes_the_dataset_record() -> None:
    state = json.loads(ASL.read_text(encoding="utf-8"))["States"]["Evaluate model"]
    assert state["Parameters"]["Payload"]["dataset.$"] == "$.dataset"
    assert "holdout" in state["Comment"]
