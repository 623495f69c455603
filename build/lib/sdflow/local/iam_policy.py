"""IAM identity-policy evaluation for the local cloud: Allow/Deny, Action/NotAction,
Resource/NotResource, wildcards, Condition operators.

AWS's rules, as the IAM User Guide states them:
- reference_policies_evaluation-logic.html: an explicit Deny in any policy wins; otherwise an
  Allow in any policy allows; otherwise the request is implicitly denied.
- reference_policies_elements_action.html / _resource.html: `*` matches any run of characters and
  `?` any one; action names are not case-sensitive; `*` alone matches every resource. In an ARN the
  wildcards work within a segment (partition, service, region, account), while the resource part
  (after the fifth colon) is matched as a whole, so "log-group:/aws/sagemaker/*" covers
  "log-group:/aws/sagemaker/X:log-stream:Y".
- reference_policies_elements_condition.html: operators in a block, and keys under an operator,
  are ANDed; the values listed for one key are ORed (NORed for a negated operator); key names are
  not case-sensitive.
- reference_policies_elements_condition_operators.html: "If the key that you specify in a policy
  condition is not present in the request context, the values do not match and the condition is
  false. If the policy condition requires that the key is not matched, such as StringNotLike or
  ArnNotLike, and the right key is not present, the condition is true", except for ...IfExists
  (absent key: true) and Null. ForAnyValue: an absent key is false; ForAllValues: an absent key
  is true (reference_policies_condition-single-vs-multi-valued-context-keys.html).

Only what a local cloud needs: date, IP-address and binary operators and policy variables
(`${aws:username}`) are refused with PolicyError rather than guessed."""

from __future__ import annotations

import enum
import functools
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Context = Mapping[str, Sequence[str]]  # lower-case condition key -> the request's values


class PolicyError(ValueError):
    """A policy document the local evaluator cannot read; the message names the element."""


class Decision(enum.Enum):
    ALLOW = "allow"
    EXPLICIT_DENY = "explicit deny"
    IMPLICIT_DENY = "implicit deny"  # no statement allows


@functools.lru_cache(maxsize=4096)
def _wildcard(pattern: str, ignore_case: bool = False) -> re.Pattern[str]:
    body = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.compile(body, re.IGNORECASE | re.DOTALL if ignore_case else re.DOTALL)


def wildcard_match(pattern: str, value: str, ignore_case: bool = False) -> bool:
    return _wildcard(pattern, ignore_case).fullmatch(value) is not None


@functools.lru_cache(maxsize=4096)
def _arn_pattern(pattern: str) -> re.Pattern[str]:
    """One regex per ARN pattern: wildcards stay within the first five segments, the resource
    part is matched whole (the same as splitting both ARNs at their first five colons)."""
    segments = pattern.split(":", 5)
    if len(segments) != 6:
        return _wildcard(pattern)

    def segment(text: str, within: bool) -> str:
        anything = "[^:]*" if within else ".*"
        one = "[^:]" if within else "."
        return "".join(anything if c == "*" else one if c == "?" else re.escape(c) for c in text)

    body = ":".join(segment(part, True) for part in segments[:5]) + ":" + segment(segments[5], False)
    return re.compile(body, re.DOTALL)


def arn_match(pattern: str, arn: str) -> bool:
    """A Resource (or ArnLike value) against an ARN: segment by segment, the resource part whole."""
    if pattern == "*":
        return True
    if arn.count(":") < 5:
        return wildcard_match(pattern, arn)
    return _arn_pattern(pattern).fullmatch(arn) is not None


def _values(raw: Any, where: str) -> tuple[str, ...]:
    items = raw if isinstance(raw, list) else [raw]
    out = []
    for item in items:
        if isinstance(item, (dict, list)) or item is None:
            raise PolicyError(f"{where}: expected a string or a list of strings, got {item!r}")
        text = str(item).lower() if isinstance(item, bool) else str(item)
        if "${" in text:
            raise PolicyError(f"{where}: policy variables such as {text!r} are not evaluated locally")
        out.append(text)
    return tuple(out)


# ------------------------------------------------------------------------------ conditions


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _numeric(compare: Callable[[float, float], bool]) -> Callable[[str, str], bool]:
    def match(request: str, policy: str) -> bool:
        left, right = _number(request), _number(policy)
        return left is not None and right is not None and compare(left, right)

    return match


# operator -> (does one request value match one policy value, is the operator negated)
_OPERATORS: dict[str, tuple[Callable[[str, str], bool], bool]] = {
    "StringEquals": (lambda r, p: r == p, False),
    "StringNotEquals": (lambda r, p: r == p, True),
    "StringEqualsIgnoreCase": (lambda r, p: r.lower() == p.lower(), False),
    "StringNotEqualsIgnoreCase": (lambda r, p: r.lower() == p.lower(), True),
    "StringLike": (lambda r, p: wildcard_match(p, r), False),
    "StringNotLike": (lambda r, p: wildcard_match(p, r), True),
    "ArnEquals": (lambda r, p: arn_match(p, r), False),
    "ArnLike": (lambda r, p: arn_match(p, r), False),
    "ArnNotEquals": (lambda r, p: arn_match(p, r), True),
    "ArnNotLike": (lambda r, p: arn_match(p, r), True),
    "Bool": (lambda r, p: r.lower() == p.lower(), False),
    "NumericEquals": (_numeric(lambda a, b: a == b), False),
    "NumericNotEquals": (_numeric(lambda a, b: a == b), True),
    "NumericLessThan": (_numeric(lambda a, b: a < b), False),
    "NumericLessThanEquals": (_numeric(lambda a, b: a <= b), False),
    "NumericGreaterThan": (_numeric(lambda a, b: a > b), False),
    "NumericGreaterThanEquals": (_numeric(lambda a, b: a >= b), False),
}


@dataclass(frozen=True)
class Condition:
    operator: str  # as written, e.g. "ForAnyValue:StringLikeIfExists"
    key: str  # lower case
    values: tuple[str, ...]

    def matches(self, context: Context) -> bool:
        present = context.get(self.key)
        operator = self.operator
        qualifier, _, operator = operator.rpartition(":")
        if operator == "Null":
            want_absent = any(v.lower() == "true" for v in self.values)
            return (not present) == want_absent
        if_exists = operator.endswith("IfExists")
        compare, negated = _OPERATORS[operator.removesuffix("IfExists")]
        if not present:
            if qualifier == "ForAllValues":
                return True
            if qualifier == "ForAnyValue":
                return False
            return if_exists or negated

        def hit(value: str) -> bool:
            return any(compare(value, p) for p in self.values)

        if qualifier == "ForAllValues":
            return all(hit(v) != negated for v in present)
        if negated and qualifier != "ForAnyValue":
            return not any(hit(v) for v in present)
        return any(hit(v) != negated for v in present)


def _conditions(block: Any, where: str) -> tuple[Condition, ...]:
    if not isinstance(block, dict):
        raise PolicyError(f"{where}: Condition must be an object of operator -> {{key: values}}")
    out = []
    for operator, keys in block.items():
        qualifier, _, base = operator.rpartition(":")
        if qualifier not in ("", "ForAnyValue", "ForAllValues") or (
            base != "Null" and base.removesuffix("IfExists") not in _OPERATORS
        ):
            known = ", ".join([*_OPERATORS, "Null"])
            raise PolicyError(f"{where}: condition operator {operator!r} is not evaluated locally; use one of {known}")
        if not isinstance(keys, dict):
            raise PolicyError(f"{where}.{operator}: expected an object of condition key -> values")
        for key, raw in keys.items():
            out.append(Condition(operator, key.lower(), _values(raw, f"{where}.{operator}.{key}")))
    return tuple(out)


# ------------------------------------------------------------------------------ statements


@dataclass(frozen=True)
class Statement:
    deny: bool
    actions: tuple[str, ...]
    not_action: bool
    resources: tuple[str, ...]
    not_resource: bool
    conditions: tuple[Condition, ...]
    sid: str = ""

    def applies(self, action: str, resource: str, context: Context) -> bool:
        if any(wildcard_match(a, action, ignore_case=True) for a in self.actions) == self.not_action:
            return False
        if any(arn_match(r, resource) for r in self.resources) == self.not_resource:
            return False
        return all(c.matches(context) for c in self.conditions)


def _one_of(raw: dict[str, Any], names: tuple[str, str], where: str) -> tuple[str, bool]:
    present = [n for n in names if n in raw]
    if len(present) != 1:
        raise PolicyError(f"{where}: an identity-policy statement needs exactly one of {names[0]} or {names[1]}")
    return present[0], present[0].startswith("Not")


def parse_statement(raw: Any, where: str) -> Statement:
    if not isinstance(raw, dict):
        raise PolicyError(f"{where}: a statement must be an object")
    effect = raw.get("Effect")
    if effect not in ("Allow", "Deny"):
        raise PolicyError(f"{where}.Effect must be 'Allow' or 'Deny', got {effect!r}")
    if "Principal" in raw or "NotPrincipal" in raw:
        raise PolicyError(f"{where}: Principal belongs in resource-based policies, not in a role's policy")
    action_key, not_action = _one_of(raw, ("Action", "NotAction"), where)
    resource_key, not_resource = _one_of(raw, ("Resource", "NotResource"), where)
    return Statement(
        deny=effect == "Deny",
        actions=_values(raw[action_key], f"{where}.{action_key}"),
        not_action=not_action,
        resources=_values(raw[resource_key], f"{where}.{resource_key}"),
        not_resource=not_resource,
        conditions=_conditions(raw.get("Condition", {}), f"{where}.Condition"),
        sid=str(raw.get("Sid", "")),
    )


class PolicySet:
    """Every statement of a principal's identity policies, parsed once."""

    def __init__(self, statements: Iterable[Statement]) -> None:
        self.statements = tuple(statements)

    @classmethod
    def from_documents(cls, documents: Mapping[str, str | dict[str, Any]]) -> PolicySet:
        """documents: policy name -> JSON text or parsed document."""
        statements: list[Statement] = []
        for name, document in documents.items():
            doc = json.loads(document) if isinstance(document, str) else document
            raw = doc.get("Statement") if isinstance(doc, dict) else None
            if raw is None:
                raise PolicyError(f"policy {name}: has no Statement")
            for index, statement in enumerate(raw if isinstance(raw, list) else [raw]):
                statements.append(parse_statement(statement, f"policy {name}.Statement[{index}]"))
        return cls(statements)

    def evaluate(self, action: str, resource: str, context: Context | None = None) -> Decision:
        allowed = False
        for statement in self.statements:
            if statement.applies(action, resource, context or {}):
                if statement.deny:
                    return Decision.EXPLICIT_DENY
                allowed = True
        return Decision.ALLOW if allowed else Decision.IMPLICIT_DENY
