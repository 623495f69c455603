"""The run console's Evaluation panel data (sdflow/console/API.md `evaluation`): each metric base → trained
with its direction, the run's gate checked as Register model checks it, the metrics not computed, the
held-out grid through the artifact URL, and an older evaluation.json read as scene adherence."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote

from sdflow.console.evaluation import evaluation_view
from sdflow.console.jobs import JobReader
from tests.unit.evaluation_documents import FLAT_SCORES, evaluation_document
from tests.unit.helpers import DATA_BUCKET, AwsWorld

GATE = {"gate": {"kid": {"max_change": 0}, "clip_score": {"min": 30}}}
JOB = "sdf-ev-cats-v1-abc-0123456789-r0-a0"
FOLDER = f"s3://{DATA_BUCKET}/runs/cats-v1-abc/evaluation/{JOB}/"


def test_evaluation_view_new_document_gives_metric_rows_with_direction_and_samples() -> None:
    view = evaluation_view(evaluation_document())

    rows = {row["name"]: row for row in view["metrics"]}
    assert list(rows) == ["clip_score", "kid", "prompt_adherence"]
    assert rows["kid"] == {
        "name": "kid", "direction": "lower", "arrow": "↓", "base": 0.051, "trained": 0.012, "base_std": 0.004,
        "trained_std": 0.002, "samples": 64, "subset_size": 64, "samples_text": "64 held-out samples",
        "base_text": "0.0510 ± 0.0040", "trained_text": "0.0120 ± 0.0020", "change_text": "-0.0390",
    }  # fmt: skip
    assert (rows["clip_score"]["arrow"], rows["clip_score"]["change_text"]) == ("↑", "+6.60")
    assert view["missing"] == evaluation_document()["missing"]
    assert view["holdout_samples"] == 64
    assert not {"metrics", "missing", "holdout"} & {key.split(" ")[0] for key in view["scores"]}


def test_evaluation_view_run_gate_checks_each_rule_with_the_notification_text() -> None:
    view = evaluation_view(evaluation_document(), GATE)

    assert [(check["metric"], check["passed"], check["text"]) for check in view["gate"]] == [
        ("clip_score", False, "✗ clip_score (trained ≥ 30): base 21.30 → trained 27.90, below the quality gate 30"),
        ("kid", True, "✓ kid (trained - base ≤ 0): base 0.0510 → trained 0.0120, change -0.0390"),
    ]


def test_evaluation_view_min_prompt_adherence_is_checked_as_the_gate() -> None:
    view = evaluation_view(FLAT_SCORES, {"min_prompt_adherence": 0.9})

    [check] = view["gate"]
    assert (check["metric"], check["rule"], check["passed"]) == ("prompt_adherence", "trained >= 0.9", False)


def test_evaluation_view_old_flat_document_gives_a_prompt_adherence_row() -> None:
    view = evaluation_view(FLAT_SCORES)

    [row] = view["metrics"]
    assert (row["name"], row["base"], row["trained"], row["samples_text"]) == (
        "prompt_adherence",
        0.11,
        0.86,
        "48 scene prompts",
    )
    assert view["gate"] == []
    assert view["missing"] == []


def test_evaluation_view_unreadable_evaluation_options_show_no_gate() -> None:
    view = evaluation_view(evaluation_document(), {"gate": {"kid": {"most": 1}}})

    assert view["gate"] == []
    assert len(view["metrics"]) == 3


class _SageMaker:
    def describe_processing_job(self, ProcessingJobName: str) -> dict[str, Any]:
        return {"ProcessingJobName": ProcessingJobName, "ProcessingJobStatus": "Completed"}


def _run(state: dict[str, Any]) -> dict[str, Any]:
    exited = SimpleNamespace(output=json.dumps(state), exited=datetime(2026, 11, 28, tzinfo=UTC))
    description = {"executionArn": "arn:aws:states:us-east-1:1:execution:m:cats-v1-abc", "startDate": exited.exited}
    return {"history": SimpleNamespace(states={"Evaluate model": exited}), "description": description}


def test_job_reader_evaluation_gives_holdout_grid_url_gate_and_no_adherence_grid_without_scene_prompts(
    mocked_aws: AwsWorld,
) -> None:
    metrics = {key: value for key, value in evaluation_document()["metrics"].items() if key != "prompt_adherence"}
    key = FOLDER.removeprefix(f"s3://{DATA_BUCKET}/") + "evaluation.json"
    mocked_aws.put_json(key, evaluation_document(metrics=metrics, prompt_adherence=None, grid=None))
    clients = {"sagemaker": _SageMaker(), "s3": mocked_aws.s3}
    reader = JobReader(clients.__getitem__, DATA_BUCKET, None)  # type: ignore[arg-type]
    state = {"config": {"run": {"evaluation": GATE}}, "evaluation": {"job_name": JOB, "evaluation_uri": FOLDER}}

    panel = reader.evaluation(_run(state))

    assert panel is not None
    assert panel["holdout_grid_url"] == f"/api/artifact?uri={quote(FOLDER + 'holdout.png', safe='')}"
    assert panel["grid_url"] is None
    assert [row["name"] for row in panel["metrics"]] == ["clip_score", "kid"]
    assert [check["passed"] for check in panel["gate"]] == [False, True]
