"""Step Functions: what the patch modules of moto's interpreter (LocalStack's) share: finding the
interpreter modules that copied a name they patch, and raising a `States.*` failure as the
interpreter does."""

from __future__ import annotations

import contextlib
from typing import Any


def import_interpreter_modules() -> None:
    """Imports every interpreter module, so each `from … import name` copy exists before it is patched."""
    import importlib
    import pkgutil

    import moto.stepfunctions.parser.asl as asl

    for module in pkgutil.walk_packages(asl.__path__, asl.__name__ + "."):
        with contextlib.suppress(Exception):
            importlib.import_module(module.name)


def interpreter_modules_importing(owner: Any, attribute: str) -> list[Any]:
    """Every interpreter module other than `owner` that did `from <owner> import <attribute>`:
    patching `owner` alone leaves their copies of moto's function in place."""
    import sys

    moto_function = getattr(owner, attribute)
    return [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("moto.stepfunctions.parser")
        and module is not owner
        and getattr(module, attribute, None) is moto_function
    ]


def states_failure(env: Any, error_type: Any, cause: str, *, map_run: bool = False) -> Exception:
    """The FailureEventException moto's interpreter raises for a `States.*` error (`error_type`, a
    StatesErrorNameType), recorded as a TaskFailed event, or as MapRunFailed for a Map Run."""
    from moto.stepfunctions.parser.api import HistoryEventType, MapRunFailedEventDetails, TaskFailedEventDetails
    from moto.stepfunctions.parser.asl.component.common.error_name.failure_event import (
        FailureEvent,
        FailureEventException,
    )
    from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name import StatesErrorName
    from moto.stepfunctions.parser.asl.eval.event.event_detail import EventDetails

    if map_run:
        event_type = HistoryEventType.MapRunFailed
        details = EventDetails(  # type: ignore[typeddict-item]
            mapRunFailedEventDetails=MapRunFailedEventDetails(error=error_type.to_name(), cause=cause)
        )
    else:
        event_type = HistoryEventType.TaskFailed
        failed = TaskFailedEventDetails(error=error_type.to_name(), cause=cause)
        details = EventDetails(taskFailedEventDetails=failed)  # type: ignore[typeddict-item]
    return FailureEventException(
        failure_event=FailureEvent(
            env=env, error_name=StatesErrorName(typ=error_type), event_type=event_type, event_details=details
        )
    )
