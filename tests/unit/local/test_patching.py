"""Installing and removing the patches; the pinned moto version."""

from __future__ import annotations

from pathlib import Path

import moto

from sdflow.local import patching
from sdflow.local import runtime as runtime_module
from sdflow.local.services import awslambda


def test_moto_gap_pinned_version_is_the_one_the_patches_were_written_for() -> None:
    assert moto.__version__ == runtime_module.MOTO_VERSION


# ------------------------------------------------------------------------------------ (a) Lambda


def test_uninstall_restores_every_patched_attribute(tmp_path: Path) -> None:
    from moto.awslambda_simple.models import LambdaSimpleBackend
    from moto.s3.models import FakeBucket
    from moto.sagemaker.responses import SageMakerResponse

    before = (LambdaSimpleBackend.invoke, FakeBucket.create_from_cloudformation_json.__func__)
    with patching.patched(runtime_module.Runtime(workdir=tmp_path)):
        assert LambdaSimpleBackend.invoke is awslambda.lambda_invoke
        assert hasattr(SageMakerResponse, "update_endpoint")
    assert (LambdaSimpleBackend.invoke, FakeBucket.create_from_cloudformation_json.__func__) == before
    assert not hasattr(SageMakerResponse, "update_endpoint")
    assert not patching.installed()
