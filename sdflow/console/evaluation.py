"""The run page's Evaluation panel, from the evaluation job's evaluation.json and the run's gate: each metric
base → trained with its direction, the quality gate's checks (judged as Register model judges them,
sdflow_common.quality_gate), the metrics not computed and why, the held-out grid, and for the scene
adherence one row per prompt; never raw JSON. sdflow_common.evaluation_report reads old and new files."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from sdflow_common import evaluation_report
from sdflow_common.quality_gate import GATE_METRICS, QualityGate, evaluate_gate, number
from sdflow_common.run_document import EvaluationOptions

RESULT_FIELDS = ("prompt", "foreground", "background", "shape", "foreground_ok", "background_ok", "shape_ok")
MAX_RESULT_ROWS = 1000
# Parts of evaluation.json the panel shows in their own places, not among the flat scores.
SHOWN_APART = frozenset({"results", "settings", "grid", "metrics", "missing", "holdout"})
METRIC_FIELDS = ("base", "trained", "base_std", "trained_std")
COUNT_FIELDS = ("samples", "subset_size")


def _scores(document: dict[str, Any]) -> dict[str, Any]:
    """Everything else as flat name → number pairs (a nested object's entries as `name key`)."""
    scores: dict[str, Any] = {}
    for key, value in document.items():
        if key in SHOWN_APART:
            continue
        if isinstance(value, dict):
            scores |= {f"{key} {k}": v for k, v in value.items() if isinstance(v, int | float | str | bool)}
        elif isinstance(value, int | float | str | bool) or value is None:
            scores[key] = value
    return scores


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def metric_rows(document: Any) -> list[dict[str, Any]]:
    """One row per metric: its numbers, which way is better (`direction`, `arrow`), the texts the notification
    prints for them, and what it was computed on (`samples_text`)."""
    rows = []
    for name, entry in evaluation_report.metrics_of(document).items():
        row: dict[str, Any] = {"name": name, "direction": GATE_METRICS.get(name)}
        row["arrow"] = evaluation_report.arrow(name)
        row |= {key: number(entry.get(key)) for key in METRIC_FIELDS}
        row |= {key: _count(entry.get(key)) for key in COUNT_FIELDS}
        row["samples_text"] = evaluation_report.samples_text(name, entry)
        # The texts the notification prints, so the page rounds exactly as it does.
        row["base_text"] = evaluation_report.value_text(name, entry, "base")
        row["trained_text"] = evaluation_report.value_text(name, entry, "trained")
        change = row["trained"] - row["base"] if row["base"] is not None and row["trained"] is not None else None
        row["change_text"] = None if change is None else evaluation_report.signed(name, change)
        rows.append(row)
    return rows


def run_gate(evaluation_options: Any) -> QualityGate:
    """The run's effective gate from `$.config.run.evaluation` (Validate run's document). A document this
    console cannot read as today's EvaluationOptions (an older or newer schema) shows no gate rather
    than a wrong one."""
    if not isinstance(evaluation_options, dict):
        return QualityGate()
    try:
        return EvaluationOptions.model_validate(evaluation_options).effective_gate
    except ValidationError:
        return QualityGate()


def gate_rows(document: Any, gate: QualityGate) -> list[dict[str, Any]]:
    """Each check of the gate against the metrics, with the line the notification prints for it."""
    checks = evaluate_gate(gate, evaluation_report.metrics_of(document))
    return [evaluation_report.check_record(check) | {"text": evaluation_report.gate_line(check)} for check in checks]


def evaluation_view(document: Any, evaluation_options: Any = None) -> dict[str, Any]:
    """evaluation.json as the page shows it (sdflow/console/API.md `evaluation`)."""
    if not isinstance(document, dict):
        return {
            "scores": None,
            "settings": {},
            "results": [],
            "metrics": [],
            "missing": [],
            "gate": [],
            "holdout_samples": None,
        }
    settings = document.get("settings")
    rows = document.get("results")
    results = [
        {key: row.get(key) for key in RESULT_FIELDS}
        for row in (rows if isinstance(rows, list) else [])[:MAX_RESULT_ROWS]
        if isinstance(row, dict)
    ]
    return {
        "scores": _scores(document),
        "settings": settings if isinstance(settings, dict) else {},
        "results": results,
        "metrics": metric_rows(document),
        "missing": evaluation_report.missing_of(document),
        "gate": gate_rows(document, run_gate(evaluation_options)),
        "holdout_samples": evaluation_report.holdout_samples_of(document),
    }
