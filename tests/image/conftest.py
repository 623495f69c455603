"""Fixtures of the image tests that several modules share (helpers stay in *_fixtures.py)."""

from __future__ import annotations

from evaluation_fixtures import evaluation_models, tiny_clip_dir
from family_fixtures import family_base, family_dataset

__all__ = ["evaluation_models", "family_base", "family_dataset", "tiny_clip_dir"]
