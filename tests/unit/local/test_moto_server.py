"""The moto server's request routing: computed once per host."""

from __future__ import annotations

from typing import Any

import pytest
from moto import backends
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

from sdflow.local import runtime as runtime_module


def _counting_module_listing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    listing = backends.list_of_moto_modules

    def counted() -> Any:
        calls[0] += 1
        return listing()

    monkeypatch.setattr(backends, "list_of_moto_modules", counted)
    return calls


def test_moto_gap_routing_lists_moto_package_on_every_request(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting_module_listing(monkeypatch)
    app = DomainDispatcherApplication(create_backend_app)
    for _ in range(3):
        assert app.get_backend_for_host("states.us-east-1.amazonaws.com") == "stepfunctions"
    assert calls[0] == 3


def test_patch_routing_computed_once_per_host(runtime: runtime_module.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting_module_listing(monkeypatch)
    app = DomainDispatcherApplication(create_backend_app)
    for _ in range(3):
        assert app.get_backend_for_host("states.us-east-1.amazonaws.com") == "stepfunctions"
        assert app.get_backend_for_host("s3") == "s3"
    assert calls[0] == 2
    assert runtime.moto_routes["s3"] == "s3"
