"""The ECR repository's lifecycle policy in template.yaml: it expires only images no stack parameter can name."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis.strategies import from_regex

from sdflow.local.template import load_template

TEMPLATE = Path(__file__).resolve().parents[2] / "template.yaml"


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    return load_template(TEMPLATE)


def _lifecycle_rules(template: dict[str, Any]) -> list[dict[str, Any]]:
    text = template["Resources"]["TrainingRepository"]["Properties"]["LifecyclePolicy"]["LifecyclePolicyText"]
    return list(json.loads(text)["rules"])


def _tag_matches(pattern: str, tag: str) -> bool:
    """ECR's tagPatternList: `*` matches any run of characters (Amazon ECR user guide, "Lifecycle
    policy properties")."""
    return re.fullmatch(".*".join(re.escape(part) for part in pattern.split("*")), tag) is not None


def _rule_selects(rule: dict[str, Any], tag: str) -> bool:
    """Whether a rule's selection may pick an image carrying `tag` (and expire it, by count or age)."""
    selection = rule["selection"]
    if selection["tagStatus"] == "any":
        return True
    if selection["tagStatus"] == "untagged":
        return False
    if "tagPatternList" in selection:
        return all(_tag_matches(pattern, tag) for pattern in selection["tagPatternList"])
    return all(tag.startswith(prefix) for prefix in selection["tagPrefixList"])


@given(tag=from_regex(r"\A[a-zA-Z0-9_][a-zA-Z0-9_.-]{0,30}\Z"))
@settings(max_examples=200, deadline=None)
def test_ecr_lifecycle_rule_never_selects_a_tag_the_stack_can_run(template: dict[str, Any], tag: str) -> None:
    """Issue 32 item 3: two image streams (TrainingImageTag, AccelerateImageTag) share the
    repository, and a live endpoint, a rollback target (an endpoint config's model) and the
    download jobs name images by tag: an image any of them may use must never expire. A count
    rule over every image ("keep the 20 newest") expired the first stream's image after 20 pushes
    of the second. Only images no stack parameter can name are selected: untagged ones, and the
    scratch tags the parameters' AllowedPattern refuses."""
    patterns = [template["Parameters"][name]["AllowedPattern"] for name in ("TrainingImageTag", "AccelerateImageTag")]
    assume(all(re.fullmatch(pattern, tag) for pattern in patterns))
    assert not [rule for rule in _lifecycle_rules(template) if _rule_selects(rule, tag)]


def test_ecr_lifecycle_rule_expires_untagged_and_scratch_images(template: dict[str, Any]) -> None:
    """What the policy may expire, it does: untagged images and scratch builds, so the repository
    does not only grow; and each tag parameter refuses a scratch tag, naming it."""
    rules = _lifecycle_rules(template)
    assert any(rule["selection"]["tagStatus"] == "untagged" for rule in rules)
    assert any(_rule_selects(rule, "scratch-20261128") for rule in rules)
    for name in ("TrainingImageTag", "AccelerateImageTag"):
        parameter = template["Parameters"][name]
        assert not re.fullmatch(parameter["AllowedPattern"], "scratch-20261128")
        assert "scratch-" in parameter["ConstraintDescription"]
