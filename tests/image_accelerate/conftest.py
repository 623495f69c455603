"""Fixtures of the accelerate backend's tests (tests/image_accelerate), which run in the second job
environment: `.venv-accelerate/bin/pytest tests/image_accelerate -n 2 --dist loadscope` (make test,
make test-accelerate). The root run (`.venv/bin/pytest`, no torch) never collects them: pyproject's
testpaths name tests/e2e and tests/unit only, as for tests/image.

Tiny models are built in code; nothing is downloaded, ever."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Before anything imports huggingface_hub, which reads it once: a test that reaches for the Hub
# fails at once instead of waiting on the network (as HF_HUB_OFFLINE=1 does in the image).
os.environ["HF_HUB_OFFLINE"] = "1"

# The image's code is imported as the jobs import it, from training_image/ (WORKDIR /opt/ml/code in
# the image). pyproject's pythonpath says so too; this keeps a run from another rootdir the same.
TRAINING_IMAGE = Path(__file__).resolve().parents[2] / "training_image"
if str(TRAINING_IMAGE) not in sys.path:
    sys.path.insert(0, str(TRAINING_IMAGE))
