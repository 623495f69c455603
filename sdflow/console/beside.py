"""The run console beside a local cloud: `sdflow local up` and `sdflow demo` start one.

Its port is chosen before the stack is deployed, because notifications carry its URL (the
template parameter ConsoleUrl)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from sdflow.session import CliError, Session


def console_port_for(requested: int | None) -> int | None:
    """The console's port, chosen before the stack is deployed (notifications link to it);
    None: no console. 0 asks for any free port."""
    if requested is None:
        return None
    if requested == 0:
        from sdflow.local.sagemaker.host import free_port

        return free_port()
    return requested


def console_url(port: int) -> str:
    from sdflow.console.server import HOST

    return f"http://{HOST}:{port}/"


@contextlib.contextmanager
def console_beside(cloud: Any, port: int | None) -> Iterator[Any]:
    """The run console on `port`, reading `cloud`, for as long as the block runs."""
    if port is None:
        yield None
        return
    from sdflow.console.server import ConsoleServer

    try:
        server = ConsoleServer(Session.for_cloud(cloud).console_config(), port=port).start()
    except OSError as exc:
        raise CliError(f"{exc}; or --no-console") from None
    try:
        yield server
    finally:
        server.stop()
