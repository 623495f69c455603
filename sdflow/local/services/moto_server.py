"""The moto server itself: request routing made cheap enough for a 10,000-shard run."""

from __future__ import annotations

from typing import Any

from sdflow.local.patching import Patch, wrap
from sdflow.local.runtime import runtime_or_none


def get_backend_for_host(inner: Any, self: Any, host: str | None) -> Any:
    """Wraps moto/moto_server/werkzeug_app.py DomainDispatcherApplication.get_backend_for_host.

    moto answers "which backend serves this host?" on every request by listing moto's package
    folder (os.listdir plus an isdir per entry, ~200 stat calls) and then trying every service's
    URL regex, all inside the dispatcher's global lock: in a 10,000-shard run that was over 40 %
    of the server's CPU and serialised every request. The answer depends on the host alone, and a
    run sees a few dozen hosts, so it is computed once per host."""
    runtime = runtime_or_none()
    routes = runtime.moto_routes if runtime is not None else {}
    if host in routes:
        return routes[host]
    backend = inner(self, host)
    if backend is not None:  # a miss is rare and prints moto's hint: let it print every time
        routes[host] = backend  # one dict item assignment: atomic under the GIL
    return backend


def patches() -> list[Patch]:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication

    return [wrap(DomainDispatcherApplication, "get_backend_for_host", get_backend_for_host)]
