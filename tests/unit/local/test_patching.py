"""Installing and removing the patches; the pinned moto version."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import moto
import pytest

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


# ------------------------------------------------------------------------- composing the patches


def _targets() -> dict[str, list[tuple[str, patching.Patch]]]:
    found: dict[str, list[tuple[str, patching.Patch]]] = {}
    for module, patch in patching._patch_list():
        found.setdefault(patching.target_name(patch.owner, patch.attribute), []).append((module, patch))
    return found


def test_wrap_order_every_multiply_patched_target_is_declared() -> None:
    multiple = {name for name, entries in _targets().items() if len(entries) > 1}
    assert multiple == set(patching.WRAP_ORDER)


def test_wrap_order_installed_chain_is_the_declared_order(tmp_path: Path) -> None:
    targets = _targets()
    with patching.patched(runtime_module.Runtime(workdir=tmp_path)):
        for name, declared in patching.WRAP_ORDER.items():
            _module, patch = targets[name][0]
            assert patching.wrapped_chain(patch.owner, patch.attribute) == list(declared), name


def test_uninstall_every_target_restored(tmp_path: Path) -> None:
    patches = [patch for _module, patch in patching._patch_list()]
    before = [patching._raw(patch.owner, patch.attribute) for patch in patches]
    with patching.patched(runtime_module.Runtime(workdir=tmp_path)):
        assert any(patching._raw(p.owner, p.attribute) is not raw for p, raw in zip(patches, before, strict=True))
    assert [patching._raw(patch.owner, patch.attribute) for patch in patches] == before
    assert all(patching._raw(patch.owner, patch.attribute) is raw for patch, raw in zip(patches, before, strict=True))


class _Target:
    """A stand-in for a moto class."""

    def method(self, value: int) -> list[str]:
        return [f"method {value}"]

    @staticmethod
    def static(value: int) -> list[str]:
        return [f"static {value}"]

    @classmethod
    def klass(cls, value: int) -> list[str]:
        return [f"klass {cls.__name__} {value}"]


def _outer(label: str) -> Any:
    def wrapper(inner: Any, *args: Any) -> list[str]:
        return [label, *inner(*args)]

    return wrapper


@pytest.fixture
def fake_modules(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Installs only the patch modules a test declares: fake_modules({"name": [patches]}, order)."""

    def declare(modules: dict[str, list[patching.Patch]], order: dict[str, tuple[str, ...]] | None = None) -> None:
        for name, patches in modules.items():
            module = types.ModuleType(name)
            module.patches = lambda patches=patches: patches  # type: ignore[attr-defined]
            monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.setattr(patching, "PATCH_MODULES", tuple(modules))
        monkeypatch.setattr(patching, "WRAP_ORDER", order or {})

    return declare


def test_wrap_method_static_and_class_methods_keep_their_kind(tmp_path: Path, fake_modules: Any) -> None:
    fake_modules(
        {
            "fake_a": [patching.wrap(_Target, name, _outer("a")) for name in ("method", "static", "klass")],
            "fake_b": [patching.wrap(_Target, name, _outer("b")) for name in ("method", "static", "klass")],
        },
        {f"_Target.{name}": ("fake_b", "fake_a") for name in ("method", "static", "klass")},
    )
    with patching.patched(runtime_module.Runtime(workdir=tmp_path)):
        assert _Target().method(1) == ["a", "b", "method 1"]
        assert _Target.static(2) == ["a", "b", "static 2"]
        assert _Target.klass(3) == ["a", "b", "klass _Target 3"]
        assert isinstance(vars(_Target)["static"], staticmethod)
        assert isinstance(vars(_Target)["klass"], classmethod)
        assert patching.wrapped_chain(_Target, "method") == ["fake_b", "fake_a"]
    assert _Target().method(1) == ["method 1"]
    assert _Target.static(2) == ["static 2"]
    assert _Target.klass(3) == ["klass _Target 3"]


def test_replace_missing_target_refused_naming_it(tmp_path: Path, fake_modules: Any) -> None:
    fake_modules({"fake_a": [patching.replace(_Target, "method", len), patching.replace(_Target, "gone", len)]})
    with pytest.raises(patching.PatchError, match=rf"^_Target\.gone does not exist in moto {moto.__version__}; "):
        patching.install(runtime_module.Runtime(workdir=tmp_path))
    assert not patching.installed()
    assert _Target().method(1) == ["method 1"]
    patching.uninstall()


def test_wrap_missing_target_refused_naming_it(tmp_path: Path, fake_modules: Any) -> None:
    fake_modules({"fake_a": [patching.wrap(_Target, "gone", _outer("a"))]})
    with pytest.raises(patching.PatchError, match=r"^_Target\.gone does not exist in moto"):
        patching.install(runtime_module.Runtime(workdir=tmp_path))
    patching.uninstall()


def test_add_existing_target_refused_naming_it(tmp_path: Path, fake_modules: Any) -> None:
    fake_modules({"fake_a": [patching.add(_Target, "method", len)]})
    with pytest.raises(patching.PatchError, match=r"^_Target\.method already exists in moto"):
        patching.install(runtime_module.Runtime(workdir=tmp_path))
    patching.uninstall()


def test_double_wrap_undeclared_refused_naming_target_and_modules(tmp_path: Path, fake_modules: Any) -> None:
    fake_modules(
        {
            "fake_a": [patching.wrap(_Target, "method", _outer("a"))],
            "fake_b": [patching.wrap(_Target, "method", _outer("b"))],
        }
    )
    with pytest.raises(patching.PatchError, match=r"_Target\.method is patched by several modules \(fake_a, fake_b\)"):
        patching.install(runtime_module.Runtime(workdir=tmp_path))
    patching.uninstall()


def test_double_wrap_mismatched_order_refused_naming_target_and_modules(tmp_path: Path, fake_modules: Any) -> None:
    fake_modules(
        {
            "fake_a": [patching.wrap(_Target, "method", _outer("a"))],
            "fake_b": [patching.wrap(_Target, "method", _outer("b"))],
        },
        {"_Target.method": ("fake_a", "fake_c")},
    )
    with pytest.raises(
        patching.PatchError, match=r"_Target\.method: the declared order \(fake_a, fake_c\) does not match"
    ):
        patching.install(runtime_module.Runtime(workdir=tmp_path))
    patching.uninstall()
