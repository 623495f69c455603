"""The second stack's image tests (run in .venv-accelerate): offline, with the image package and
tests/image's helpers importable. A minimal one until H-env's conftest lands; the lead merges."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
for path in (REPO / "training_image", REPO, REPO / "tests" / "image"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
