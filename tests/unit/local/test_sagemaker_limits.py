"""SageMaker's maximums and patterns from its service model, refused as AWS refuses them (botocore
checks neither; moto neither): a ValidationException before anything is created."""

from __future__ import annotations

from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdflow.local import runtime as runtime_module
from tests.unit.local.helpers import PROCESSING_REQUEST, TRAINING_REQUEST, client


def _refused(call: Any, **request: Any) -> tuple[str, str]:
    with pytest.raises(ClientError) as refused:
        call(**request)
    error: Any = refused.value.response["Error"]
    return error["Code"], error["Message"]


def test_training_hyperparameter_value_over_2500_characters_is_refused_naming_it(
    runtime: runtime_module.Runtime,
) -> None:
    sagemaker = client("sagemaker")
    request = {**TRAINING_REQUEST, "HyperParameters": {"seed": "0", "validation_prompts": "x" * 2501}}
    code, message = _refused(sagemaker.create_training_job, **request)
    assert code == "ValidationException"
    assert message.startswith("1 validation error detected: Value 'xxx")
    assert message.endswith(
        "at 'hyperParameters.validation_prompts' failed to satisfy constraint: Member must have length less than "
        "or equal to 2500"
    )
    with pytest.raises(ClientError, match=r"ResourceNotFound|Could not find|not found"):
        sagemaker.describe_training_job(TrainingJobName=request["TrainingJobName"])
    sagemaker.create_training_job(**{**request, "HyperParameters": {"validation_prompts": "x" * 2500}})


def test_processing_max_runtime_over_nine_days_is_refused(runtime: runtime_module.Runtime) -> None:
    request = {**PROCESSING_REQUEST, "StoppingCondition": {"MaxRuntimeInSeconds": 777_601}}
    code, message = _refused(client("sagemaker").create_processing_job, **request)
    assert (code, message) == (
        "ValidationException",
        "1 validation error detected: Value '777601' at 'stoppingCondition.maxRuntimeInSeconds' failed to satisfy "
        "constraint: Member must have value less than or equal to 777600",
    )


@pytest.mark.parametrize("value", ["run (copy)", "it's", "run!", "a" * 257])
def test_tag_value_outside_tag_pattern_or_length_is_refused(runtime: runtime_module.Runtime, value: str) -> None:
    request = {**PROCESSING_REQUEST, "Tags": [{"Key": "sdflow:run", "Value": "ok"}, {"Key": "k", "Value": value}]}
    code, message = _refused(client("sagemaker").create_processing_job, **request)
    assert code == "ValidationException"
    assert "at 'tags.2.member.value' failed to satisfy constraint: Member must " in message


def test_tag_value_of_letters_digits_spaces_and_allowed_marks_is_accepted(runtime: runtime_module.Runtime) -> None:
    value = "Zürich run 2 _.:/=+-@ 東京"
    client("sagemaker").create_processing_job(**{**PROCESSING_REQUEST, "Tags": [{"Key": "k", "Value": value}]})


def test_several_problems_are_counted_in_one_message(runtime: runtime_module.Runtime) -> None:
    request = {
        **PROCESSING_REQUEST,
        "StoppingCondition": {"MaxRuntimeInSeconds": 10**7},
        "Tags": [{"Key": "k", "Value": "(x)"}],
    }
    _, message = _refused(client("sagemaker").create_processing_job, **request)
    assert message.startswith("2 validation errors detected: ")
