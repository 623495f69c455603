"""Installs every change the local runtime makes to moto, and takes them back.

moto (pinned: runtime.MOTO_VERSION) records most AWS calls faithfully but, by design, runs
nothing: Lambda answers a canned string, EventBridge rules deliver to SQS/logs only, SageMaker
jobs are "Completed" the moment they are created. Each gap is closed by small named functions in
sdflow/local/services/, one module per AWS service, each exporting `patches()`; every docstring
names the moto function it replaces or wraps, and why. tests/unit/local/ holds a test per patch
that fails when the pinned moto behaves differently (an upgrade forces a review) and a test
that the patch does its job."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from sdflow.local import runtime as runtime_module
from sdflow.local.runtime import Runtime

_originals: list[tuple[Any, str, Any, Any]] = []  # (owner, attribute, callable original, raw attribute)
_install_lock = threading.Lock()
_MISSING = object()


def original(owner: Any, attribute: str) -> Any:
    """moto's own implementation of a patched attribute (the attribute itself when unpatched)."""
    for klass in (owner, *getattr(owner, "__mro__", ())[1:]):  # a subclass reaches its parent's patch
        for patched_owner, name, callable_original, _raw in _originals:
            if patched_owner is klass and name == attribute:
                return callable_original
    return getattr(owner, attribute)


def previous(owner: Any, attribute: str, new: Any) -> Any:
    """What `new` replaced: moto's own implementation, or an earlier service module's patch of the
    same attribute, so that two modules can each wrap one method without undoing the other."""
    entries = [entry for entry in _originals if entry[0] is owner and entry[1] == attribute]
    for index, entry in enumerate(entries):
        installed = entries[index + 1][2] if index + 1 < len(entries) else getattr(owner, attribute, None)
        if installed is new:
            return entry[2]
    return original(owner, attribute)


def _patch(owner: Any, attribute: str, new: Any) -> None:
    # Keep both the callable original (classmethods bound) and the raw attribute to restore.
    raw = vars(owner).get(attribute, _MISSING) if isinstance(owner, type) else getattr(owner, attribute, _MISSING)
    _originals.append((owner, attribute, getattr(owner, attribute, None), raw))
    setattr(owner, attribute, new)


def service_modules() -> list[Any]:
    """Every module of sdflow.local.services that exports patches(), in name order."""
    import importlib
    import pkgutil

    import sdflow.local.services as services

    modules = [
        importlib.import_module(f"{services.__name__}.{info.name}") for info in pkgutil.iter_modules(services.__path__)
    ]
    return [module for module in modules if callable(getattr(module, "patches", None))]


def _patch_list() -> list[tuple[Any, str, Any]]:
    patches: list[tuple[Any, str, Any]] = []
    for service in service_modules():
        patches += service.patches()
    return patches


def install(runtime: Runtime) -> None:
    """Apply every patch (once) and send work to `runtime` (replacing any earlier runtime)."""
    with _install_lock:
        runtime_module.set_current(runtime)
        if _originals:
            return
        for owner, attribute, new in _patch_list():
            _patch(owner, attribute, new)


def uninstall() -> None:
    """Restore moto's own behaviour (tests; a process that stops its local cloud)."""
    with _install_lock:
        while _originals:
            owner, attribute, _callable_original, raw = _originals.pop()
            if raw is _MISSING:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, raw)
        runtime_module.set_current(None)


def installed() -> bool:
    return bool(_originals)


@contextlib.contextmanager
def patched(runtime: Runtime) -> Iterator[Runtime]:
    """install(runtime) for the duration of a block (tests)."""
    install(runtime)
    try:
        yield runtime
    finally:
        uninstall()
