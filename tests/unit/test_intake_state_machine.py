"""StartExecution with any input: the real state machine with the real Validate run and Notify
functions (moto executes the ASL) ends every invalid input in one failure notification that names
the problem, with nothing started."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.unit.helpers import DATA_BUCKET
from tests.unit.intake_harness import Intake, intake_cloud

VALID_LOOKING = {
    "dataset": {"parquet_uris": [f"s3://{DATA_BUCKET}/datasets/missing/part-00000.parquet"]},
    "base_model_uri": f"s3://{DATA_BUCKET}/models/missing/",
}


@pytest.fixture
def intake(aws_env: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[Intake]:
    with intake_cloud(monkeypatch) as cloud:
        yield cloud


def assert_failed_once_naming(intake: Intake, execution_arn: str, error: str, field: str) -> dict[str, object]:
    """The run failed with `error`, one notification names `field`, no job and no other task ran."""
    result = intake.wait(execution_arn)
    assert result["status"] == "FAILED"
    assert result.get("error") == error
    [notification] = intake.notifications()
    assert notification["MessageAttributes"]["outcome"]["Value"] == "failed"
    assert notification["MessageAttributes"]["error"]["Value"] == error
    assert notification["Subject"].endswith("FAILED")
    assert "in state: Validate run" in notification["Message"]
    assert f"  - {field}: " in notification["Message"]
    assert len(intake.calls["NotifyFunction"]) == 1
    assert intake.other_calls() == {}
    assert intake.jobs() == []
    return notification


@pytest.mark.parametrize(
    ("raw_input", "kind"),
    [("[1, 2]", "an array"), ('"cats"', "a string"), ("null", "null"), ("42", "a number"), ("true", "a boolean")],
)
def test_intake_execution_input_not_an_object_notifies_invalid_run_document(
    intake: Intake, raw_input: str, kind: str
) -> None:
    notification = assert_failed_once_naming(intake, intake.start(raw_input), "InvalidRunDocument", "(document)")
    assert f"must be a JSON object, not {kind}" in str(notification["Message"])


def test_intake_execution_input_missing_fields_notifies_each_field(intake: Intake) -> None:
    notification = assert_failed_once_naming(intake, intake.start("{}"), "InvalidRunDocument", "dataset")
    assert "  - base_model_uri: is required" in str(notification["Message"])


def test_intake_execution_input_misspelt_field_suggests_the_right_one(intake: Intake) -> None:
    document = {**VALID_LOOKING, "trainning": {"max_train_steps": 10}}
    notification = assert_failed_once_naming(
        intake, intake.start(json.dumps(document)), "InvalidRunDocument", "trainning"
    )
    assert "did you mean `training`?" in str(notification["Message"])


def test_intake_execution_input_with_missing_data_notifies_dataset_not_found(intake: Intake) -> None:
    notification = assert_failed_once_naming(
        intake, intake.start(json.dumps(VALID_LOOKING)), "DatasetNotFound", "base_model_uri"
    )
    assert "model_index.json does not exist" in str(notification["Message"])
    assert "Dataset:" not in str(notification["Message"])
