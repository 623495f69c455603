"""The quality gate: every metric, every bound, both ways; a metric not computed fails; the gate's models refuse
bounds no value could pass; the text forms Register model records."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from pydantic import ValidationError

from sdflow_common.quality_gate import (
    BOUNDS,
    GATE_METRICS,
    GateCheck,
    MetricGate,
    QualityGate,
    direction_text,
    evaluate_gate,
    gate_text,
    with_min_prompt_adherence,
)

BASE, TRAINED = 0.5, 0.75  # change = +0.25
# bound -> (a limit the (base 0.5, trained 0.75) pair passes, one it fails, the value checked)
LIMITS = {
    "min": (0.75, 0.76, TRAINED),
    "max": (0.75, 0.74, TRAINED),
    "min_change": (0.25, 0.26, TRAINED - BASE),
    "max_change": (0.25, 0.24, TRAINED - BASE),
}
RULES = {
    "min": "trained >= {}",
    "max": "trained <= {}",
    "min_change": "trained - base >= {}",
    "max_change": "trained - base <= {}",
}
CASES = list(itertools.product(GATE_METRICS, LIMITS, (True, False)))


def _gate(metric: str, bound: str, limit: float) -> QualityGate:
    return QualityGate.model_validate({metric: {bound: limit}})


@pytest.mark.parametrize(("metric", "bound", "passes"), CASES, ids=[f"{m}-{b}-{p}" for m, b, p in CASES])
def test_evaluate_gate_every_metric_and_bound_passes_and_fails_on_its_limit(
    metric: str, bound: str, passes: bool
) -> None:
    good, bad, value = LIMITS[bound]
    limit = good if passes else bad
    metrics = {metric: {"base": BASE, "trained": TRAINED, "samples": 64}}

    [check] = evaluate_gate(_gate(metric, bound, limit), metrics)

    assert check.metric == metric
    assert check.passed is passes
    assert check.limit == limit
    assert check.value == pytest.approx(value)
    assert check.rule == RULES[bound].format(f"{limit:g}")
    assert check.describe().endswith("✓" if passes else "✗")


@pytest.mark.parametrize(("metric", "bound"), list(itertools.product(GATE_METRICS, LIMITS)))
def test_evaluate_gate_metric_not_computed_fails_with_no_value(metric: str, bound: str) -> None:
    good, _bad, _value = LIMITS[bound]
    others = {name: {"base": BASE, "trained": TRAINED} for name in GATE_METRICS if name != metric}

    [check] = evaluate_gate(_gate(metric, bound, good), others)

    assert check.passed is False
    assert check.value is None
    assert "not computed" in check.describe()


@pytest.mark.parametrize(
    "scores",
    [None, {}, {"trained": None, "base": 0.5}, {"trained": "0.7", "base": 0.5}, {"trained": float("nan"), "base": 0.5}],
)
def test_evaluate_gate_trained_value_unusable_fails(scores: Any) -> None:
    [check] = evaluate_gate(_gate("clip_score", "min", 0.0), {"clip_score": scores})
    assert (check.passed, check.value) == (False, None)


def test_evaluate_gate_change_without_base_fails_while_absolute_passes() -> None:
    gate = QualityGate.model_validate({"kid": {"max": 1.0, "max_change": 0}})
    absolute, relative = evaluate_gate(gate, {"kid": {"trained": 0.01}})
    assert (absolute.passed, absolute.value) == (True, 0.01)
    assert (relative.passed, relative.value) == (False, None)


def test_evaluate_gate_lower_is_better_metric_with_max_change_zero_rejects_a_worse_model() -> None:
    gate = QualityGate.model_validate({"kid": {"max_change": 0}, "clip_score": {"min_change": -1.0}})
    checks = evaluate_gate(
        gate, {"kid": {"base": 0.051, "trained": 0.060}, "clip_score": {"base": 21.3, "trained": 20.5}}
    )
    assert [(check.metric, check.passed) for check in checks] == [("clip_score", True), ("kid", False)]


def test_evaluate_gate_value_within_rounding_of_limit_passes() -> None:
    [check] = evaluate_gate(
        _gate("prompt_adherence", "min_change", 0.2), {"prompt_adherence": {"base": 0.1, "trained": 0.3}}
    )
    assert check.passed is True


def test_evaluate_gate_empty_gate_checks_nothing() -> None:
    assert evaluate_gate(QualityGate(), {"kid": {"base": 1.0, "trained": 2.0}}) == []


def test_gate_check_describe_relative_shows_both_numbers() -> None:
    check = GateCheck(
        metric="kid", rule="trained - base <= 0", limit=0.0, value=-0.039, passed=True, trained=0.012, base=0.051
    )
    assert check.describe() == "kid: trained 0.012 - base 0.051 = -0.039 ≤ 0 ✓"


def test_gate_check_describe_absolute_and_missing() -> None:
    [absolute] = evaluate_gate(_gate("prompt_adherence", "min", 0.6), {"prompt_adherence": {"trained": 0.85}})
    assert absolute.describe() == "prompt_adherence: trained 0.85 ≥ 0.6 ✓"
    [missing] = evaluate_gate(_gate("fid", "max_change", 0), {})
    assert missing.describe() == "fid: trained - base ≤ 0: not computed ✗"


def test_metric_gate_without_bound_is_refused() -> None:
    with pytest.raises(ValidationError, match="sets no bound"):
        MetricGate()


@pytest.mark.parametrize(("low", "high"), [("min", "max"), ("min_change", "max_change")])
def test_metric_gate_low_above_high_is_refused(low: str, high: str) -> None:
    with pytest.raises(ValidationError, match=f"{low}=2.0 is above {high}=1.0"):
        MetricGate.model_validate({low: 2, high: 1})


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_metric_gate_non_finite_limit_is_refused(value: float) -> None:
    with pytest.raises(ValidationError):
        MetricGate(min=value)


def test_quality_gate_unknown_metric_is_refused() -> None:
    with pytest.raises(ValidationError, match="extra"):
        QualityGate.model_validate({"pickscore": {"min": 1}})


def test_gate_text_lists_every_rule_in_metadata_characters() -> None:
    gate = QualityGate.model_validate({"kid": {"max_change": 0}, "clip_score": {"min_change": -1.0, "min": 20.5}})
    assert gate_text(gate) == "clip_score min=20.5 clip_score min_change=-1 kid max_change=0"
    assert gate_text(QualityGate()) == ""


def test_with_min_prompt_adherence_becomes_prompt_adherence_min() -> None:
    gate = with_min_prompt_adherence(QualityGate.model_validate({"kid": {"max": 1}}), 0.6)
    assert gate.prompt_adherence == MetricGate(min=0.6)
    assert gate.kid == MetricGate(max=1)
    assert with_min_prompt_adherence(QualityGate(), None) == QualityGate()


def test_bounds_cover_every_metric_gate_field() -> None:
    assert [name for name, _what, _op in BOUNDS] == list(MetricGate.model_fields)


def test_direction_text_follows_each_metrics_direction() -> None:
    assert [direction_text(metric) for metric in GATE_METRICS] == ["↑ better", "↓ better", "↓ better", "↑ better"]
    assert direction_text("pickscore") == ""
