"""Fixtures of the image tests that several modules share (helpers stay in *_fixtures.py)."""

from __future__ import annotations

from family_fixtures import family_base, family_dataset

__all__ = ["family_base", "family_dataset"]
