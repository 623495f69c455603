"""template.yaml's resources, policies and states as the template tests read them (tests/unit/test_template*.py):
IAM's matching of Allow statements, and the template's `${...}` resolved for one stack."""

from __future__ import annotations

import re
from typing import Any


def template_resources(template: dict[str, Any], kind: str) -> dict[str, Any]:
    return {name: r for name, r in template["Resources"].items() if r["Type"] == kind}


def all_states(states: dict[str, Any]) -> dict[str, Any]:
    found = dict(states)
    for state in states.values():
        if "ItemProcessor" in state:
            found |= all_states(state["ItemProcessor"]["States"])
    return found


def policy_statements(template: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for name, resource in template["Resources"].items():
        props = resource.get("Properties", {})
        for policy in props.get("Policies", []) or []:
            if isinstance(policy, dict) and "Statement" in policy:
                found += [(name, s) for s in policy["Statement"]]
            elif isinstance(policy, dict) and "PolicyDocument" in policy:
                found += [(name, s) for s in policy["PolicyDocument"]["Statement"]]
    return found


STACK = "sdflow"
ENDPOINT_PREFIX = "team-a-"  # not the default: the tests below tell the stack's name from the prefix
PIPELINE = f"arn:aws:states:us-east-1:123456789012:stateMachine:{STACK}-pipeline"


def resolve_sub(value: Any) -> str:
    """A Resource of the template as the stack `sdflow` in us-east-1 would have it."""
    if isinstance(value, dict) and "Fn::Sub" in value:
        text = value["Fn::Sub"]
        for name, actual in {
            "AWS::Partition": "aws",
            "AWS::Region": "us-east-1",
            "AWS::AccountId": "123456789012",
            "AWS::StackName": STACK,
            "DataBucket.Arn": "arn:aws:s3:::sdflow-data",
            "EndpointNamePrefix": ENDPOINT_PREFIX,
        }.items():
            text = text.replace(f"${{{name}}}", actual)
        assert "${" not in text, text
        return str(text)
    assert isinstance(value, str), value
    return value


def allows(template: dict[str, Any], resource_name: str, action: str, arn: str) -> bool:
    """IAM's matching for Allow statements without conditions: `*` spans any characters, `/` and `:` included."""
    for name, statement in policy_statements(template):
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
        if name != resource_name or statement.get("Effect") != "Allow" or action not in actions:
            continue
        for pattern in map(resolve_sub, resources):
            regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
            if re.fullmatch(regex, arn):
                return True
    return False
