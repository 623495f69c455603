"""What the console's pages state, through its JSON API: an ended state's duration, a failure's
cause as sentences, the evaluation as rows, the Distributed Map's inner states, the endpoint's
model of another run, a shard of no images (issue 24, "What a person sees").

Fakes as in test_console_api.py (tests/unit/console_fakes.py); S3 is moto's."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest

from sdflow.console import maps
from sdflow.console.evaluation import evaluation_view
from sdflow_common import causes, names
from tests.unit.console_fakes import (
    ASL_PATH,
    MAP,
    NOTIFY_LOG_GROUP,
    T0,
    Console,
    History,
    add_run,
    execution_arn,
    install_clock,
    logs_client,
    map_run_arn,
    pipeline_history,
)
from tests.unit.helpers import DATA_BUCKET, AwsWorld

# What Step Functions' cause holds when Validate run's Lambda raised InvalidRunDocument.
PROBLEMS = [
    {"field": "dataset.prefix", "message": "no *.parquet objects below s3://b/datasets/x/; upload the parquet "
     "files there or fix the prefix"},
    {"field": "training.max_train_steps", "message": "must be at least 1; set it to the number of steps to train"},
]  # fmt: skip
LAMBDA_CAUSE = json.dumps(
    {
        "errorMessage": json.dumps(PROBLEMS),
        "errorType": "InvalidRunDocument",
        "requestId": "5c2e8d8e-8f0b-4a43-9d55-5d2f8e0e6b1a",
        "stackTrace": ['  File "/var/task/app.py", line 40, in handler\n    raise invalid(problems)\n'],
    }
)


@pytest.fixture
def console(mocked_aws: AwsWorld, monkeypatch: pytest.MonkeyPatch) -> Console:
    harness = Console()
    install_clock(monkeypatch, harness.clock)
    logs_client().create_log_group(logGroupName=NOTIFY_LOG_GROUP)
    return harness


def validation_failure(console: Console, name: str = "bad-run") -> None:
    """A run whose Validate run raised InvalidRunDocument: the TaskFailed ended the execution."""
    h = History()
    h.add("ExecutionStarted", 0, executionStartedEventDetails={"input": "{}"})
    h.enter("Start run", "Pass")
    h.exit("Start run", "Pass")
    h.enter("Validate run")
    h.add("TaskScheduled")
    h.add("TaskStarted")
    h.add("TaskFailed", taskFailedEventDetails={"error": "InvalidRunDocument", "cause": LAMBDA_CAUSE})
    h.add("ExecutionFailed", executionFailedEventDetails={"error": "InvalidRunDocument", "cause": LAMBDA_CAUSE})
    console.sfn.add_execution(name, status="FAILED", history=h, error="InvalidRunDocument", cause=LAMBDA_CAUSE)


# ---------------------------------------------------------------------- 1. durations


def test_run_failed_state_duration_ends_at_its_failure_not_now(console: Console) -> None:
    validation_failure(console)
    client = console.client()

    first = client.get("/api/runs/bad-run").json()["states"]["Validate run"]
    console.clock.advance(30)  # past every cache: a later poll computes it again
    again = client.get("/api/runs/bad-run").json()["states"]["Validate run"]

    # Entered at event 4, failed at event 7 (History stamps event n at T0 + n s); T0 is an hour ago.
    assert first["status"] == "failed"
    assert first["duration_s"] == pytest.approx(3.0)
    assert first["ended"] == (T0 + timedelta(seconds=7)).isoformat()
    assert again["duration_s"] == first["duration_s"]


def test_state_detail_of_failed_state_has_its_fixed_duration(console: Console) -> None:
    validation_failure(console)

    detail = console.client().get("/api/runs/bad-run/states/Validate run").json()

    assert detail["duration_s"] == pytest.approx(3.0)
    assert detail["exited"] is None  # no StateExited: the failure ended the run
    assert detail["ended"] == (T0 + timedelta(seconds=7)).isoformat()


def test_run_running_state_duration_counts_up_until_it_ends(console: Console) -> None:
    add_run(console)

    state = console.client().get("/api/runs/pokemon-sd15-7f3a9c2e41").json()["states"]["Check trained model"]

    assert state["ended"] is None
    assert state["duration_s"] > 3000  # entered about an hour ago and still running


# ---------------------------------------------------------------------- 2. causes as sentences


def test_run_validation_failure_reason_names_problem_fields_and_fixes(console: Console) -> None:
    validation_failure(console)

    run = console.client().get("/api/runs/bad-run").json()["run"]

    reason = run["reason"]
    assert reason["error"] == "InvalidRunDocument"
    assert "failed validation" in reason["title"]
    assert reason["problems"] == PROBLEMS
    assert reason["message"] is None
    assert "stackTrace" not in json.dumps(reason)
    assert run["cause"] == LAMBDA_CAUSE  # the raw cause stays for the page's disclosure


def test_state_detail_of_validation_failure_reason_read_from_lambda_error(console: Console) -> None:
    validation_failure(console)

    detail = console.client().get("/api/runs/bad-run/states/Validate run").json()

    assert detail["reason"]["problems"] == PROBLEMS


@pytest.mark.parametrize(
    ("cause", "message"),
    [
        (json.dumps({"errorMessage": "job sdf-tr-x ended Failed: out of memory", "errorType": "TrainingJobFailed",
                     "stackTrace": ['  File "/var/task/app.py", line 3']}), "job sdf-tr-x ended Failed: out of memory"),
        ('Traceback (most recent call last):\n  File "/x.py", line 1\nValueError: bad shard', "ValueError: bad shard"),
        ("the training job was stopped", "the training job was stopped"),
        (json.dumps({"Error": "Boom", "Cause": "it broke"}), "Error: Boom; Cause: it broke"),
    ],
)  # fmt: skip
def test_causes_read_other_causes_give_one_message_without_trace_or_json(cause: str, message: str) -> None:
    reason = causes.read("TrainingJobFailed", cause)

    assert reason is not None
    assert reason["message"] == message
    assert reason["problems"] is None
    assert reason["title"].startswith("The SageMaker training job ended Failed or Stopped")


def test_causes_read_step_functions_error_says_the_problem() -> None:
    reason = causes.read("States.Timeout", None)

    assert reason is not None
    assert "time limit" in reason["title"]
    assert reason["message"] is None


def test_causes_read_nothing_gives_none() -> None:
    assert causes.read(None, None) is None


# ---------------------------------------------------------------------- 3. evaluation


def test_evaluation_view_48_results_become_rows_and_scores_flat_numbers() -> None:
    results = [
        {"prompt": f"a red circle on a blue background {i}", "foreground": "red", "background": "blue",
         "shape": "circle", "foreground_ok": True, "background_ok": i % 2 == 0, "shape_ok": True}
        for i in range(48)
    ]  # fmt: skip
    document = {
        "prompt_adherence": 0.75, "base_prompt_adherence": 0.125, "prompts": 48, "foreground_accuracy": 1.0,
        "base": {"foreground_accuracy": 0.25}, "grid": "adherence.png",
        "settings": {"resolution": 32, "seed": 0}, "results": results,
    }  # fmt: skip

    view = evaluation_view(document)

    assert view["scores"] == {
        "prompt_adherence": 0.75, "base_prompt_adherence": 0.125, "prompts": 48, "foreground_accuracy": 1.0,
        "base foreground_accuracy": 0.25,
    }  # fmt: skip
    assert all(not isinstance(value, dict | list) for value in view["scores"].values())
    assert len(view["results"]) == 48
    assert view["results"][1]["background_ok"] is False
    assert view["settings"] == {"resolution": 32, "seed": 0}


def test_evaluation_view_unreadable_document_gives_no_scores() -> None:
    assert evaluation_view(None) == {
        "scores": None, "settings": {}, "results": [], "metrics": [], "missing": [], "gate": [],
        "holdout_samples": None,
    }  # fmt: skip


# ---------------------------------------------------------------------- 4. the Map's inner states


def test_map_path_of_pipeline_shard_cached_reuses_else_downloads() -> None:
    processor = maps.processors(ASL_PATH.read_text())[MAP]

    assert maps.path_of(processor, {"shard": {"cached": True}}) == (
        ["Check shard cache", "Reuse downloaded shard"],
        True,
    )
    assert maps.path_of(processor, {"shard": {"shard_id": "00001"}}) == (["Check shard cache", "Download shard"], True)


def test_run_map_inner_states_coloured_from_children_outcomes(console: Console) -> None:
    add_run(console, status="SUCCEEDED")
    arn = map_run_arn("pokemon-sd15-7f3a9c2e41")
    for i in range(3):
        console.sfn.add_child(arn, f"child-{i}", "SUCCEEDED", {"shard": {"shard_id": f"0000{i}"}})
    console.sfn.add_child(arn, "child-cached", "SUCCEEDED", {"shard": {"shard_id": "00009", "cached": True}})
    console.sfn.add_child(arn, "child-failed", "FAILED", {"shard": {"shard_id": "00005"}})

    inner = console.client().get("/api/runs/pokemon-sd15-7f3a9c2e41").json()["map_runs"][MAP]["inner"]

    assert inner["sampled"] == 5
    states = inner["states"]
    assert states["Check shard cache"] == {"status": "succeeded", "counts": {"succeeded": 5}}
    assert states["Download shard"] == {"status": "failed", "counts": {"succeeded": 3, "failed": 1}}
    assert states["Reuse downloaded shard"] == {"status": "succeeded", "counts": {"succeeded": 1}}


def test_run_map_inner_states_of_large_map_read_failed_children_first(console: Console) -> None:
    add_run(console, status="SUCCEEDED")
    arn = map_run_arn("pokemon-sd15-7f3a9c2e41")
    for i in range(maps.SAMPLE):
        console.sfn.add_child(arn, f"child-{i}", "SUCCEEDED", {"shard": {"shard_id": str(i)}})
    console.sfn.add_child(arn, "child-failed", "FAILED", {"shard": {"shard_id": "late"}})  # beyond the first page

    inner = console.client().get("/api/runs/pokemon-sd15-7f3a9c2e41").json()["map_runs"][MAP]["inner"]

    assert inner["states"]["Download shard"]["counts"]["failed"] == 1


def test_run_map_counts_say_how_many_succeeded_shards_held_no_image(console: Console) -> None:
    h = History()
    h.add("ExecutionStarted", 0, executionStartedEventDetails={"input": "{}"})
    h.enter(MAP, "Map")
    h.add("MapRunStarted", mapRunStartedEventDetails={"mapRunArn": map_run_arn("empty-shard")})
    h.add("MapRunSucceeded")
    h.exit(MAP, "Map")
    h.task("Build dataset index", output=json.dumps({"dataset": {"shards_ok": 4, "shards_empty": 1}}))
    add_run(console, "empty-shard", "RUNNING", h)

    counts = console.client().get("/api/runs/empty-shard").json()["map_runs"][MAP]["counts"]

    assert counts["empty"] == 1, "the Map Run counts the child as succeeded; the box must say it held no image"


# ---------------------------------------------------------------------- 5. the endpoint of a later run


def _deploying_run(console: Console, name: str, start: Any) -> None:
    h = pipeline_history(name)
    h.exit("Check trained model", "Choice")
    h.task("Deploy endpoint", output=json.dumps({"endpoint": {"resource_name": "sdflow"}}))
    h.add("ExecutionSucceeded")
    add_run(console, name, "SUCCEEDED", h)
    console.sfn.executions[execution_arn(name)]["startDate"] = start


def test_run_endpoint_serving_later_runs_model_names_that_run(console: Console) -> None:
    _deploying_run(console, "run-old", T0)
    _deploying_run(console, "run-new", T0 + timedelta(minutes=40))
    new_hash = names.run_hash(execution_arn("run-new"), T0 + timedelta(minutes=40))
    config = names.deployment_name("sdflow", new_hash, 0, 0)
    console.sagemaker.endpoints["sdflow"] = {"EndpointName": "sdflow", "EndpointStatus": "InService",
                                             "EndpointConfigName": config}  # fmt: skip
    variant = {"VariantName": "AllTraffic", "ModelName": config, "InstanceType": "ml.m5.large"}
    console.sagemaker.endpoint_configs[config] = {"ProductionVariants": [variant]}
    client = console.client()

    old = client.get("/api/runs/run-old").json()["endpoint"]
    new = client.get("/api/runs/run-new").json()["endpoint"]

    assert (old["serves_this_run"], old["serving_run"]) == (False, "run-new")
    assert (new["serves_this_run"], new["serving_run"]) == (True, None)


# ---------------------------------------------------------------------- 6. shards of no images


def test_children_shard_of_no_images_and_retried_shard_earlier_attempt_reported(
    console: Console, mocked_aws: AwsWorld
) -> None:
    add_run(console, status="SUCCEEDED")
    run_hash = names.run_hash(execution_arn("pokemon-sd15-7f3a9c2e41"), T0)
    arn = map_run_arn("pokemon-sd15-7f3a9c2e41")
    for shard, samples in (("00000", 0), ("00001", 101)):
        output = f"s3://{DATA_BUCKET}/runs/r1/shards/{shard}/"
        console.sfn.add_child(arn, f"child-{shard}", "SUCCEEDED", {"shard": {"shard_id": shard, "output_uri": output}})
        mocked_aws.put_json(f"runs/r1/shards/{shard}/_SUCCESS", {"samples": samples, "failed": 102 - samples})
    job = names.download_job_name(run_hash, "r1", "00001", 0, 1)
    first = names.download_job_name(run_hash, "r1", "00001", 0, 0)
    console.sagemaker.processing_jobs = [
        {"ProcessingJobName": job, "ProcessingJobStatus": "Completed"},
        {"ProcessingJobName": first, "ProcessingJobStatus": "Failed", "FailureReason": "ClientError: no space left"},
    ]

    items = console.client().get(f"/api/runs/pokemon-sd15-7f3a9c2e41/maps/{MAP}/children").json()["items"]

    by_shard: dict[str, Any] = {item["shard_id"]: item for item in items}
    assert (by_shard["00000"]["samples"], by_shard["00000"]["images"]) == (0, 102)
    assert (by_shard["00001"]["samples"], by_shard["00001"]["images"]) == (101, 102)
    assert by_shard["00001"]["job_name"] == job
    assert by_shard["00001"]["earlier_attempts"] == [
        {"job_name": first, "status": "Failed", "failure_reason": "ClientError: no space left"}
    ]
    assert by_shard["00000"]["earlier_attempts"] == []


# ---------------------------------------------------------------------- 7. what was kept and why

CURATION = {
    "rows_read": 300, "filter_drops": {"min_width": 40}, "rows_to_download": 260, "failed_to_download": 20,
    "failed_to_resize": 0, "holdout": 0, "url_duplicates": 3, "image_duplicates": 1, "kept": 236,
    "deduplicated": True, "unhashed_shards": 0,
}  # fmt: skip


def test_run_dataset_panel_has_the_indexed_shards_and_curation_totals(console: Console) -> None:
    h = History()
    h.add("ExecutionStarted", 0, executionStartedEventDetails={"input": "{}"})
    dataset = {"index_uri": "s3://b/runs/curated/dataset/index.json", "total_samples": 236, "shards_ok": 3,
               "shards_empty": 1, "shards_failed": 0, "failed_shards": [], "holdout_samples": 0,
               "curation": CURATION}  # fmt: skip
    h.task("Build dataset index", output=json.dumps({"config": {"run_id": "curated"}, "dataset": dataset}))
    add_run(console, "curated", "RUNNING", h)

    answer = console.client().get("/api/runs/curated").json()

    assert answer["dataset"] == {
        "index_uri": dataset["index_uri"], "total_samples": 236, "shards_ok": 3, "shards_empty": 1,
        "shards_failed": 0, "holdout_samples": 0, "curation": CURATION,
    }  # fmt: skip
    assert answer["map_runs"] == {}


def test_run_dataset_panel_absent_before_the_index(console: Console) -> None:
    validation_failure(console)

    assert console.client().get("/api/runs/bad-run").json()["dataset"] is None


def test_children_counts_from_success_then_from_the_index_with_duplicates(
    console: Console, mocked_aws: AwsWorld
) -> None:
    add_run(console, status="SUCCEEDED")
    arn = map_run_arn("pokemon-sd15-7f3a9c2e41")
    for shard in ("00000", "00001"):
        output = f"s3://{DATA_BUCKET}/runs/r1/shards/{shard}/"
        console.sfn.add_child(arn, f"child-{shard}", "SUCCEEDED", {"shard": {"shard_id": shard, "output_uri": output}})
        mocked_aws.put_json(
            f"runs/r1/shards/{shard}/_SUCCESS",
            {"samples": 90, "failed": 10, "failed_to_download": 8, "failed_to_resize": 2, "rows_read": 150,
             "filter_drops": {"min_width": 50}, "rows_to_download": 100},
        )  # fmt: skip
    path = f"/api/runs/pokemon-sd15-7f3a9c2e41/maps/{MAP}/children"

    before = {item["shard_id"]: item["counts"] for item in console.client().get(path).json()["items"]}

    # Before Build dataset index: the _SUCCESS's counts, the duplicates not known yet (null, not 0).
    assert before["00000"] == {
        "rows_read": 150, "filter_drops": {"min_width": 50}, "rows_to_download": 100, "failed_to_download": 8,
        "failed_to_resize": 2, "holdout": 0, "url_duplicates": None, "image_duplicates": None, "kept": 90,
    }  # fmt: skip
    indexed = before["00001"] | {"url_duplicates": 4, "image_duplicates": 1, "kept": 85}
    mocked_aws.put_json(
        "runs/pokemon-sd15-7f3a9c2e41/dataset/index.json",
        {"shards": [{"shard_id": "00001", "tar_files": [], "samples": 85, "counts": indexed}]},
    )
    console.clock.advance(30)

    after = {item["shard_id"]: item["counts"] for item in console.client().get(path).json()["items"]}

    assert after["00001"] == indexed
    assert after["00000"]["url_duplicates"] is None  # not in the index: its _SUCCESS's counts


def test_run_training_job_failed_without_end_time_duration_ends_at_its_last_change(console: Console) -> None:
    h = pipeline_history("run-train")
    h.exit("Check trained model", "Choice")
    h.enter("Train model")
    h.add("TaskScheduled")
    h.add("TaskFailed", taskFailedEventDetails={"error": "TrainingJobFailed", "cause": "killed"})
    h.add("ExecutionFailed")
    add_run(console, "run-train", "FAILED", h)
    job = names.training_job_name(names.run_hash(execution_arn("run-train"), T0), "run-train", 0, 0)
    console.sagemaker.training_jobs[job] = {
        "TrainingJobName": job, "TrainingJobStatus": "Failed", "TrainingStartTime": T0,
        "LastModifiedTime": T0 + timedelta(seconds=90),  # a job that failed early reports no TrainingEndTime
    }  # fmt: skip

    training = console.client().get("/api/runs/run-train").json()["training"]

    assert training["duration_s"] == pytest.approx(90.0)
