"""The execution graph's nodes and edges, read from an Amazon States Language definition.

The console draws what the execution ran: the definition comes from
DescribeStateMachineForExecution (the version the execution started with), so a run started by
an older template is drawn as it was. Placement is the page's layout library's job (dagre);
this only says which states exist, which Map holds which, and where each can go next."""

from __future__ import annotations

import json
from typing import Any


class UnreadableDefinition(ValueError):
    """The definition is not the JSON object of states that ASL describes."""


def _edges_of(name: str, state: dict[str, Any]) -> list[dict[str, Any]]:
    edges: list[dict[str, Any]] = []
    if state.get("Next"):
        edges.append({"source": name, "target": state["Next"], "kind": "next", "label": None})
    for rule in state.get("Choices") or []:
        if isinstance(rule, dict) and rule.get("Next"):
            edges.append({"source": name, "target": rule["Next"], "kind": "choice", "label": _choice_label(rule)})
    if state.get("Default"):
        edges.append({"source": name, "target": state["Default"], "kind": "default", "label": "default"})
    for catcher in state.get("Catch") or []:
        if isinstance(catcher, dict) and catcher.get("Next"):
            label = ", ".join(catcher.get("ErrorEquals") or [])
            edges.append({"source": name, "target": catcher["Next"], "kind": "catch", "label": label or None})
    return edges


def _choice_label(rule: dict[str, Any]) -> str | None:
    """A short reading of a Choice rule (`$.x IsPresent`), or its JSONata Condition."""
    if "Condition" in rule:
        return str(rule["Condition"])[:60]
    variable = rule.get("Variable")
    operators = [key for key in rule if key not in {"Variable", "Next", "Comment", "Assign", "Output"}]
    if variable and operators:
        return f"{variable} {operators[0]}"[:60]
    return str(rule.get("Comment"))[:60] if rule.get("Comment") else None


def _walk(states: dict[str, Any], parent: str | None, nodes: list[dict[str, Any]], edges: list[dict[str, Any]]) -> None:
    for name, state in states.items():
        if not isinstance(state, dict):
            raise UnreadableDefinition(f"state {name!r} is not an object")
        processor = state.get("ItemProcessor") or state.get("Iterator")
        distributed = bool(processor and (processor.get("ProcessorConfig") or {}).get("Mode") == "DISTRIBUTED")
        nodes.append(
            {
                "name": name,
                "type": str(state.get("Type", "?")),
                "parent": parent,
                "comment": state.get("Comment"),
                "end": bool(state.get("End")) or state.get("Type") in {"Succeed", "Fail"},
                "distributed": distributed,
            }
        )
        edges.extend(_edges_of(name, state))
        if isinstance(processor, dict) and isinstance(processor.get("States"), dict):
            _walk(processor["States"], name, nodes, edges)
        for branch in state.get("Branches") or []:
            if isinstance(branch, dict) and isinstance(branch.get("States"), dict):
                _walk(branch["States"], name, nodes, edges)


def build(definition: str | dict[str, Any]) -> dict[str, Any]:
    try:
        document = json.loads(definition) if isinstance(definition, str) else definition
    except ValueError as exc:
        raise UnreadableDefinition(f"the state machine definition is not JSON: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("States"), dict):
        raise UnreadableDefinition("the state machine definition has no States object")
    nodes: list[dict[str, Any]] = []
    edges: list[dict[str, Any]] = []
    _walk(document["States"], None, nodes, edges)
    return {"start_at": document.get("StartAt"), "states": nodes, "edges": edges}
