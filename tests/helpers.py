"""Helpers every test layer shares: a free port, polling until something holds, a function's module."""

from __future__ import annotations

import importlib.util
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(predicate: Callable[[], Any], *, timeout_s: float, what: str, interval_s: float) -> Any:
    """Poll `predicate` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def shared_botocore_loader() -> Callable[[str | None], Any]:
    """botocore.session's `create_loader`, answering one loader for every session that uses the
    default data path: each service's model is then parsed once per test process, not once per
    session (moto's mock starts a new default session for every test, sdflow_common.aws a new one
    after every reset_clients: 0.1-0.2 s of CPU per model read).
    Parsing them was three quarters of the unit tests' CPU: tests/unit took 684 s serially, 268 s
    with one loader."""
    import botocore.loaders
    import botocore.session

    from sdflow.local.sessions import SearchPaths

    original = botocore.session.create_loader
    loader = botocore.loaders.Loader(extra_search_paths=SearchPaths())

    def create_loader(search_path_string: str | None = None) -> Any:
        return loader if search_path_string is None else original(search_path_string)

    return create_loader


def load_function_module(purpose: str) -> ModuleType:
    """Import functions/<purpose>/app.py under a unique module name.

    Every function's module is called `app`, as SAM expects, so a plain import would let
    the first one shadow the others."""
    path = REPO_ROOT / "functions" / purpose / "app.py"
    name = f"sdflow_fn_{purpose}"
    sys.modules.pop(name, None)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None, path
    assert spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
