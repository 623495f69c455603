"""Evaluation results the unit tests read: evaluation.json as the evaluation job writes it (docs/contracts.md
"The evaluation job"), an older job's flat file, and Register model's `$.registry.model` built from them."""

from __future__ import annotations

import copy
from typing import Any

EVALUATION_URI = "s3://b/runs/cats-v1-abc/evaluation/sdf-ev-job/"
PACKAGE_ARN = "arn:aws:sagemaker:us-east-1:123456789012:model-package/sdf-cats-v1/4"

# An older evaluation job's file: only the scene adherence, flat.
FLAT_SCORES: dict[str, Any] = {"prompt_adherence": 0.86, "base_prompt_adherence": 0.11, "prompts": 48}

# The new evaluation.json: held-out CLIP score and KID, FID missing (too few samples), scene adherence too.
EVALUATION_DOCUMENT: dict[str, Any] = {
    "metrics": {
        "clip_score": {"base": 21.3, "trained": 27.9, "samples": 64},
        "kid": {
            "base": 0.051,
            "trained": 0.012,
            "base_std": 0.004,
            "trained_std": 0.002,
            "samples": 64,
            "subset_size": 64,
        },
        "prompt_adherence": {"base": 0.12, "trained": 0.85, "samples": 48},
    },
    "missing": [{"metric": "fid", "reason": "64 held-out samples, fewer than the 512 of the CLIP feature dimension"}],
    "holdout": {"samples": 64, "grid": "holdout.png", "captions": ["a red circle on a blue background"]},
    "clip_model": {"projection_dim": 512, "source": "--clip_model_dir"},
    "grid": "adherence.png",
    "prompt_adherence": 0.85,
    "base_prompt_adherence": 0.12,
    "prompts": 48,
    "settings": {"num_inference_steps": 20, "guidance_scale": 5.0},
}


def evaluation_document(**changes: Any) -> dict[str, Any]:
    """A copy of EVALUATION_DOCUMENT with top-level keys replaced (None: removed)."""
    document = copy.deepcopy(EVALUATION_DOCUMENT)
    for key, value in changes.items():
        if value is None:
            document.pop(key, None)
        else:
            document[key] = value
    return document


# `$.registry.model` of a run whose gate was `{"kid": {"max_change": 0}, "clip_score": {"min_change": -1}}`.
REGISTERED_MODEL: dict[str, Any] = {
    "model_package_arn": PACKAGE_ARN,
    "model_package_group": "sdf-cats-v1",
    "approval_status": "Approved",
    "evaluation_uri": EVALUATION_URI,
    "metrics": copy.deepcopy(EVALUATION_DOCUMENT["metrics"]),
    "missing": copy.deepcopy(EVALUATION_DOCUMENT["missing"]),
    "gate": [
        {
            "metric": "clip_score",
            "rule": "trained - base >= -1",
            "limit": -1.0,
            "value": 6.6,
            "passed": True,
            "trained": 27.9,
            "base": 21.3,
        },
        {
            "metric": "kid",
            "rule": "trained - base <= 0",
            "limit": 0.0,
            "value": -0.039,
            "passed": True,
            "trained": 0.012,
            "base": 0.051,
        },
    ],
    "holdout_samples": 64,
    "holdout_grid_uri": f"{EVALUATION_URI}holdout.png",
    "prompt_adherence": 0.85,
    "base_prompt_adherence": 0.12,
    "min_prompt_adherence": None,
    "prompts": 48,
    "samples_uri": f"{EVALUATION_URI}adherence.png",
}


def registered_model(**changes: Any) -> dict[str, Any]:
    model = copy.deepcopy(REGISTERED_MODEL)
    for key, value in changes.items():
        if value is None:
            model.pop(key, None)
        else:
            model[key] = value
    return model
