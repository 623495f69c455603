"""The evaluation's result as a person reads it: one reading of evaluation.json and of Register model's
`$.registry.model`, shown the same way by the notification, `sdflow status`, the SDK summary and (as
data) the run console.

evaluation.json (docs/contracts.md "The evaluation job") holds `metrics` ({name: {"base", "trained",
"samples", ...}}), `missing` ([{"metric", "reason"}]) and `holdout` ({"samples", "grid"}); a file of an
older evaluation job holds only the flat scene-adherence keys (`prompt_adherence`,
`base_prompt_adherence`, `prompts`), read here as `metrics.prompt_adherence`. Each metric is shown with
its direction (quality_gate.GATE_METRICS):
`clip_score ↑: base 21.30 → trained 27.90 (64 held-out samples)`."""

from __future__ import annotations

import dataclasses
from typing import Any

from sdflow_common.quality_gate import GATE_METRICS, HIGHER, HOLDOUT_METRICS, GateCheck, number

ARROWS = {HIGHER: "↑"}
LOWER_ARROW = "↓"
# Decimals a metric is shown with: CLIP score (0-100) and FID (tens) need two, KID (hundredths) four,
# scene adherence (a fraction) two.
DECIMALS = {"clip_score": 2, "kid": 4, "fid": 2, "prompt_adherence": 2}
DEFAULT_DECIMALS = 4
_GATE_CHECK_FIELDS = frozenset(field.name for field in dataclasses.fields(GateCheck))


def _flat_adherence(document: dict[str, Any]) -> dict[str, Any] | None:
    """The scene adherence of an older evaluation.json (flat keys only), as a metrics entry."""
    trained = number(document.get("prompt_adherence"))
    if trained is None:
        return None
    entry: dict[str, Any] = {"trained": trained}
    base = number(document.get("base_prompt_adherence"))
    if base is not None:
        entry["base"] = base
    prompts = document.get("prompts")
    if isinstance(prompts, int) and not isinstance(prompts, bool):
        entry["samples"] = prompts
    return entry


def metrics_of(document: Any) -> dict[str, dict[str, Any]]:
    """evaluation.json's metrics: each entry of `metrics` that holds a trained number, then the flat
    scene-adherence keys of an older file as `prompt_adherence` (when `metrics` has none)."""
    if not isinstance(document, dict):
        return {}
    found = document.get("metrics")
    metrics = {
        str(name): dict(entry)
        for name, entry in (found.items() if isinstance(found, dict) else ())
        if isinstance(entry, dict) and number(entry.get("trained")) is not None
    }
    if "prompt_adherence" not in metrics:
        flat = _flat_adherence(document)
        if flat is not None:
            metrics["prompt_adherence"] = flat
    return metrics


def missing_of(document: Any) -> list[dict[str, str]]:
    """evaluation.json's `missing`: the metrics the job could not compute and why."""
    found = document.get("missing") if isinstance(document, dict) else None
    return [
        {"metric": str(item.get("metric", "?")), "reason": str(item.get("reason", ""))}
        for item in (found if isinstance(found, list) else [])
        if isinstance(item, dict)
    ]


def holdout_grid_name(document: Any) -> str | None:
    """The held-out grid's file name in the evaluation's folder (`holdout.grid`), when the job drew one."""
    holdout = document.get("holdout") if isinstance(document, dict) else None
    grid = holdout.get("grid") if isinstance(holdout, dict) else None
    return grid if isinstance(grid, str) and grid and "/" not in grid else None


def holdout_samples_of(document: Any) -> int | None:
    holdout = document.get("holdout") if isinstance(document, dict) else None
    samples = holdout.get("samples") if isinstance(holdout, dict) else None
    return samples if isinstance(samples, int) and not isinstance(samples, bool) else None


def arrow(metric: str) -> str:
    """↑ where higher is better, ↓ where lower is (KID, FID); nothing for a metric of unknown direction."""
    direction = GATE_METRICS.get(metric)
    if direction is None:
        return ""
    return ARROWS.get(direction, LOWER_ARROW)


def shown(metric: str, value: float) -> str:
    return f"{value:.{DECIMALS.get(metric, DEFAULT_DECIMALS)}f}"


def value_text(metric: str, entry: dict[str, Any], side: str) -> str | None:
    """One side's value (`base` or `trained`) with its decimals and ± its std where given (KID); None if absent."""
    value = number(entry.get(side))
    if value is None:
        return None
    std = number(entry.get(f"{side}_std"))
    return shown(metric, value) + (f" ± {shown(metric, std)}" if std is not None else "")


def samples_text(metric: str, entry: dict[str, Any]) -> str:
    """What the numbers were computed on: `64 held-out samples`, `48 scene prompts`."""
    samples = entry.get("samples")
    if not isinstance(samples, int) or isinstance(samples, bool):
        return ""
    what = (
        "scene prompts"
        if metric == "prompt_adherence"
        else "held-out samples"
        if metric in HOLDOUT_METRICS
        else "samples"
    )
    text = f"{samples} {what}"
    subset = entry.get("subset_size")
    if isinstance(subset, int) and not isinstance(subset, bool) and subset != samples:
        text += f", subsets of {subset}"
    return text


def metric_label(metric: str) -> str:
    """`clip_score ↑`: the metric's name and which way is better."""
    return f"{metric} {arrow(metric)}".rstrip()


def metric_values(metric: str, entry: dict[str, Any]) -> str:
    """`base 21.30 → trained 27.90 (64 held-out samples)`; KID with its ± std."""
    trained = value_text(metric, entry, "trained") or "?"
    base = value_text(metric, entry, "base")
    values = f"base {base} → trained {trained}" if base is not None else f"trained {trained} (no base score)"
    samples = samples_text(metric, entry)
    return values + (f" ({samples})" if samples else "")


def metric_line(metric: str, entry: dict[str, Any]) -> str:
    """`clip_score ↑: base 21.30 → trained 27.90 (64 held-out samples)`."""
    return f"{metric_label(metric)}: {metric_values(metric, entry)}"


def gate_checks(model: dict[str, Any]) -> list[GateCheck]:
    """`$.registry.model.gate` as GateChecks (entries that are not one are left out)."""
    found = model.get("gate")
    return [check for item in (found if isinstance(found, list) else []) if (check := gate_check(item)) is not None]


def gate_summary(checks: list[GateCheck]) -> str:
    return f"{sum(check.passed for check in checks)} of {len(checks)} checks passed"


def gate_check(item: Any) -> GateCheck | None:
    """A `$.registry.model` gate entry back as a GateCheck (None when it is not one)."""
    if not isinstance(item, dict) or not {"metric", "rule", "limit", "passed"} <= item.keys():
        return None
    try:
        return GateCheck(**{key: value for key, value in item.items() if key in _GATE_CHECK_FIELDS})
    except TypeError:
        return None


def _rule_text(rule: str) -> str:
    """`trained - base <= 0` as printed: `trained - base ≤ 0`."""
    return rule.replace(">=", "≥").replace("<=", "≤")


def signed(metric: str, value: float) -> str:
    """A change with its sign: `+6.60`, `-0.0390`."""
    return ("+" if value > 0 else "") + shown(metric, value)


def gate_line(check: GateCheck) -> str:
    """One check with every number it was judged on, e.g.
    `✗ kid (trained - base ≤ 0): base 0.0120 → trained 0.0510, change +0.0390, above the quality gate 0`."""
    mark = "✓" if check.passed else "✗"
    head = f"{mark} {check.metric} ({_rule_text(check.rule)})"
    if check.value is None:
        return f"{head}: not computed"
    relative = check.rule.startswith("trained - base")
    base = f"base {shown(check.metric, check.base)} → " if check.base is not None else ""
    trained = check.trained if check.trained is not None else check.value
    text = f"{head}: {base}trained {shown(check.metric, trained)}"
    if relative:
        text += f", change {signed(check.metric, check.value)}"
    if not check.passed:
        side = "below" if ">=" in check.rule else "above"
        text += f", {side} the quality gate {check.limit:g}"
    return text


def check_record(check: GateCheck) -> dict[str, Any]:
    """A check as `$.registry.model.gate` carries it (JSON)."""
    return dataclasses.asdict(check)


def missing_line(item: dict[str, str]) -> str:
    return (
        f"{item['metric']}: not computed: {item['reason']}" if item.get("reason") else f"{item['metric']}: not computed"
    )


def model_lines(model: dict[str, Any]) -> list[str]:
    """The evaluation block of a registered model (`$.registry.model`): each metric base → trained, the gate's
    checks, the metrics not computed, and the held-out grid. An older result (flat prompt adherence only)
    reads through metrics_of too."""
    metrics = metrics_of(model)
    lines = [metric_line(name, entry) for name, entry in metrics.items()]
    checks = gate_checks(model)
    if checks:
        lines.append(f"quality gate: {gate_summary(checks)}")
        lines.extend(f"  {gate_line(check)}" for check in checks)
    elif isinstance(model.get("min_prompt_adherence"), int | float) and "prompt_adherence" in metrics:
        lines.append(f"quality gate: prompt_adherence ≥ {float(model['min_prompt_adherence']):.2f}")
    lines.extend(missing_line(item) for item in missing_of(model))
    if model.get("holdout_grid_uri"):
        lines.append(f"held-out grid (real | base | trained per caption): {model['holdout_grid_uri']}")
    if model.get("samples_uri"):
        lines.append(f"scene prompts grid (base | trained per prompt): {model['samples_uri']}")
    return lines
