"""The quality gate: thresholds on the evaluation's metrics, absolute or relative to the base model.

The run document's `evaluation.gate` (run_document.EvaluationOptions) is a QualityGate; Register model applies
it to evaluation.json's `metrics` with `evaluate_gate` and rejects the model when any check fails
(docs/run-document.md "Evaluation"). Each metric has a direction (GATE_METRICS): higher is better for the CLIP
score and the scene adherence, lower for KID and FID (distances between image distributions). A bound reads
the same whatever the direction: `min`/`max` bound the trained model's value, `min_change`/`max_change` bound
trained - base; the user picks the side that means "no worse", e.g. `{"kid": {"max_change": 0}}`.

A metric the evaluation did not compute fails every check on it ("not computed"): a gate passes only on
numbers, never on their absence (Validate run refuses the gates a run cannot compute, so this happens only
when the job could not, e.g. fewer held-out images downloaded than asked)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final, Literal

from pydantic import ConfigDict, Field, model_validator

from sdflow_common.training_options import StrictOptions

HIGHER: Final = "higher"
LOWER: Final = "lower"
# The evaluation's metric names (evaluation.json `metrics`) and which way is better.
GATE_METRICS: Final[dict[str, Literal["higher", "lower"]]] = {
    "clip_score": HIGHER,
    "kid": LOWER,
    "fid": LOWER,
    "prompt_adherence": HIGHER,
}
# How a display says the direction (the notification, `sdflow status`, the SDK summary, the console).
DIRECTION_TEXT: Final = {HIGHER: "↑ better", LOWER: "↓ better"}
# The metrics the held-out split and the CLIP model give (the rest: scene adherence).
HOLDOUT_METRICS: Final = ("clip_score", "kid", "fid")
# A MetricGate's bounds, in the order checks are listed: (field, what it bounds, comparison).
BOUNDS: Final = (
    ("min", "trained", ">="),
    ("max", "trained", "<="),
    ("min_change", "trained - base", ">="),
    ("max_change", "trained - base", "<="),
)
_SHOWN_OPERATOR = {">=": "≥", "<=": "≤"}


class MetricGate(StrictOptions):
    """Bounds on one metric; at least one. change = trained - base."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    min: float | None = Field(default=None, description="The trained model's value must be at least this.")
    max: float | None = Field(default=None, description="The trained model's value must be at most this.")
    min_change: float | None = Field(
        default=None, description="trained - base must be at least this (e.g. -1.0: at most 1.0 below the base)."
    )
    max_change: float | None = Field(
        default=None, description="trained - base must be at most this (e.g. 0: no higher than the base)."
    )

    @model_validator(mode="after")
    def _some_bound_and_ordered(self) -> MetricGate:
        if all(getattr(self, name) is None for name, _what, _op in BOUNDS):
            raise ValueError("sets no bound; give at least one of min, max, min_change, max_change")
        for low, high in (("min", "max"), ("min_change", "max_change")):
            low_value, high_value = getattr(self, low), getattr(self, high)
            if low_value is not None and high_value is not None and low_value > high_value:
                raise ValueError(f"{low}={low_value} is above {high}={high_value}: no value could pass")
        return self


class QualityGate(StrictOptions):
    """The gate Register model applies; empty (the default): no checks, every metric only reported."""

    clip_score: MetricGate | None = Field(
        default=None, description="CLIP score (0-100, higher is better) of generated images against held-out captions."
    )
    kid: MetricGate | None = Field(
        default=None, description="Kernel Inception Distance on CLIP image features (lower is better)."
    )
    fid: MetricGate | None = Field(
        default=None, description="Frechet Inception Distance on CLIP image features (lower is better)."
    )
    prompt_adherence: MetricGate | None = Field(
        default=None, description="Scene adherence of the demo's prompts (0-1, higher is better)."
    )

    def metrics(self) -> list[str]:
        """The metrics the gate checks, in GATE_METRICS order."""
        return [name for name in GATE_METRICS if getattr(self, name) is not None]

    def rules(self) -> list[tuple[str, str, float]]:
        """(metric, bound, limit) for every bound set, e.g. ("kid", "max_change", 0.0)."""
        found = []
        for metric in self.metrics():
            bounds = getattr(self, metric)
            for name, _what, _op in BOUNDS:
                limit = getattr(bounds, name)
                if limit is not None:
                    found.append((metric, name, float(limit)))
        return found


def direction_text(metric: str) -> str:
    """ "↑ better" or "↓ better" for a gate metric; "" for another name (a metric a newer job adds)."""
    direction = GATE_METRICS.get(metric)
    return DIRECTION_TEXT[direction] if direction else ""


def gate_text(gate: QualityGate) -> str:
    """The gate in plain words and numbers, e.g. `kid max_change=0 clip_score min_change=-1` (fits the registry's
    metadata value pattern: letters, digits, spaces and `_.:/=+-@` only); "" for an empty gate."""
    return " ".join(f"{metric} {bound}={_plain(limit)}" for metric, bound, limit in gate.rules())


def with_min_prompt_adherence(gate: QualityGate, min_prompt_adherence: float | None) -> QualityGate:
    """The gate with the older `evaluation.min_prompt_adherence` as `prompt_adherence.min` (the document refuses
    giving both, so nothing is overwritten)."""
    if min_prompt_adherence is None:
        return gate
    return gate.model_copy(update={"prompt_adherence": MetricGate(min=min_prompt_adherence)})


def _plain(number: float) -> str:
    """A limit as the user wrote it: 0, -1, 0.6, 1e-05."""
    return f"{number:g}"


def _shown(number: float) -> str:
    """A measured value, 4 significant digits."""
    return f"{number:.4g}"


@dataclass(frozen=True)
class GateCheck:
    """One bound checked against the evaluation: `value` is the trained model's value (min/max) or trained - base
    (min_change/max_change); None when the evaluation did not compute it (the check then fails)."""

    metric: str
    rule: str  # e.g. "trained - base <= 0", "trained >= 0.6"
    limit: float
    value: float | None
    passed: bool
    trained: float | None = None
    base: float | None = None

    def describe(self) -> str:
        """One line, e.g. "kid: trained 0.012 - base 0.051 = -0.039 ≤ 0 ✓"."""
        mark = "✓" if self.passed else "✗"
        relative = self.rule.startswith("trained - base")
        bound = f"{_SHOWN_OPERATOR[self.rule.split(' ')[-2]]} {_shown(self.limit)}"
        if self.value is None:
            side = "trained - base" if relative else "trained"
            return f"{self.metric}: {side} {bound}: not computed {mark}"
        if relative and self.trained is not None and self.base is not None:
            shown = f"trained {_shown(self.trained)} - base {_shown(self.base)} = {_shown(self.value)}"
        else:
            shown = f"trained {_shown(self.value)}"
        return f"{self.metric}: {shown} {bound} {mark}"


def number(value: Any) -> float | None:
    """A finite number from evaluation.json, or None (absent, null, text, bool, NaN: not a measurement)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _check(metric: str, bound: str, limit: float, scores: Any) -> GateCheck:
    what, op = next((what, op) for name, what, op in BOUNDS if name == bound)
    scores = scores if isinstance(scores, dict) else {}
    trained, base = number(scores.get("trained")), number(scores.get("base"))
    relative = bound.endswith("_change")
    value = (trained - base if trained is not None and base is not None else None) if relative else trained
    # Within float rounding of the limit counts as on it: 0.3 - 0.1 is "at least 0.2" as the user means it.
    on_limit = value is not None and math.isclose(value, limit, rel_tol=1e-9, abs_tol=1e-12)
    passed = value is not None and (on_limit or (value >= limit if op == ">=" else value <= limit))
    return GateCheck(
        metric=metric,
        rule=f"{what} {op} {_plain(limit)}",
        limit=limit,
        value=value,
        passed=passed,
        trained=trained,
        base=base,
    )


def evaluate_gate(gate: QualityGate, metrics: dict[str, Any]) -> list[GateCheck]:
    """Every bound of the gate checked against evaluation.json's `metrics` (`{name: {"base", "trained", ...}}`),
    in GATE_METRICS then BOUNDS order. A metric absent from `metrics`, or without a number where the bound needs
    one (the base's for a change), fails its checks with value None."""
    return [_check(metric, bound, limit, metrics.get(metric)) for metric, bound, limit in gate.rules()]
