"""E2e fixtures: one local cloud per test module, built from the module's `CLOUD = CloudSpec(...)`
(tests/e2e/clouds.py). A module that needs another kind of cloud (the real local SageMaker, no
SageMaker at all) defines its own `cloud` fixture, which overrides this one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sdflow.local.cloud import LocalCloud
from sdflow.local.sagemaker.noop import NoOpSageMaker
from tests.e2e.clouds import CloudSpec, NoOpCloud, noop_cloud


@pytest.fixture(scope="module")
def noop(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NoOpCloud]:
    """The module's local cloud with no-op SageMaker jobs, shared by its tests by design."""
    spec = getattr(request.module, "CLOUD", CloudSpec())
    workdir = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    with noop_cloud(workdir, spec) as running:
        yield running


@pytest.fixture(scope="module")
def cloud(noop: NoOpCloud) -> LocalCloud:
    return noop.cloud


@pytest.fixture
def sagemaker(noop: NoOpCloud) -> Iterator[NoOpSageMaker]:
    """The no-op SageMaker; a test may hold jobs longer, and they are quick again after it."""
    fake = noop.sagemaker
    yield fake
    fake.seconds_by_kind.clear()
    fake.seconds_by_kind.update(noop.spec.seconds_by_kind)
    fake.job_seconds = noop.spec.job_seconds
