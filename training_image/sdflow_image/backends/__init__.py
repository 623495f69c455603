"""Training backends behind one interface (`base.Backend`): `colossalai` (Colossal-AI's Booster,
the first stack) and `accelerate` (accelerate's DDP and torch's FSDP2, the second stack).
`rules` says which backend and plugin a run gets and refuses impossible pairs; it imports no
torch, and neither does this package until `make` is called.
"""

from __future__ import annotations

import argparse
import importlib
from typing import TYPE_CHECKING

from sdflow_image.backends.rules import BACKENDS

if TYPE_CHECKING:
    from sdflow_image.backends.base import Backend

__all__ = ["BACKENDS", "make"]

CLASSES = {"colossalai": "ColossalAIBackend", "accelerate": "AccelerateBackend"}


def make(args: argparse.Namespace) -> Backend:
    """The backend `args.backend` names (its module imported only now: each needs its own stack)."""
    module = importlib.import_module(f"sdflow_image.backends.{args.backend}")
    backend: Backend = getattr(module, CLASSES[args.backend])(args)
    return backend
