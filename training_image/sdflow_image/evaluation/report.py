"""evaluation.json's shape (docs/contracts.md, "The evaluation job") and the job's one-line summary.

`metrics` holds what was computed, each base against trained with its sample count; `missing` holds
every metric that was not, each with the reason and what would make it computable: the job never
writes a number it did not compute. Scene adherence keeps today's flat keys beside
`metrics.prompt_adherence`, so older readers still find them. No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sdflow_image.evaluation import adherence
from sdflow_image.evaluation.grid import HOLDOUT_GRID_FILE

METRICS = ("clip_score", "kid", "fid", "prompt_adherence")
HIGHER_IS_BETTER = {"clip_score": True, "kid": False, "fid": False, "prompt_adherence": True}
# How the summary line prints each metric (KID is of order 1e-2, CLIP score and FID of order 10).
_FORMAT = {"clip_score": ".2f", "kid": ".4f", "fid": ".2f", "prompt_adherence": ".4f"}

NO_CLIP = "no CLIP model: set evaluation.clip_model_uri"
NO_HOLDOUT = "no held-out samples: set evaluation.holdout_samples (the run then holds part of its dataset out)"
NO_SCENES = (
    "scene adherence off: set evaluation.scene_adherence true (it reads the demo's scene grammar only, "
    "'a <colour> <shape> on a <colour> background')"
)


@dataclass
class Scores:
    """What the job computed and what it could not, in the contract's names."""

    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    missing: list[dict[str, str]] = field(default_factory=list)

    def lack(self, metric: str, reason: str) -> None:
        self.missing.append({"metric": metric, "reason": reason})


def adherence_metric(result: adherence.Comparison) -> dict[str, Any]:
    return {"base": result.base.score, "trained": result.trained.score, "samples": result.trained.prompts}


def adherence_keys(result: adherence.Comparison) -> dict[str, Any]:
    """The flat keys of the evaluation.json scene adherence has always written."""

    def accuracies(report: adherence.AdherenceReport) -> dict[str, float]:
        return {key: getattr(report, key) for key in ("foreground_accuracy", "background_accuracy", "shape_accuracy")}

    return {
        "prompt_adherence": result.trained.score,
        "base_prompt_adherence": result.base.score,
        "prompts": result.trained.prompts,
        **accuracies(result.trained),
        "base": accuracies(result.base),
        "grid": adherence.GRID_FILE,
        "results": result.trained.results,
    }


def evaluation_document(
    scores: Scores,
    *,
    captions: list[str],
    holdout: dict[str, Any],
    clip_model: dict[str, Any] | None,
    scene: adherence.Comparison | None,
    settings: dict[str, Any],
) -> dict[str, Any]:
    """The evaluation.json document: metrics in METRICS order, then what is missing and why."""
    document: dict[str, Any] = {
        "metrics": {name: scores.metrics[name] for name in METRICS if name in scores.metrics},
        "missing": sorted(scores.missing, key=lambda m: METRICS.index(m["metric"])),
        "holdout": {
            "samples": len(captions),
            "grid": HOLDOUT_GRID_FILE if captions else None,
            "captions": captions,
            **holdout,
        },
        "clip_model": clip_model,
    }
    if scene is not None:
        document.update(adherence_keys(scene))
    document["settings"] = settings
    return document


def summary(document: dict[str, Any]) -> str:
    """The ExitMessage line: each metric base → trained, with its direction and count."""
    parts = []
    for name, metric in document["metrics"].items():
        form = _FORMAT[name]
        arrow = "↑" if HIGHER_IS_BETTER[name] else "↓"
        parts.append(
            f"{name} ({arrow} better) base {metric['base']:{form}} → trained {metric['trained']:{form}} "
            f"({metric['samples']} samples)"
        )
    missing = [m["metric"] for m in document["missing"]]
    tail = f"; missing: {', '.join(missing)}" if missing else ""
    return "ok: " + ("; ".join(parts) or "no metric computed") + tail
