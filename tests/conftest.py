"""Fixtures shared by every test layer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, shared_botocore_loader


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `longest` first, the rest in their order (e2e modules, then unit ones). `make test`
    hands out modules in this order (--dist loadscope --no-loadscope-reorder): each longest test
    starts at once on a worker of its own while the other works through the suite, instead of
    starting last (xdist's default order is by number of tests) and running on with a worker idle."""
    items.sort(key=lambda item: item.get_closest_marker("longest") is None)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session", autouse=True)
def _one_botocore_loader() -> Iterator[None]:
    """Every botocore session of a test process reads service models through one loader
    (tests/helpers.py shared_botocore_loader): sessions stay separate (credentials, handlers),
    and the models, read-only data, are parsed once."""
    import botocore.session

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(botocore.session, "create_loader", shared_botocore_loader())
        yield
