"""The notification's evaluation block: each metric base → trained with its direction and sample count, the
quality gate's checks, the metrics not computed and why, and the held-out grid; and a failed gate's cause."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from typing import Any

import pytest

from sdflow_common import notify
from sdflow_common.model_registry import RegisterTask, gate_failure
from sdflow_common.quality_gate import QualityGate, evaluate_gate
from tests.unit.evaluation_documents import EVALUATION_URI, PACKAGE_ARN, evaluation_document, registered_model
from tests.unit.helpers import load_event

EXECUTION_ARN = "arn:aws:states:us-east-1:123456789012:execution:sdflow-pipeline-test:cats-v1-abc"
NOW = datetime(2026, 11, 23, 0, 0, 0, tzinfo=UTC)
STATE: dict[str, Any] = {
    "config": {"run_id": "cats-v1-abc", "run": {"run_name": "cats-v1"}},
    "training": {"job_name": "sdf-tr-cats-v1-0123456789-r0-a0", "final_metrics": {"train:loss": 0.09123}},
    "endpoint": {"endpoint_name": "cats", "action": "create"},
}
EXPECTED_BLOCK = f"""Model:     {PACKAGE_ARN} (Approved)
Evaluation: base → trained (↑ higher is better, ↓ lower is better)
           clip_score ↑: base 21.30 → trained 27.90 (64 held-out samples)
           kid ↓: base 0.0510 ± 0.0040 → trained 0.0120 ± 0.0020 (64 held-out samples)
           prompt_adherence ↑: base 0.12 → trained 0.85 (48 scene prompts)
           quality gate: 2 of 2 checks passed
             ✓ clip_score (trained - base ≥ -1): base 21.30 → trained 27.90, change +6.60
             ✓ kid (trained - base ≤ 0): base 0.0510 → trained 0.0120, change -0.0390
           fid: not computed: 64 held-out samples, fewer than the 512 of the CLIP feature dimension
           held-out grid (real | base | trained per caption): {EVALUATION_URI}holdout.png
           scene prompts grid (base | trained per prompt): {EVALUATION_URI}adherence.png
"""


def _message(model: dict[str, Any], outcome: notify.Outcome = "succeeded", **fields: Any) -> str:
    state = {**STATE, "registry": {"model": model}}
    request = notify.NotifyRequest(
        outcome=outcome, execution_arn=EXECUTION_ARN, execution_name="cats-v1-abc", state=state, **fields
    )
    return notify.compose(request, now=NOW).message


def test_notify_success_with_evaluation_metrics_shows_each_metric_gate_missing_and_grid(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = _message(registered_model())

    with capsys.disabled():
        print("\n--- the notification, as a person reads it ---\n" + text)
    assert EXPECTED_BLOCK in text


def test_notify_failed_gate_check_is_marked_with_its_numbers() -> None:
    failed = {
        "metric": "kid",
        "rule": "trained - base <= 0",
        "limit": 0.0,
        "value": 0.039,
        "passed": False,
        "trained": 0.051,
        "base": 0.012,
    }
    text = _message(registered_model(gate=[failed], approval_status="Rejected"))

    assert "quality gate: 0 of 1 checks passed" in text
    assert "✗ kid (trained - base ≤ 0): base 0.0120 → trained 0.0510, change +0.0390, above the quality gate 0" in text


def test_notify_metric_without_base_score_says_so_instead_of_inventing_one() -> None:
    text = _message(registered_model(metrics={"clip_score": {"trained": 27.9, "samples": 64}}, gate=[]))

    assert "clip_score ↑: trained 27.90 (no base score) (64 held-out samples)" in text
    assert "quality gate" not in text


def test_notify_quality_gate_failed_cause_lists_every_failed_rule_and_where_the_grid_is() -> None:
    event = copy.deepcopy(load_event("register_model_task.json"))
    event["evaluation"]["evaluation_uri"] = EVALUATION_URI
    task = RegisterTask.model_validate(event)
    document = evaluation_document()
    document["metrics"]["kid"] |= {"base": 0.012, "trained": 0.051}
    gate = QualityGate.model_validate({"kid": {"max_change": 0}, "clip_score": {"min": 30}, "fid": {"max": 50}})
    checks = evaluate_gate(gate, document["metrics"])
    cause = json.dumps(
        {"errorType": "QualityGateFailed", "errorMessage": gate_failure(task, checks, PACKAGE_ARN, document)}
    )
    state = {key: STATE[key] for key in ("config", "training")}
    request = notify.NotifyRequest(
        outcome="failed",
        execution_arn=EXECUTION_ARN,
        execution_name="cats-v1-abc",
        state=state,
        error="QualityGateFailed",
        cause=cause,
        running_state="Register model",
    )

    text = notify.compose(request, now=NOW).message

    assert "the trained model failed 3 of 3 quality gate checks (evaluation.gate):" in text
    assert (
        "  ✗ kid (trained - base ≤ 0): base 0.0120 → trained 0.0510, change +0.0390, above the quality gate 0" in text
    )
    assert "  ✗ clip_score (trained ≥ 30): base 21.30 → trained 27.90, below the quality gate 30" in text
    assert "  ✗ fid (trained ≤ 50): not computed" in text
    assert "every metric, base → trained:\n  clip_score ↑: base 21.30 → trained 27.90 (64 held-out samples)" in text
    assert "  fid: not computed: 64 held-out samples, fewer than" in text
    assert f"Model package {PACKAGE_ARN} is registered as Rejected" in text
    assert "keeps serving its current model" in text
    assert f"held-out grid (real | base | trained per caption): {EVALUATION_URI}holdout.png" in text
    assert "sdflow resume" in text
