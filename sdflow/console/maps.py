"""The states inside a Distributed Map, coloured from its child executions.

A Distributed Map's states run in its child executions, not in the parent: the parent's history
has no event of them, so drawn from it alone they read "not reached" while every child ran
through them. Each child's path is known from its input (DescribeExecution, after the Map's
ItemSelector) and the Map's ItemProcessor: Choice rules are evaluated on that input, the way the
child evaluated them; the child's status says how its path ended (the last state of a failed
child's path is where it failed). Where a rule cannot be evaluated here (a path after a Task
changed the input, an operator not read here) the walk stops: those states stay uncoloured
rather than guessed. A sample of children is read (the first page, and failed ones first when
there are failures), so a 10,000-child Map costs a page and a Describe per child once."""

from __future__ import annotations

import json
from typing import Any

SAMPLE = 50  # children read per Map Run: one ListExecutions page
FAILED_SAMPLE = 20  # failed children read besides, so that a failure is seen in a large Map
ENDED_BADLY = {"FAILED", "TIMED_OUT", "PENDING_REDRIVE"}
# When children disagree, the colour a person must see first.
PRECEDENCE = ("running", "failed", "aborted", "succeeded")
MISSING = object()
# States that hand their input on unchanged unless one of these fields says otherwise.
_RESHAPING = ("InputPath", "Parameters", "Result", "ResultPath", "ResultSelector", "OutputPath", "Output", "Assign")


class _Unreadable(Exception):
    """A Choice rule this reading does not evaluate."""


def processors(definition: str | dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each Map state's ItemProcessor (or Iterator), by the Map's name."""
    document = json.loads(definition) if isinstance(definition, str) else definition
    found: dict[str, dict[str, Any]] = {}

    def walk(states: Any) -> None:
        for name, state in (states or {}).items() if isinstance(states, dict) else ():
            if not isinstance(state, dict):
                continue
            processor = state.get("ItemProcessor") or state.get("Iterator")
            if isinstance(processor, dict) and isinstance(processor.get("States"), dict):
                found[name] = processor
                walk(processor["States"])
            for branch in state.get("Branches") or []:
                if isinstance(branch, dict):
                    walk(branch.get("States"))

    walk(document.get("States") if isinstance(document, dict) else None)
    return found


def _lookup(document: Any, path: Any) -> Any:
    if not isinstance(path, str) or not path.startswith("$"):
        raise _Unreadable(f"variable {path!r}")
    value = document
    for part in [p for p in path[1:].split(".") if p]:
        if "[" in part:
            raise _Unreadable(f"variable {path!r}")
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


_COMPARE = {
    "StringEquals": lambda v, x: isinstance(v, str) and v == x,
    "BooleanEquals": lambda v, x: isinstance(v, bool) and v == x,
    "NumericEquals": lambda v, x: isinstance(v, int | float) and not isinstance(v, bool) and v == x,
    "NumericLessThan": lambda v, x: isinstance(v, int | float) and not isinstance(v, bool) and v < x,
    "NumericGreaterThan": lambda v, x: isinstance(v, int | float) and not isinstance(v, bool) and v > x,
    "NumericLessThanEquals": lambda v, x: isinstance(v, int | float) and not isinstance(v, bool) and v <= x,
    "NumericGreaterThanEquals": lambda v, x: isinstance(v, int | float) and not isinstance(v, bool) and v >= x,
    "IsNull": lambda v, x: (v is None) == bool(x),
    "IsBoolean": lambda v, x: isinstance(v, bool) == bool(x),
    "IsString": lambda v, x: isinstance(v, str) == bool(x),
    "IsNumeric": lambda v, x: (isinstance(v, int | float) and not isinstance(v, bool)) == bool(x),
}


def matches(rule: dict[str, Any], document: Any) -> bool:
    """One Choice rule (ASL JSONPath: And/Or/Not, Variable with an operator) on a document."""
    if "And" in rule:
        return all(matches(r, document) for r in rule["And"])
    if "Or" in rule:
        return any(matches(r, document) for r in rule["Or"])
    if "Not" in rule:
        return not matches(rule["Not"], document)
    value = _lookup(document, rule.get("Variable"))
    operators = [key for key in rule if key not in {"Variable", "Next", "Comment"}]
    if len(operators) != 1:
        raise _Unreadable(f"rule {operators}")
    operator = operators[0]
    if operator == "IsPresent":
        return (value is not MISSING) == bool(rule[operator])
    if operator not in _COMPARE:
        raise _Unreadable(operator)
    return value is not MISSING and bool(_COMPARE[operator](value, rule[operator]))


def path_of(processor: dict[str, Any], document: Any) -> tuple[list[str], bool]:
    """The states a child with this input passes through, and whether the walk reached an end
    (False: it stopped at a Choice it cannot evaluate here)."""
    states = processor.get("States") or {}
    name, path, known = processor.get("StartAt"), [], True
    while isinstance(name, str) and name in states and name not in path:
        path.append(name)
        state = states[name]
        if state.get("Type") == "Choice":
            if not known:
                return path, False
            try:
                chosen = next((r.get("Next") for r in state.get("Choices") or [] if matches(r, document)), None)
            except _Unreadable:
                return path, False
            name = chosen or state.get("Default")
            continue
        if state.get("End") or state.get("Type") in {"Succeed", "Fail"}:
            return path, True
        known = known and state.get("Type") in {"Pass", "Wait"} and not any(k in state for k in _RESHAPING)
        name = state.get("Next")
    return path, False


def _outcome(path: list[str], complete: bool, status: str) -> dict[str, str]:
    """Each state of one child's path with how the child left it."""
    marks = dict.fromkeys(path, "succeeded")
    if path and complete and status != "SUCCEEDED":
        last = "running" if status == "RUNNING" else "aborted" if status == "ABORTED" else "failed"
        marks[path[-1]] = last
    return marks


def colour(processor: dict[str, Any], children: list[tuple[str, Any]], total: int) -> dict[str, Any]:
    """{"sampled", "total", "states": {name: {"status", "counts": {status: n}}}} from the
    children read: (status, input document) each."""
    counts: dict[str, dict[str, int]] = {}
    for status, document in children:
        path, complete = path_of(processor, document)
        for name, mark in _outcome(path, complete, status).items():
            by_status = counts.setdefault(name, {})
            by_status[mark] = by_status.get(mark, 0) + 1
    states = {
        name: {"status": next(s for s in PRECEDENCE if by_status.get(s)), "counts": by_status}
        for name, by_status in counts.items()
    }
    return {"sampled": len(children), "total": total, "states": states}
