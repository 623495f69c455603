"""FilterLogEvents' filter patterns (sdflow/local/services/filter_pattern.py, services/logs.py)."""

from __future__ import annotations

import json
import time

import pytest
from botocore.exceptions import ClientError

from sdflow.local import runtime as runtime_module
from sdflow.local.services.filter_pattern import FilterPatternError, compile_pattern
from tests.unit.local.helpers import client

# The user guide's examples for unstructured events.
UNSTRUCTURED = [
    "[ERROR 400] BAD REQUEST",
    "[ERROR 401] UNAUTHORIZED REQUEST",
    "[ERROR 419] MISSING ARGUMENTS",
    "[ERROR 420] INVALID ARGUMENTS",
]
JSON_EVENTS = [
    json.dumps({"level": "ERROR", "message": "shard failed", "latency": 1200, "shard": {"index": 3}, "retry": True}),
    json.dumps({"level": "INFO", "message": "shard done", "latency": 80, "shard": {"index": 1}, "retry": False}),
    json.dumps({"level": "WARNING", "message": "slow", "latency": 700.5, "tags": ["a", "b"], "cause": None}),
    "START RequestId: 1 Version: $LATEST",
]


def _matching(pattern: str, messages: list[str]) -> list[int]:
    matches = compile_pattern(pattern)
    return [index for index, message in enumerate(messages) if matches(message)]


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("", [0, 1, 2, 3]),
        ("ERROR", [0, 1, 2, 3]),
        ("ERROR ARGUMENTS", [2, 3]),
        ("?ARGUMENTS ?BAD", [0, 2, 3]),
        ('"MISSING ARGUMENTS"', [2]),
        ("ERROR -ARGUMENTS", [0, 1]),
        ('-"BAD REQUEST"', [1, 2, 3]),
        ("error", []),  # terms are case-sensitive
        ("NOTHERE", []),
    ],
)
def test_filter_pattern_unstructured_terms_match_as_documented(pattern: str, expected: list[int]) -> None:
    assert _matching(pattern, UNSTRUCTURED) == expected


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ('{ $.level = "ERROR" }', [0]),
        ("{ $.level = ERROR }", [0]),
        ('{ $.level != "ERROR" }', [1, 2]),
        ('{ $.message = "shard*" }', [0, 1]),
        ("{ $.message = *done }", [1]),
        ("{ $.latency > 500 }", [0, 2]),
        ("{ $.latency <= 700.5 }", [1, 2]),
        ("{ $.latency = 80 }", [1]),
        ("{ $.latency != 80 }", [0, 2]),
        ("{ $.shard.index >= 2 }", [0]),
        ("{ $.tags[1] = b }", [2]),
        ('{ $.level = "ERROR" || $.latency < 100 }', [0, 1]),
        ('{ ($.level = "ERROR" || $.level = "WARNING") && $.latency > 1000 }', [0]),
        ("{ $.retry IS TRUE }", [0]),
        ("{ $.retry IS FALSE }", [1]),
        ("{ $.cause IS NULL }", [2]),
        ("{ $.shard NOT EXISTS }", [2]),  # a JSON pattern never matches a non-JSON event
        ('{ $.missing = "x" }', []),
        ('{ $.level = "error" }', []),
    ],
)
def test_filter_pattern_json_selects_fields_as_documented(pattern: str, expected: list[int]) -> None:
    assert _matching(pattern, JSON_EVENTS) == expected


def test_filter_pattern_regex_between_percent_signs_searches_the_message() -> None:
    assert _matching("%ERROR 4[01]9%", UNSTRUCTURED) == [2]


@pytest.mark.parametrize(
    "pattern", ['{ $.level = "ERROR" ', "{ level = ERROR }", "{ $.latency > high }", '"unclosed', "[ip, user]"]
)
def test_filter_pattern_invalid_syntax_is_refused(pattern: str) -> None:
    with pytest.raises(FilterPatternError):
        compile_pattern(pattern)


def _group_with(messages: list[str]) -> str:
    logs = client("logs")
    logs.create_log_group(logGroupName="g")
    logs.create_log_stream(logGroupName="g", logStreamName="s")
    now = int(time.time() * 1000)
    logs.put_log_events(
        logGroupName="g", logStreamName="s", logEvents=[{"timestamp": now, "message": m} for m in messages]
    )
    return "g"


def _filtered(group: str, pattern: str) -> list[str]:
    return [e["message"] for e in client("logs").filter_log_events(logGroupName=group, filterPattern=pattern)["events"]]


def test_patch_filter_log_events_applies_json_terms_and_exclusions(runtime: runtime_module.Runtime) -> None:
    group = _group_with(JSON_EVENTS)

    assert _filtered(group, '{ $.level = "ERROR" }') == [JSON_EVENTS[0]]
    assert _filtered(group, "-shard") == [JSON_EVENTS[2], JSON_EVENTS[3]]
    assert _filtered(group, "?slow ?START") == [JSON_EVENTS[2], JSON_EVENTS[3]]
    assert _filtered(group, "NOTHERE") == []


def test_patch_filter_log_events_invalid_pattern_is_invalid_parameter(runtime: runtime_module.Runtime) -> None:
    group = _group_with(JSON_EVENTS)

    with pytest.raises(ClientError) as refused:
        _filtered(group, "{ $.level = ")

    assert refused.value.response["Error"]["Code"] == "InvalidParameterException"


def test_moto_gap_filter_log_events_ignores_json_and_exclusion_patterns(aws: None) -> None:
    group = _group_with(JSON_EVENTS)

    assert len(_filtered(group, '{ $.level = "ERROR" }')) == len(JSON_EVENTS)
    assert len(_filtered(group, "-shard")) == len(JSON_EVENTS)
