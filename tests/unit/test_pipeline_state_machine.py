"""statemachines/pipeline.asl.json executed by moto's Step Functions interpreter: the flow, the data
passed between states, approvals, the Distributed Map (tests/unit/pipeline_harness.py plays the
functions; test_pipeline_state_machine_faults.py holds the Retry, Catch and timeout paths)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from sdflow_common import names
from tests.unit.helpers import DATA_BUCKET
from tests.unit.pipeline_harness import (
    ASL,
    DAY,
    DEDUP_SUMMARY_URI,
    HOUR,
    HOURS_4,
    PACKAGE_ARN,
    RUN_DOCUMENT,
    Pipeline,
    answer_all_success,
    final_state,
    pipeline_definition_text,
    raise_behaviour,
    register_behaviour,
    validate_run_behaviour,
)


def test_pipeline_all_steps_succeed_with_every_result_in_the_output(pipeline: Pipeline) -> None:
    result = pipeline.run(answer_all_success)

    assert result["status"] == "SUCCEEDED"
    state = final_state(result)
    assert state["dataset"]["shards_ok"] == 3
    assert state["training"]["final_metrics"] == {"train:loss": 0.125}
    assert state["endpoint"]["endpoint_name"] == "sdflow"
    downloads = pipeline.calls["StartDownloadFunction"]
    assert sorted(call["shard"]["shard_id"] for call in downloads) == ["00000", "00001", "00002"]
    assert {call["attempt"] for call in downloads} == {0}
    first = downloads[0]
    assert first["dataset"] == {"url_column": "URL", "caption_column": "TEXT", "filters": None}
    assert first["execution_arn"] == result["executionArn"], "names must hash the parent execution"
    assert first["run_id"] == state["config"]["run_id"]
    training = pipeline.calls["StartTrainingFunction"][0]
    assert training["dataset"]["index_uri"].endswith("/dataset/index.json")
    assert pipeline.calls["StartEvaluationFunction"][0]["training"]["job_name"] == "sdf-tr-x"
    register = pipeline.calls["RegisterModelFunction"][0]
    assert register["evaluation"]["evaluation_uri"] == "s3://b/runs/x/evaluation/sdf-ev-x/"
    assert register["dataset"]["index_uri"].endswith("/dataset/index.json")
    assert not pipeline.calls["AwaitApprovalFunction"], "auto approval deploys at once"
    deploy = pipeline.calls["DeployEndpointFunction"][0]
    assert deploy["training"]["job_name"] == "sdf-tr-x"
    assert deploy["model"]["model_package_arn"] == PACKAGE_ARN


def test_pipeline_quality_gate_failed_fails_the_run_before_deploy(pipeline: Pipeline) -> None:
    pipeline.behaviours["RegisterModelFunction"] = raise_behaviour(
        "QualityGateFailed", "prompt adherence 0.40 is below 0.80"
    )

    result = pipeline.run(answer_all_success)

    assert result["status"] == "FAILED"
    assert result.get("error") == "QualityGateFailed"
    assert len(pipeline.calls["RegisterModelFunction"]) == 1, "a failed gate is not retried"
    assert not pipeline.calls["DeployEndpointFunction"]


def test_pipeline_manual_approval_waits_for_the_decision_then_deploys(pipeline: Pipeline) -> None:
    pipeline.behaviours["RegisterModelFunction"] = register_behaviour("PendingManualApproval")

    result = pipeline.run(answer_all_success)

    assert result["status"] == "SUCCEEDED", result.get("cause")
    [wait] = pipeline.calls["AwaitApprovalFunction"]
    assert wait["model_package_arn"] == PACKAGE_ARN
    assert wait["timeout_seconds"] == 4 * HOUR + 4
    assert final_state(result)["approval"]["approval_status"] == "Approved"
    assert pipeline.calls["DeployEndpointFunction"]


@pytest.mark.parametrize(
    ("answer_approval", "error"),
    [
        (("failure", ("ModelRejected", "model package was rejected: blurry")), "ModelRejected"),
        (None, "States.Timeout"),
    ],
    ids=["rejected", "timed-out"],
)
def test_pipeline_manual_approval_rejected_or_timed_out_fails_without_deploy(
    pipeline: Pipeline, answer_approval: tuple[str, Any] | None, error: str
) -> None:
    pipeline.behaviours["RegisterModelFunction"] = register_behaviour("PendingManualApproval")
    pipeline.behaviours["ValidateRunFunction"] = validate_run_behaviour(
        pipeline.s3, 1, {"download": 4 * HOUR, "training": 4 * HOUR, "endpoint": 4 * HOUR, "approval": DAY}
    )

    def answer(name: str, payload: dict[str, Any]) -> tuple[str, Any] | None:
        if name != "AwaitApprovalFunction":
            return answer_all_success(name, payload)
        if answer_approval is None:  # nobody decides: a day passes
            pipeline.pass_task_timeout()
        return answer_approval

    result = pipeline.run(answer)

    assert result["status"] == "FAILED"
    assert result.get("error") == error
    assert not pipeline.calls["DeployEndpointFunction"]


def test_pipeline_callback_payloads_carry_the_execution_identity_and_the_timeout(pipeline: Pipeline) -> None:
    """Job names hash the execution ARN, its start time and the redrive count; the claim's
    deadline is the task's timeout."""
    result = pipeline.run(answer_all_success)

    assert result["status"] == "SUCCEEDED"
    started = result["startDate"].timestamp()
    calls = {
        "download": (pipeline.calls["StartDownloadFunction"][0], 4 * HOUR),
        "training": (pipeline.calls["StartTrainingFunction"][0], 4 * HOUR + 1),
        "endpoint": (pipeline.calls["DeployEndpointFunction"][0], 4 * HOUR + 2),
    }
    for kind, (call, timeout) in calls.items():
        assert call["execution_arn"] == result["executionArn"], kind
        assert abs(names.start_millis(call["start_time"]) / 1000 - started) < 1, kind
        assert call["redrive_count"] == 0, kind
        assert call["timeout_seconds"] == timeout, kind
    assert calls["download"][0]["child_redrive_count"] == 0


def test_pipeline_download_payload_carries_config_holdout_rate(pipeline: Pipeline) -> None:
    """Validate run chooses the held-out rate; every shard's download job must split by the same one."""
    validate = pipeline.behaviours["ValidateRunFunction"]
    pipeline.behaviours["ValidateRunFunction"] = lambda payload: {**validate(payload), "holdout_rate": 0.05}

    result = pipeline.run(answer_all_success)

    assert result["status"] == "SUCCEEDED"
    assert [call["holdout_rate"] for call in pipeline.calls["StartDownloadFunction"]] == [0.05] * len(
        pipeline.calls["StartDownloadFunction"]
    )
    dataset = final_state(result)["dataset"]
    assert (dataset["holdout_samples"], dataset["holdout_manifest_uri"]) == (0, None)
    # Build dataset index's curation totals travel in $.dataset (the notification and Register model read them).
    assert dataset["curation"]["kept"] == 100


def test_pipeline_state_stays_small_whatever_the_shard_count(pipeline: Pipeline) -> None:
    pipeline.behaviours["ValidateRunFunction"] = validate_run_behaviour(pipeline.s3, 40, HOURS_4)
    result = pipeline.run(answer_all_success)

    assert result["status"] == "SUCCEEDED"
    assert len(pipeline.calls["StartDownloadFunction"]) == 40
    state = final_state(result)
    assert "Download shards" not in state, "the Map's result must be discarded"
    assert len(json.dumps(state)) < 4096


def test_pipeline_map_writes_child_results_under_the_runs_prefix(pipeline: Pipeline) -> None:
    result = pipeline.run(answer_all_success)

    assert result["status"] == "SUCCEEDED"
    execution = result["executionArn"].split(":")[-1]
    listed = pipeline.s3.list_objects_v2(Bucket=DATA_BUCKET, Prefix=f"runs/{execution}/download-results/")
    keys = [obj["Key"] for obj in listed.get("Contents", [])]
    assert sorted(key.rsplit("/", 1)[-1] for key in keys) == ["SUCCEEDED_0.json", "manifest.json"], keys
    manifest_key = next(key for key in keys if key.endswith("/manifest.json"))
    manifest = json.loads(pipeline.s3.get_object(Bucket=DATA_BUCKET, Key=manifest_key)["Body"].read())
    assert manifest["DestinationBucket"] == DATA_BUCKET
    assert ":mapRun:" in manifest["MapRunArn"]


def test_pipeline_map_children_return_empty_objects_even_when_collected_inline(pipeline: Pipeline) -> None:
    """Were the results collected into the state (no ResultWriter), each shard would cost 3 bytes."""
    definition = json.loads(pipeline_definition_text())
    download = definition["States"]["Download shards"]
    del download["ResultWriter"]
    download["ResultPath"] = "$.download_results"
    pipeline.sfn.update_state_machine(stateMachineArn=pipeline.arn, definition=json.dumps(definition))

    result = pipeline.run(answer_all_success)

    assert result["status"] == "SUCCEEDED"
    assert final_state(result)["download_results"] == [{}, {}, {}]


def test_pipeline_definition_names_states_as_verb_phrases() -> None:
    definition = json.loads(ASL.read_text())
    names = list(definition["States"]) + list(definition["States"]["Download shards"]["ItemProcessor"]["States"])
    for name in names:
        assert re.fullmatch(r"[A-Z][a-z]+( [a-z]+)+", name), f"state '{name}' is not a verb phrase"


def test_pipeline_deduplication_enabled_finds_duplicates_before_the_index(pipeline: Pipeline) -> None:
    result = pipeline.run(answer_all_success)

    assert result["status"] == "SUCCEEDED", result.get("cause")
    [find] = pipeline.calls["FindDuplicatesFunction"]
    assert find["config"]["run"]["deduplication"]["enabled"] is True
    assert find["timeout_seconds"] == find["config"]["timeouts"]["dedup"] == 4 * HOUR + 5
    assert find["attempt"] == 0
    assert find["execution_arn"] == result["executionArn"]
    [index] = pipeline.calls["BuildIndexFunction"]
    assert index["dedup"] == {"job_name": "sdf-dd-x", "summary_uri": DEDUP_SUMMARY_URI}
    assert set(index) == {"config", "dedup"}
    assert final_state(result)["dedup"]["summary_uri"] == DEDUP_SUMMARY_URI


def test_pipeline_deduplication_disabled_goes_straight_to_the_index(pipeline: Pipeline) -> None:
    document = {**RUN_DOCUMENT, "deduplication": {"enabled": False}}

    result = pipeline.run(answer_all_success, document)

    assert result["status"] == "SUCCEEDED", result.get("cause")
    assert not pipeline.calls["FindDuplicatesFunction"]
    [index] = pipeline.calls["BuildIndexFunction"]
    assert set(index) == {"config"}, "no $.dedup: Build dataset index counts no duplicates"
    assert "dedup" not in final_state(result)


def test_pipeline_config_without_the_deduplication_block_skips_it(pipeline: Pipeline) -> None:
    validate = pipeline.behaviours["ValidateRunFunction"]

    def without_block(payload: dict[str, Any]) -> Any:
        config = validate(payload)
        del config["run"]["deduplication"]
        return config

    pipeline.behaviours["ValidateRunFunction"] = without_block

    result = pipeline.run(answer_all_success)

    assert result["status"] == "SUCCEEDED", result.get("cause")
    assert not pipeline.calls["FindDuplicatesFunction"]


def test_pipeline_failed_dedup_job_fails_the_run_before_the_index(pipeline: Pipeline) -> None:
    def fail_dedup(name: str, payload: dict[str, Any]) -> tuple[str, Any]:
        if name == "FindDuplicatesFunction":
            return "failure", ("DedupJobFailed", "dedup job sdf-dd-x ended Failed: out of disk")
        return answer_all_success(name, payload)

    result = pipeline.run(fail_dedup)

    assert result["status"] == "FAILED"
    assert result.get("error") == "DedupJobFailed"
    assert not pipeline.calls["BuildIndexFunction"]
