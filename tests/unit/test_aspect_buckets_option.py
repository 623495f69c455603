"""`training.aspect_buckets`: its hyperparameter, and the refusal of a download that stores no aspect ratio."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sdflow_common.errors import InvalidRunDocument
from sdflow_common.run_document import parse_run_document

BUCKET = "sdflow-data-test"


def _document(download: dict[str, Any], training: dict[str, Any]) -> dict[str, Any]:
    return {
        "dataset": {"parquet_uris": [f"s3://{BUCKET}/datasets/a.parquet"]},
        "base_model_uri": f"s3://{BUCKET}/models/sd/",
        "download": download,
        "training": training,
    }


def test_aspect_buckets_default_is_off_and_passed_as_false() -> None:
    document = parse_run_document(_document({}, {}))
    assert document.training.aspect_buckets is False
    assert document.training.hyperparameters()["aspect_buckets"] == "false"


def test_aspect_buckets_with_keep_ratio_is_accepted_and_passed_as_true() -> None:
    document = parse_run_document(
        _document({"resize_mode": "keep_ratio", "image_size": 512}, {"aspect_buckets": True, "resolution": 512})
    )
    assert document.training.hyperparameters()["aspect_buckets"] == "true"


@pytest.mark.parametrize("resize_mode", ["center_crop", "border", "no"])
def test_aspect_buckets_without_keep_ratio_is_refused_naming_the_fix(resize_mode: str) -> None:
    with pytest.raises(InvalidRunDocument) as caught:
        parse_run_document(_document({"resize_mode": resize_mode}, {"aspect_buckets": True}))
    [problem] = json.loads(str(caught.value))
    assert problem["field"] == "training.aspect_buckets"
    assert f"download.resize_mode '{resize_mode}'" in problem["message"]
    assert "set download.resize_mode to 'keep_ratio'" in problem["message"]
