"""notify: the message a person reads for each way a run ends (handler and history: test_notify_handler.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from sdflow_common import names, notify
from tests.constants import ACCOUNT, REGION
from tests.unit.helpers import load_event

EXECUTION_ARN = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:sdflow-pipeline-test:cats-v1-abc"
STARTED = "2026-11-22T10:00:00.000Z"
STOPPED = "2026-11-22T12:14:05.000Z"
NOW = datetime(2026, 11, 23, 0, 0, 0, tzinfo=UTC)

SUCCESS_STATE: dict[str, Any] = {
    "config": {"run_id": "cats-v1-abc", "run": {"run_name": "cats-v1"}},
    "dataset": {
        "index_uri": "s3://b/runs/cats-v1-abc/dataset/index.json",
        "total_samples": 94812,
        "shards_ok": 99,
        "shards_failed": 1,
        "failed_shards": [{"shard_id": "00042", "parquet_uri": "s3://b/datasets/part-00042.parquet"}],
    },
    "training": {
        "job_name": "sdf-tr-cats-v1-0123456789-r0-a0",
        "model_data_url": "s3://b/runs/cats-v1-abc/training/job/output/model/",
        "final_metrics": {"train:loss": 0.09123},
    },
    "endpoint": {
        "endpoint_name": "cats",
        "endpoint_config_name": "cats-0123456789-r0-a0",
        "model_name": "cats-0123456789-r0-a0",
        "action": "update",
    },
}


def _request(outcome: notify.Outcome, state: dict[str, Any], **fields: Any) -> notify.NotifyRequest:
    return notify.NotifyRequest(
        outcome=outcome,
        execution_arn=EXECUTION_ARN,
        execution_name="cats-v1-abc",
        start_time=STARTED,
        stop_time=STOPPED,
        state=state,
        **fields,
    )


# ---------------------------------------------------------------------------- the message


def test_notify_success_message_names_duration_shards_loss_and_endpoint() -> None:
    message = notify.compose(_request("succeeded", SUCCESS_STATE), now=NOW)

    assert message.subject == "[sdflow] Run cats-v1 (cats-v1-abc) succeeded"
    text = message.message
    assert "SUCCEEDED in 2 h 14 min" in text
    assert "99 of 100 shards downloaded, 94,812 samples" in text
    assert "failed shard 00042: s3://b/datasets/part-00042.parquet" in text
    assert "final loss 0.0912" in text
    assert "Endpoint:  cats (updated blue/green" in text
    assert "invoke-endpoint --endpoint-name cats" in text
    assert f"#/v2/executions/details/{EXECUTION_ARN}" in text
    assert "Cleanup:" not in text
    assert "redrive" not in text
    assert message.attributes == {"outcome": "succeeded", "run_id": "cats-v1-abc", "endpoint": "cats"}


def test_notify_success_with_adherence_metrics_reports_base_and_trained_and_where_the_plots_are() -> None:
    training = {
        **SUCCESS_STATE["training"],
        "final_metrics": {"train:loss": 0.09, "eval:prompt_adherence": 0.8542, "eval:base_prompt_adherence": 0.104},
    }

    text = notify.compose(_request("succeeded", {**SUCCESS_STATE, "training": training}), now=NOW).message

    assert "prompt adherence: base 0.10 → trained 0.85 (held-out prompts)" in text
    # The uncompressed model's files are objects of their own: each plot's own URI.
    model = "s3://b/runs/cats-v1-abc/training/job/output/model/"
    assert f"loss curve {model}loss.png, samples {model}samples.png" in text
    assert f"held-out prompts {model}adherence.png" in text


def test_notify_success_with_older_model_tar_gz_says_the_plots_are_in_it() -> None:
    training = {**SUCCESS_STATE["training"], "model_data_url": "s3://b/runs/old/training/job/output/model.tar.gz"}

    text = notify.compose(_request("succeeded", {**SUCCESS_STATE, "training": training}), now=NOW).message

    assert "model s3://b/runs/old/training/job/output/model.tar.gz" in text
    assert "loss curve loss.png, samples samples.png, held-out prompts adherence.png (in it)" in text


def test_notify_success_without_adherence_metrics_prints_no_adherence_line() -> None:
    text = notify.compose(_request("succeeded", SUCCESS_STATE), now=NOW).message

    assert "prompt adherence" not in text


REGISTRY = {
    "model": {
        "model_package_arn": f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:model-package/sdf-cats-v1/3",
        "approval_status": "Approved",
        "prompt_adherence": 0.875,
        "base_prompt_adherence": 0.125,
        "min_prompt_adherence": 0.8,
        "prompts": 48,
        "samples_uri": "s3://b/runs/cats-v1-abc/evaluation/sdf-ev-job/adherence.png",
    }
}


def test_notify_success_with_registered_model_names_package_score_gate_and_samples() -> None:
    text = notify.compose(_request("succeeded", {**SUCCESS_STATE, "registry": REGISTRY}), now=NOW).message

    assert "Model:     arn:aws:sagemaker:us-east-1:123456789012:model-package/sdf-cats-v1/3 (Approved)" in text
    # An older run's result (flat prompt adherence only) reads as the prompt_adherence metric.
    assert "prompt_adherence ↑: base 0.12 → trained 0.88 (48 scene prompts)" in text
    assert "quality gate: prompt_adherence ≥ 0.80" in text
    assert (
        "scene prompts grid (base | trained per prompt): s3://b/runs/cats-v1-abc/evaluation/sdf-ev-job/adherence.png"
        in (text)
    )


def test_notify_quality_gate_failed_gives_score_and_suggests_a_resumed_run_not_a_redrive() -> None:
    state = {key: SUCCESS_STATE[key] for key in ("config", "dataset", "training")}
    cause = (
        "prompt adherence 0.41 is below the quality gate 0.80 (evaluation.min_prompt_adherence): model package "
        "arn:aws:sagemaker:us-east-1:123456789012:model-package/sdf-cats-v1/4 is registered as Rejected and was "
        "not deployed; endpoint cats keeps serving its current model. Samples (base | trained per prompt): "
        "s3://b/runs/cats-v1-abc/evaluation/sdf-ev-job/adherence.png"
    )

    text = notify.compose(
        _request("failed", state, error="QualityGateFailed", cause=cause, running_state="Register model"), now=NOW
    ).message

    assert "0.41 is below the quality gate 0.80" in text
    assert "adherence.png" in text
    assert f"sdflow resume {EXECUTION_ARN} --manifest NEW.json" in text
    assert "redrive-execution" not in text


def test_notify_approval_timed_out_says_how_to_approve_and_redrive() -> None:
    pending = {"model": {**REGISTRY["model"], "approval_status": "PendingManualApproval"}}
    state = {key: SUCCESS_STATE[key] for key in ("config", "dataset", "training")} | {"registry": pending}

    text = notify.compose(
        _request("failed", state, error="States.Timeout", cause="", running_state="Wait for approval"), now=NOW
    ).message

    assert "nobody approved the model in time" in text
    assert "--model-package-arn arn:aws:sagemaker:us-east-1:123456789012:model-package/sdf-cats-v1/3" in text
    assert f"redrive-execution --execution-arn {EXECUTION_ARN}" in text


def test_notify_failure_of_validation_lists_each_field_error_and_says_nothing_started() -> None:
    cause = json.dumps(
        {
            "errorType": "InvalidRunDocument",
            "errorMessage": json.dumps(
                [
                    {"field": "training.instance_count", "message": "Input should be greater than or equal to 1"},
                    {"field": "dataset.parquet_uris", "message": "is empty"},
                ]
            ),
        }
    )
    request = _request(
        "failed",
        {},
        running_state="Validate run",
        error="InvalidRunDocument",
        cause=cause,
        cleanup=["Nothing was left running."],
    )

    message = notify.compose(request, now=NOW)

    assert message.subject == "[sdflow] Run cats-v1-abc FAILED"
    assert "FAILED after 2 h 14 min, in state: Validate run." in message.message
    assert "nothing was started; fix the run document" in message.message
    assert "redrive-execution" not in message.message
    assert "Error:     InvalidRunDocument" in message.message
    assert "  - training.instance_count: Input should be greater than or equal to 1" in message.message
    assert "  - dataset.parquet_uris: is empty" in message.message
    assert message.attributes["error"] == "InvalidRunDocument"
    assert "endpoint" not in message.attributes


def test_notify_failure_during_training_names_state_cleanup_and_how_to_resume() -> None:
    state = {"config": SUCCESS_STATE["config"], "dataset": SUCCESS_STATE["dataset"]}
    cleanup = ["Stopped: 1 training job (sdf-tr-x)", "endpoint cats rolled back to config old"]
    request = _request(
        "failed",
        state,
        running_state="Train model",
        error="TrainingJobFailed",
        cause="AlgorithmError: CUDA out of memory",
        cleanup=cleanup,
        redrive_count=1,
    )

    message = notify.compose(request, now=NOW).message

    assert "FAILED after 2 h 14 min, in state: Train model. (redrive 1)" in message
    assert "AlgorithmError: CUDA out of memory" in message
    assert "99 of 100 shards downloaded" in message
    assert (
        "Cleanup:   Stopped: 1 training job (sdf-tr-x)\n           endpoint cats rolled back to config old" in message
    )
    assert f"aws stepfunctions redrive-execution --execution-arn {EXECUTION_ARN}" in message
    assert f"sdflow resume {EXECUTION_ARN}" in message


def test_notify_aborted_run_says_stopped_and_by_whom() -> None:
    request = _request(
        "aborted",
        {"config": SUCCESS_STATE["config"]},
        running_state="Download shards",
        error="UserStopped",
        cause="stopped by alice@example.com: wrong dataset",
        cleanup=["Stopped: 2 download jobs (a, b)"],
    )

    message = notify.compose(request, now=NOW)

    assert message.subject == "[sdflow] Run cats-v1 (cats-v1-abc) STOPPED"
    assert "was STOPPED after 2 h 14 min (StopExecution), in state: Download shards." in message.message
    assert "Stopped by / because: stopped by alice@example.com: wrong dataset" in message.message
    assert message.attributes["outcome"] == "aborted"


def test_notify_aborted_by_local_cloud_stop_says_so_and_offers_no_redrive() -> None:
    request = _request(
        "aborted",
        {"config": SUCCESS_STATE["config"]},
        running_state="Train model",
        error=notify.LOCAL_CLOUD_STOPPED,
        cause="The local cloud stopped while this run was running.",
    )

    message = notify.compose(request, now=NOW).message

    assert "(the local cloud stopped), in state: Train model." in message
    assert "StopExecution" not in message
    assert "redrive-execution" not in message
    assert "sdflow resume" not in message
    assert "start the local cloud again (sdflow local up) and start the run anew" in message


def test_notify_aborted_without_cause_says_no_reason_was_given() -> None:
    message = notify.compose(_request("aborted", {}, running_state="Train model"), now=NOW).message

    assert "Stopped by a StopExecution call that gave no error or cause." in message
    assert "UnknownError" not in message


def test_notify_timed_out_run_says_it_exceeded_its_time_limit() -> None:
    message = notify.compose(_request("timed_out", {}, running_state="Train model"), now=NOW)

    assert message.subject.endswith("TIMED OUT")
    assert "TIMED OUT after 2 h 14 min: the run exceeded its time limit" in message.message
    assert "Error:     States.Timeout" in message.message
    assert message.attributes["error"] == "States.Timeout"


def test_notify_very_long_cause_is_truncated_and_subject_fits_sns_limit() -> None:
    request = notify.NotifyRequest(
        outcome="failed",
        execution_arn=EXECUTION_ARN,
        execution_name="z" * 80,
        start_time=STARTED,
        state={"config": {"run_id": "z", "run": {"run_name": "x" * 40}}},
        error="States.Timeout",
        cause="y" * 10_000,
    )

    message = notify.compose(request, now=NOW)

    assert len(message.subject) <= notify.SUBJECT_LIMIT
    assert len(message.message) < notify.CAUSE_LIMIT + 1500


@pytest.mark.parametrize(
    "document_keys",
    [
        {"training": {"instance_count": 0}, "dataset": {"prefix": "s3://b/x/"}},
        {"dataset": {"parquet_uris": []}},
        {"config": {"run": {"run_name": "x\ny"}}, "endpoint": {"name": "e"}},
    ],
)
def test_notify_validation_failure_with_document_keys_in_state_names_validate_run_and_no_progress(
    document_keys: dict[str, Any],
) -> None:
    """Keys a run document shares with the pipeline's results (training, dataset, config, endpoint) are
    not progress: only what the steps wrote counts, and lines without data are left out. With no
    state named by the history, the step is judged from the results."""
    message = notify.compose(_request("failed", document_keys, error="InvalidRunDocument", cause="[]"), now=NOW)

    assert "in state: Validate run" in message.message
    for placeholder in ("0 of 0 shards", "job ?", "Dataset:", "Training:", "Endpoint:", "config ?"):
        assert placeholder not in message.message
    assert "endpoint" not in message.attributes
    assert message.subject == "[sdflow] Run cats-v1-abc FAILED"


def test_notify_subject_of_any_execution_name_is_a_valid_sns_subject() -> None:
    request = notify.NotifyRequest(
        outcome="failed", execution_arn=EXECUTION_ARN, execution_name="caf\u00e9-\u2028-" + "\u00fc" * 90
    )

    subject = notify.compose(request, now=NOW).subject

    assert len(subject) < 100
    assert subject.isascii()
    assert subject.isprintable()


def test_notify_tolerated_intake_warnings_are_listed() -> None:
    warning = {"field": "dataset.url_column", "message": "column 'URL' is not in 1 of 3 objects (s3://b/p2.parquet)"}
    state = {**SUCCESS_STATE, "config": {**SUCCESS_STATE["config"], "warnings": [warning]}}

    message = notify.compose(_request("succeeded", state), now=NOW)

    assert "dataset.url_column: column 'URL' is not in 1 of 3 objects (s3://b/p2.parquet)" in message.message


@pytest.mark.parametrize(
    ("event_file", "outcome"),
    [
        ("stepfunctions_execution_succeeded.json", "succeeded"),
        ("stepfunctions_execution_failed.json", "failed"),
        ("stepfunctions_execution_timed_out.json", "timed_out"),
        ("stepfunctions_execution_aborted.json", "aborted"),
    ],
)
def test_notify_sample_event_parses_with_its_outcome_and_dates(event_file: str, outcome: notify.Outcome) -> None:
    change = notify.ExecutionStatusChange.model_validate(load_event(event_file))

    assert change.detail.outcome == outcome
    request = notify.NotifyRequest.from_event(change.detail)
    assert request.start_time == "2026-11-22T10:00:00Z"
    assert names.run_hash(change.detail.execution_arn, change.detail.start_date) == names.run_hash(
        EXECUTION_ARN, request.start_time
    )
