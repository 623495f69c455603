"""sdflow.console.graph: the nodes and edges the console draws, read from an ASL definition."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sdflow.console import graph

ASL_PATH = Path(__file__).resolve().parents[2] / "statemachines" / "pipeline.asl.json"
MAP = "Download shards"


@pytest.fixture(scope="module")
def asl() -> dict[str, Any]:
    return json.loads(ASL_PATH.read_text())


@pytest.fixture(scope="module")
def pipeline() -> dict[str, Any]:
    return graph.build(ASL_PATH.read_text())


def _nodes(built: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {node["name"]: node for node in built["states"]}


def _edges(built: dict[str, Any], source: str) -> list[dict[str, Any]]:
    return [edge for edge in built["edges"] if edge["source"] == source]


def test_graph_pipeline_top_level_states_present_with_no_parent(asl: dict[str, Any], pipeline: dict[str, Any]) -> None:
    nodes = _nodes(pipeline)

    assert pipeline["start_at"] == asl["StartAt"]
    for name, state in asl["States"].items():
        assert nodes[name]["parent"] is None, name
        assert nodes[name]["type"] == state["Type"]
        assert nodes[name]["comment"] == state.get("Comment")


def test_graph_pipeline_map_inner_states_have_the_map_as_parent(asl: dict[str, Any], pipeline: dict[str, Any]) -> None:
    nodes = _nodes(pipeline)
    inner = asl["States"][MAP]["ItemProcessor"]["States"]

    assert inner, "the pipeline's Map holds states"
    for name, state in inner.items():
        assert nodes[name]["parent"] == MAP, name
        assert nodes[name]["type"] == state["Type"]
        assert nodes[name]["distributed"] is False
    assert len(pipeline["states"]) == len(asl["States"]) + len(inner)


def test_graph_pipeline_download_map_is_distributed_others_not(pipeline: dict[str, Any]) -> None:
    distributed = [node["name"] for node in pipeline["states"] if node["distributed"]]

    assert distributed == [MAP]


def test_graph_pipeline_choice_rules_give_labelled_choice_edges(asl: dict[str, Any], pipeline: dict[str, Any]) -> None:
    choices = {name: state for name, state in asl["States"].items() if state["Type"] == "Choice"}
    assert choices

    for name, state in choices.items():
        edges = _edges(pipeline, name)
        choice_edges = [(e["target"], e["label"]) for e in edges if e["kind"] == "choice"]
        assert [target for target, _ in choice_edges] == [rule["Next"] for rule in state["Choices"]]
        for (_, label), rule in zip(choice_edges, state["Choices"], strict=True):
            assert label is not None
            assert label.startswith(rule["Variable"]), (name, label)
        defaults = [e for e in edges if e["kind"] == "default"]
        assert [(e["target"], e["label"]) for e in defaults] == [(state["Default"], "default")]
        assert not [e for e in edges if e["kind"] == "next"]


def test_graph_check_trained_model_choice_label_names_variable_and_operator(pipeline: dict[str, Any]) -> None:
    edges = {e["target"]: e for e in _edges(pipeline, "Check trained model")}

    assert edges["Reuse trained model"]["kind"] == "choice"
    assert edges["Reuse trained model"]["label"] == "$.config.resume.training IsPresent"
    assert (edges["Train model"]["kind"], edges["Train model"]["label"]) == ("default", "default")


def test_graph_pipeline_next_fields_become_next_edges(asl: dict[str, Any], pipeline: dict[str, Any]) -> None:
    expected = {(name, state["Next"]) for name, state in asl["States"].items() if "Next" in state}

    found = {(e["source"], e["target"]) for e in pipeline["edges"] if e["kind"] == "next"}

    assert expected <= found
    assert all(e["label"] is None for e in pipeline["edges"] if e["kind"] == "next")


def test_graph_pipeline_end_flags_follow_end_and_terminal_types(asl: dict[str, Any], pipeline: dict[str, Any]) -> None:
    nodes = _nodes(pipeline)
    everything = dict(asl["States"]) | asl["States"][MAP]["ItemProcessor"]["States"]

    for name, state in everything.items():
        assert nodes[name]["end"] is (bool(state.get("End")) or state["Type"] in {"Succeed", "Fail"}), name
    assert nodes["Deploy endpoint"]["end"] is True
    assert nodes["Start run"]["end"] is False


def test_graph_catch_gives_catch_edge_labelled_with_its_errors() -> None:
    definition = {
        "StartAt": "Work",
        "States": {
            "Work": {
                "Type": "Task",
                "Resource": "arn:aws:states:::lambda:invoke",
                "Catch": [
                    {"ErrorEquals": ["States.Timeout", "Lambda.ServiceException"], "Next": "Cleanup"},
                    {"ErrorEquals": ["States.ALL"], "Next": "Failed"},
                ],
                "Next": "Done",
            },
            "Cleanup": {"Type": "Pass", "Next": "Failed"},
            "Failed": {"Type": "Fail", "Error": "X"},
            "Done": {"Type": "Succeed"},
        },
    }

    built = graph.build(json.dumps(definition))

    catches = [(e["target"], e["label"]) for e in _edges(built, "Work") if e["kind"] == "catch"]
    assert catches == [("Cleanup", "States.Timeout, Lambda.ServiceException"), ("Failed", "States.ALL")]
    nodes = _nodes(built)
    assert (nodes["Failed"]["end"], nodes["Done"]["end"], nodes["Cleanup"]["end"]) == (True, True, False)


def test_graph_parallel_branch_states_have_the_parallel_as_parent() -> None:
    definition = {
        "StartAt": "Both",
        "States": {
            "Both": {
                "Type": "Parallel",
                "Branches": [
                    {"StartAt": "Left", "States": {"Left": {"Type": "Pass", "End": True}}},
                    {"StartAt": "Right", "States": {"Right": {"Type": "Wait", "Seconds": 1, "Next": "Right done"},
                                                    "Right done": {"Type": "Pass", "End": True}}},
                ],
                "End": True,
            }
        },
    }  # fmt: skip

    nodes = _nodes(graph.build(definition))

    assert nodes["Both"]["parent"] is None
    assert {name: node["parent"] for name, node in nodes.items() if name != "Both"} == {
        "Left": "Both",
        "Right": "Both",
        "Right done": "Both",
    }
    assert not any(node["distributed"] for node in nodes.values())


def test_graph_inline_map_with_iterator_is_parent_and_not_distributed() -> None:
    definition = {
        "StartAt": "Each",
        "States": {
            "Each": {"Type": "Map", "Iterator": {"StartAt": "One", "States": {"One": {"Type": "Pass", "End": True}}},
                     "End": True},
        },
    }  # fmt: skip

    nodes = _nodes(graph.build(definition))

    assert (nodes["One"]["parent"], nodes["Each"]["distributed"]) == ("Each", False)


@pytest.mark.parametrize(
    "definition",
    [
        "{not json",
        "",
        "[]",
        "null",
        '{"StartAt": "A"}',
        '{"StartAt": "A", "States": []}',
        '{"StartAt": "A", "States": {"A": "Pass"}}',
    ],
)
def test_graph_build_unreadable_definition_raises_unreadable_definition(definition: str) -> None:
    with pytest.raises(graph.UnreadableDefinition):
        graph.build(definition)


def test_recent_keeps_only_the_most_recently_used_entries() -> None:
    from sdflow.console.aws import Recent

    recent: Recent[int] = Recent(2)
    recent["a"], recent["b"] = 1, 2
    assert recent["a"] == 1  # a is now the newest
    recent["c"] = 3

    assert list(recent) == ["a", "c"]
