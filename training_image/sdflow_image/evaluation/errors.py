"""The evaluation job's errors (own module: every evaluation module raises them, evaluate.py catches)."""

from __future__ import annotations


class EvaluationError(RuntimeError):
    """The evaluation cannot run; the message says why and what to change."""


class HoldoutError(EvaluationError):
    """The held-out samples cannot be read; the message names the flag, the file and the fix."""


class ClipModelError(EvaluationError):
    """--clip_model_dir does not hold a loadable transformers CLIPModel with its processor."""
