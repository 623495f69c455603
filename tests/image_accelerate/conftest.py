"""Fixtures of the second stack's image tests (tests/image_accelerate), which run in the second job
environment: `.venv-accelerate/bin/pytest tests/image_accelerate -n 2 --dist loadscope` (make test,
make test-accelerate). The root run (`.venv/bin/pytest`, no torch) never collects them: pyproject's
testpaths name tests/e2e and tests/unit only, as for tests/image.

Tiny models are built in code; nothing is downloaded, ever."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

# Before anything imports huggingface_hub, which reads it once: a test that reaches for the Hub
# fails at once instead of waiting on the network (as HF_HUB_OFFLINE=1 does in the image).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

# The image's code is imported as the jobs import it, from training_image/ (WORKDIR /opt/ml/code in
# the image); the repository root and tests/image for the helpers the two image test trees share.
REPO = Path(__file__).resolve().parents[2]
for path in (REPO / "training_image", REPO, REPO / "tests" / "image"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small webdataset channel of 32 px scenes with captions, as a download job writes."""
    from train_fixtures import write_dataset_channel

    return write_dataset_channel(tmp_path_factory.mktemp("dataset"), shards=2, samples_per_shard=4, image_size=32)


@pytest.fixture(scope="session")
def bases(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The tiny pipeline of a family (built in code once a session), by family name."""
    from sdflow_image.builders import tiny, tiny_model

    built: dict[str, Path] = {}

    def base(family: str) -> Path:
        if family not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{family}") / "model"
            built[family] = (
                tiny_model.build_tiny_pipeline(folder) if family == "sd" else tiny.build_tiny(family, folder)
            )
        return built[family]

    return base


def load_bench(name: str) -> ModuleType:
    """A bench/ script as a module, loaded by path as the bench runs it."""
    import importlib.util

    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def quick_bench() -> ModuleType:
    """bench/acceptance_quick.py (gpu_acceptance --quick)."""
    return load_bench("acceptance_quick")


@pytest.fixture(scope="session")
def acceptance_bench() -> ModuleType:
    """bench/gpu_acceptance.py, whose parser and rules the quick plan's rows must pass."""
    return load_bench("gpu_acceptance")
