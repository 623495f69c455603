"""Installs every change the local runtime makes to moto, and takes them back.

moto (pinned: runtime.MOTO_VERSION) records most AWS calls faithfully but, by design, runs
nothing: Lambda answers a canned string, EventBridge rules deliver to SQS/logs only, SageMaker
jobs are "Completed" the moment they are created. Each gap is closed by small named functions in
the patch modules (PATCH_MODULES), one module per AWS service or concern, each exporting
`patches()`: a list of `replace(...)`, `wrap(...)` and `add(...)`. Every docstring names the moto
function it replaces or wraps, and why. A wrapper receives the callable it wraps as its first
argument (`inner`, called with the same arguments the wrapper got, `self`/`cls` included); where
several modules wrap one attribute, WRAP_ORDER declares the order, innermost first.
tests/unit/local/ holds a test per patch that fails when the pinned moto behaves differently (an
upgrade forces a review) and a test that the patch does its job."""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sdflow.local import runtime as runtime_module
from sdflow.local.runtime import PatchError, Runtime

__all__ = ["Patch", "PatchError", "add", "install", "installed", "patched", "replace", "uninstall", "wrap"]

# Every module that exports patches(), in the order their patches are applied.
PATCH_MODULES: tuple[str, ...] = (
    "sdflow.local.services.awslambda",
    "sdflow.local.services.awslambda_limits",
    "sdflow.local.services.cloudformation",
    "sdflow.local.services.dynamodb",
    "sdflow.local.services.events",
    "sdflow.local.services.iam",
    "sdflow.local.services.iam_simulate",
    "sdflow.local.services.logs",
    "sdflow.local.services.moto_server",
    "sdflow.local.services.s3",
    "sdflow.local.sagemaker.service",
    "sdflow.local.sagemaker.lists",
    "sdflow.local.sagemaker.registry",
    "sdflow.local.sagemaker.invoke",
    "sdflow.local.sagemaker.warm_pools",
    "sdflow.local.services.servicequotas",
    "sdflow.local.services.sns",
    "sdflow.local.stepfunctions.core",
    "sdflow.local.stepfunctions.api",
    "sdflow.local.stepfunctions.clock",
    "sdflow.local.stepfunctions.limits",
    "sdflow.local.stepfunctions.map",
    "sdflow.local.stepfunctions.maprun",
    "sdflow.local.stepfunctions.redrive",
    "sdflow.local.stepfunctions.redrive_map",
    "sdflow.local.stepfunctions.tokens",
)

# Every attribute wrapped by more than one module: the modules that wrap it, innermost first (the
# last one named is what moto calls; each wrapper's `inner` is the one named before it).
WRAP_ORDER: dict[str, tuple[str, ...]] = {
    "DistributedItemProcessorWorker._eval_job": (
        "sdflow.local.services.iam",
        "sdflow.local.stepfunctions.map",
        "sdflow.local.stepfunctions.maprun",
        "sdflow.local.stepfunctions.redrive",
    ),
    "DistributedItemProcessorWorker._eval_input": (
        "sdflow.local.stepfunctions.map",
        "sdflow.local.stepfunctions.redrive",
    ),
    "DistributedIterationComponent._map_run": (
        "sdflow.local.stepfunctions.map",
        "sdflow.local.stepfunctions.redrive_map",
    ),
    "BaseExecutionWorkerCommunication.terminated": (
        "sdflow.local.stepfunctions.api",
        "sdflow.local.stepfunctions.redrive",
    ),
    "ExecutionWorker._get_evaluation_environment": (
        "sdflow.local.stepfunctions.api",
        "sdflow.local.stepfunctions.redrive",
    ),
    "StepFunctionResponse.describe_execution": (
        "sdflow.local.stepfunctions.api",
        "sdflow.local.stepfunctions.redrive",
    ),
    "CommonStateField._get_state_entered_event_details": (
        "sdflow.local.stepfunctions.limits",
        "sdflow.local.stepfunctions.redrive",
    ),
}


@dataclass(frozen=True)
class Patch:
    """One change to moto: `kind` is "replace", "wrap" or "add"; `value` is the new attribute
    (replace, add) or the wrapper (wrap)."""

    kind: str
    owner: Any
    attribute: str
    value: Any


def replace(owner: Any, attribute: str, new: Any) -> Patch:
    """`owner.attribute` (which moto has) becomes `new`."""
    return Patch("replace", owner, attribute, new)


def wrap(owner: Any, attribute: str, wrapper: Callable[..., Any]) -> Patch:
    """`owner.attribute` (which moto has) becomes `wrapper(inner, *args, **kwargs)`, `inner` being
    what was there; a method stays a method, a staticmethod or classmethod stays one."""
    return Patch("wrap", owner, attribute, wrapper)


def add(owner: Any, attribute: str, value: Any) -> Patch:
    """`owner.attribute`, which moto lacks, becomes `value`."""
    return Patch("add", owner, attribute, value)


_installed: list[tuple[Any, str, Any]] = []  # (owner, attribute, raw attribute before the patch)
_install_lock = threading.Lock()
_MISSING = object()


def target_name(owner: Any, attribute: str) -> str:
    """`Class.attribute` (a class's qualified name) or `module.attribute` (a module's full name)."""
    return f"{getattr(owner, '__qualname__', None) or owner.__name__}.{attribute}"


def _raw(owner: Any, attribute: str) -> Any:
    """The attribute as stored (a staticmethod or classmethod object, not what it binds to)."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if attribute in vars(klass):
                return vars(klass)[attribute]
        return _MISSING
    return getattr(owner, attribute, _MISSING)


def _composed(raw: Any, wrapper: Callable[..., Any], module: str) -> Any:
    """`wrapper` bound around `raw`, of the same kind (function, staticmethod, classmethod) as `raw`."""
    kind: Callable[[Any], Any] | None = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    inner = raw.__func__ if kind is not None else raw

    @functools.wraps(wrapper)
    def composed(*args: Any, **kwargs: Any) -> Any:
        return wrapper(inner, *args, **kwargs)

    composed.__dict__.pop("__wrapped__", None)
    composed.patch_wrapper = wrapper  # type: ignore[attr-defined]
    composed.patch_inner = inner  # type: ignore[attr-defined]
    composed.patch_module = module  # type: ignore[attr-defined]
    return kind(composed) if kind is not None else composed


def wrapped_chain(owner: Any, attribute: str) -> list[str]:
    """The modules whose wrappers are installed on `owner.attribute`, innermost first."""
    modules: list[str] = []
    current = _raw(owner, attribute)
    current = getattr(current, "__func__", current) if isinstance(current, (staticmethod, classmethod)) else current
    while hasattr(current, "patch_module"):
        modules.insert(0, current.patch_module)
        current = current.patch_inner
    return modules


def service_modules() -> list[Any]:
    """Every patch module (PATCH_MODULES), imported, in the order their patches are applied."""
    return [importlib.import_module(name) for name in PATCH_MODULES]


def _check(patch: Patch) -> None:
    import moto

    exists = hasattr(patch.owner, patch.attribute)
    name = target_name(patch.owner, patch.attribute)
    if patch.kind in ("replace", "wrap") and not exists:
        raise PatchError(
            f"{name} does not exist in moto {moto.__version__}; the {patch.kind} of it must be reviewed "
            "against this moto version"
        )
    if patch.kind == "add" and exists:
        raise PatchError(
            f"{name} already exists in moto {moto.__version__}; the patch that adds it must be reviewed "
            "(replace or wrap moto's own)"
        )


def ordered(
    patches: list[tuple[str, Patch]], order: dict[str, tuple[str, ...]] | None = None
) -> list[tuple[str, Patch]]:
    """`patches` ((module, patch), in module order) in the order to apply them: each target's
    patches in WRAP_ORDER's order. Refuses an undeclared or mismatched order."""
    order = WRAP_ORDER if order is None else order
    groups: dict[tuple[int, str], list[tuple[str, Patch]]] = {}
    for module, patch in patches:
        groups.setdefault((id(patch.owner), patch.attribute), []).append((module, patch))
    result: list[tuple[str, Patch]] = []
    for group in groups.values():
        name = target_name(group[0][1].owner, group[0][1].attribute)
        modules = [module for module, _patch in group]
        if len(group) > 1:
            declared = order.get(name)
            if declared is None:
                raise PatchError(f"{name} is patched by several modules ({', '.join(modules)}) with no declared order")
            if sorted(declared) != sorted(modules):
                raise PatchError(
                    f"{name}: the declared order ({', '.join(declared)}) does not match the modules that "
                    f"patch it ({', '.join(modules)})"
                )
            group = sorted(group, key=lambda entry: declared.index(entry[0]))
            if any(patch.kind != "wrap" for _module, patch in group[1:]):
                raise PatchError(f"{name}: only the innermost of several patches may replace; the others must wrap")
        elif name in order and order[name] != tuple(modules):
            raise PatchError(
                f"{name}: the declared order ({', '.join(order[name])}) does not match the modules that "
                f"patch it ({', '.join(modules)})"
            )
        result += group
    return result


def _patch_list() -> list[tuple[str, Patch]]:
    patches: list[tuple[str, Patch]] = []
    for service in service_modules():
        patches += [(service.__name__, patch) for patch in service.patches()]
    return patches


def _apply(module: str, patch: Patch) -> None:
    _check(patch)
    owner, attribute = patch.owner, patch.attribute
    # Restore what the owner itself held (a class may inherit the attribute: then delete ours).
    own = vars(owner).get(attribute, _MISSING) if isinstance(owner, type) else getattr(owner, attribute, _MISSING)
    new = _composed(_raw(owner, attribute), patch.value, module) if patch.kind == "wrap" else patch.value
    _installed.append((owner, attribute, own))
    setattr(owner, attribute, new)


def _undo() -> None:
    while _installed:
        owner, attribute, own = _installed.pop()
        if own is _MISSING:
            delattr(owner, attribute)
        else:
            setattr(owner, attribute, own)


def install(runtime: Runtime) -> None:
    """Apply every patch (once) and send work to `runtime` (replacing any earlier runtime)."""
    with _install_lock:
        runtime_module.set_current(runtime)
        if _installed:
            return
        try:
            for module, patch in ordered(_patch_list()):
                _apply(module, patch)
        except BaseException:
            _undo()
            raise


def uninstall() -> None:
    """Restore moto's own behaviour (tests; a process that stops its local cloud)."""
    with _install_lock:
        _undo()
        runtime_module.set_current(None)


def installed() -> bool:
    return bool(_installed)


@contextlib.contextmanager
def patched(runtime: Runtime) -> Iterator[Runtime]:
    """install(runtime) for the duration of a block (tests)."""
    install(runtime)
    try:
        yield runtime
    finally:
        uninstall()
