"""The second job environment is the stack training_image/constraints-accelerate.txt pins (the file
Dockerfile.accelerate installs under), and the image code shared by both backends imports on it."""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

pytestmark = pytest.mark.image

IMAGE_DIR = Path(__file__).resolve().parents[2] / "training_image"
STACK = ("torch", "diffusers", "transformers", "accelerate", "peft")
# Shared code: one module for both backends, so it must import on both stacks (brief, decision 6).
SHARED_MODULES = (
    "sdflow_image.contract",
    "sdflow_image.training.data",
    "sdflow_image.training.data_source",
    "sdflow_image.flags",
    "sdflow_image.families.base",
    "sdflow_image.training.checkpoints",
    "sdflow_image.training.encode_cache",
    "sdflow_image.training.outputs",
    "sdflow_image.serving.serve_model",
    "sdflow_image.evaluation.evaluate",
)


def pins(name: str) -> dict[str, str]:
    """`package==version` lines of a training_image file, package names normalised as pip does."""
    found = {}
    for line in (IMAGE_DIR / name).read_text().splitlines():
        requirement = line.split("#", 1)[0].strip()
        if requirement:
            package, _, pin = requirement.partition("==")
            found[package.split("[", 1)[0].lower().replace("_", "-")] = pin
    return found


def test_stack_versions_match_constraints_and_import() -> None:
    constraints = pins("constraints-accelerate.txt")
    requirements = pins("requirements-accelerate.txt")
    assert set(STACK) <= set(requirements), "the five libraries of the stack are pinned directly"
    assert {p: v for p, v in requirements.items() if constraints.get(p) != v} == {}, (
        "requirements-accelerate.txt and constraints-accelerate.txt disagree"
    )
    wrong = {}
    for package, pin in constraints.items():
        try:
            installed = version(package)
        except PackageNotFoundError:
            installed = "missing"
        if installed.split("+", 1)[0] != pin:
            wrong[package] = f"pinned {pin}, installed {installed}"
    assert wrong == {}, f"this environment differs from constraints-accelerate.txt (run `make setup`): {wrong}"

    for name in STACK:  # the very distributions checked above, not a copy shadowing them on sys.path
        module = importlib.import_module(name)
        assert module.__version__.split("+", 1)[0] == constraints[name], (name, module.__file__)
    for name in SHARED_MODULES:
        importlib.import_module(name)
    assert "colossalai" not in sys.modules, "shared code imports Colossal-AI only in its backend"
