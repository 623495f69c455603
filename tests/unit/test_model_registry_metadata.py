"""Register model's metadata shaped to CustomerMetadataProperties' pattern and length: an execution name
Step Functions allows (`(`, `)`, `!`, `'`), a long LoRA target list, a long gate never make CreateModelPackage
refuse the package after the run has paid for its training."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from sdflow_common import request_limits
from sdflow_common.model_registry import METADATA_VALUE_LIMIT, RegisterTask, metadata_value, model_package_request
from sdflow_common.settings import Settings
from tests.unit.helpers import load_event

SCORES = {"prompt_adherence": 0.86, "base_prompt_adherence": 0.11, "prompts": 48}
ODD_NAME = "my(run)!-it's"
pytestmark = pytest.mark.usefixtures("aws_env")


def renamed(event: dict[str, Any], name: str) -> dict[str, Any]:
    """The task of a run whose execution is called `name`: its ARN, run id and every URI under runs/<name>/."""
    old = event["config"]["run_id"]
    return dict(json.loads(json.dumps(event).replace(old, name)))


def package(event: dict[str, Any]) -> dict[str, Any]:
    return model_package_request(RegisterTask.model_validate(event), Settings.from_env(), "sdf-g", "Approved", SCORES)


def test_model_package_execution_name_with_marks_step_functions_allows_passes_create_model_package() -> None:
    event = renamed(load_event("register_model_task.json"), ODD_NAME)
    assert event["config"]["run_id"] == ODD_NAME

    request = package(event)

    assert request_limits.operation_problems("CreateModelPackage", request) == []
    metadata = request["CustomerMetadataProperties"]
    assert metadata["sdflow:run_id"] == "my_run__-it_s"
    assert metadata["sdflow:execution"].endswith(":my_run__-it_s")


def test_model_package_lora_summary_over_256_characters_is_cut_with_dots_and_passes() -> None:
    event = copy.deepcopy(load_event("register_model_task.json"))
    targets = [f"transformer_blocks.{index}.attn.to_q" for index in range(40)]
    event["config"]["run"]["training"] |= {"method": "lora", "plugin": "torch_ddp", "lora": {"target_modules": targets}}

    request = package(event)

    summary = request["CustomerMetadataProperties"]["sdflow:lora"]
    assert len(summary) == METADATA_VALUE_LIMIT
    assert summary.endswith("...")
    assert request_limits.operation_problems("CreateModelPackage", request) == []


@pytest.mark.parametrize(
    ("value", "shaped"),
    [
        ("s3://b/runs/a(b)/x", "s3://b/runs/a_b_/x"),
        ("tab\there, comma,", "tab_here_ comma_"),
        ("é ü 7 _.:/=+-@", "é ü 7 _.:/=+-@"),
        (0.5, "0.5"),
    ],
)
def test_metadata_value_marks_outside_the_pattern_become_underscores(value: Any, shaped: str) -> None:
    assert metadata_value(value) == shaped


def test_metadata_value_over_the_limit_ends_in_three_dots_within_it() -> None:
    shaped = metadata_value("x(" * 200)
    assert len(shaped) == METADATA_VALUE_LIMIT
    assert shaped.endswith("...")
    assert "(" not in shaped
