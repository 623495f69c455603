"""boto3 sessions for the local cloud's own clients, all reading botocore's data through one loader.

A botocore session parses what it reads (endpoints.json: ~13 MB of Python objects; a service
model: sagemaker's ~18 MB) into its own loader's cache. The local cloud makes a session per
client of its own (the CLI credentials' clients, the deployment's, the state machine's role
clients, the SageMaker host's transfers) and each parsed the same files again: a census of a
10,000-shard bench run found five loaders in the cloud process. Sessions stay separate
(credentials, region, event handlers); the loader's data is read-only, so one serves them all."""

from __future__ import annotations

import threading
from typing import Any

import boto3
import botocore.loaders
import botocore.session


class SearchPaths(list[str]):
    """A botocore loader's search paths, to which every boto3 session appends its own data folder:
    a loader shared by many sessions keeps one copy of it instead of one per session."""

    def append(self, path: str) -> None:
        if path not in self:
            super().append(path)


_lock = threading.Lock()
_loader: botocore.loaders.Loader | None = None


def shared_loader() -> botocore.loaders.Loader:
    """The process's one loader for botocore's default data path."""
    global _loader
    with _lock:
        if _loader is None:
            _loader = botocore.loaders.Loader(extra_search_paths=SearchPaths())
        return _loader


def botocore_session() -> botocore.session.Session:
    core = botocore.session.Session()
    core.register_component("data_loader", shared_loader())
    return core


def session(**kwargs: Any) -> boto3.session.Session:
    """boto3.session.Session(**kwargs) on the shared loader."""
    return boto3.session.Session(botocore_session=botocore_session(), **kwargs)
