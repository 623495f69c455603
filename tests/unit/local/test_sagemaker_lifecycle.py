"""SageMaker's run lifecycle APIs on the local cloud: listing jobs by name and live status, stopping
them, their tags, and the capacity failure of a training job (all through boto3 and moto)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdflow.local import runtime as runtime_module
from sdflow.local.faults import Faults
from sdflow.local.sagemaker.capacity import CAPACITY_FAILURE_REASON
from sdflow.local.sagemaker.quotas import SageMakerQuotas
from sdflow.local.sagemaker.service import SageMakerStatusPublisher
from tests.unit.local.helpers import PROCESSING_REQUEST, TRAINING_REQUEST, client, events_queue, received, wait_for


@pytest.fixture(autouse=True)
def _room_for_many_jobs(request: pytest.FixtureRequest) -> None:
    """Listing tests create more jobs than the small default instance quotas allow."""
    if "runtime" in request.fixturenames:
        runtime = request.getfixturevalue("runtime")
        runtime.sagemaker_quotas = SageMakerQuotas(overrides={"processing job": 50, "training job": 50})


def _processing(name: str, tags: list[dict[str, str]] | None = None) -> None:
    client("sagemaker").create_processing_job(**{**PROCESSING_REQUEST, "ProcessingJobName": name, "Tags": tags or []})


def _training(name: str, tags: list[dict[str, str]] | None = None) -> None:
    client("sagemaker").create_training_job(**{**TRAINING_REQUEST, "TrainingJobName": name, "Tags": tags or []})


def _all_pages(operation: str, key: str, **kwargs: Any) -> tuple[list[dict[str, Any]], int]:
    sagemaker, pages, items, token = client("sagemaker"), 0, [], None
    while True:
        answer = getattr(sagemaker, operation)(**kwargs, **({"NextToken": token} if token else {}))
        pages += 1
        items += answer[key]
        token = answer.get("NextToken")
        if not token:
            return items, pages


def test_list_processing_jobs_name_and_status_filter_reflect_live_status(runtime: runtime_module.Runtime) -> None:
    publisher = SageMakerStatusPublisher()
    for i in range(5):
        _processing(f"sdf-dl-run-abc123-{i:05d}-a0")
    _processing("sdf-dl-other-fff999-00000-a0")
    publisher.job_status_changed("processing", "sdf-dl-run-abc123-00001-a0", "Completed", {})
    publisher.job_status_changed("processing", "sdf-dl-run-abc123-00002-a0", "Failed", {"FailureReason": "boom"})

    running, pages = _all_pages(
        "list_processing_jobs", "ProcessingJobSummaries", NameContains="abc123", StatusEquals="InProgress", MaxResults=2
    )
    assert sorted(j["ProcessingJobName"] for j in running) == [
        "sdf-dl-run-abc123-00000-a0",
        "sdf-dl-run-abc123-00003-a0",
        "sdf-dl-run-abc123-00004-a0",
    ]
    assert pages == 2, "the status filter selects before the page is cut (no rule documented otherwise)"
    [failed] = client("sagemaker").list_processing_jobs(NameContains="abc123", StatusEquals="Failed")[
        "ProcessingJobSummaries"
    ]
    assert failed["FailureReason"] == "boom"


def test_list_training_jobs_status_filter_applies_after_page_as_documented(runtime: runtime_module.Runtime) -> None:
    publisher = SageMakerStatusPublisher()
    for i in range(4):
        _training(f"sdf-tr-run-abc123-r0-a{i}")
    for i in range(3):
        publisher.job_status_changed("training", f"sdf-tr-run-abc123-r0-a{i}", "Failed", {"FailureReason": "x"})
    first = client("sagemaker").list_training_jobs(NameContains="abc123", StatusEquals="InProgress", MaxResults=2)
    assert first["TrainingJobSummaries"] == []
    assert "NextToken" in first, "an empty page still points to the rest"
    running, _ = _all_pages(
        "list_training_jobs", "TrainingJobSummaries", NameContains="abc123", StatusEquals="InProgress", MaxResults=2
    )
    assert [(j["TrainingJobName"], j["SecondaryStatus"]) for j in running] == [("sdf-tr-run-abc123-r0-a3", "Starting")]


def test_list_jobs_default_page_is_ten_sorted_ascending_and_descending_on_request(
    runtime: runtime_module.Runtime,
) -> None:
    for i in range(12):
        _processing(f"job-{i:02d}")
    sagemaker = client("sagemaker")
    first = sagemaker.list_processing_jobs()
    assert [j["ProcessingJobName"] for j in first["ProcessingJobSummaries"]] == [f"job-{i:02d}" for i in range(10)]
    rest = sagemaker.list_processing_jobs(NextToken=first["NextToken"])
    assert [j["ProcessingJobName"] for j in rest["ProcessingJobSummaries"]] == ["job-10", "job-11"]
    assert "NextToken" not in rest
    by_name = sagemaker.list_processing_jobs(SortBy="Name", SortOrder="Descending", MaxResults=1)
    assert by_name["ProcessingJobSummaries"][0]["ProcessingJobName"] == "job-11"


def test_list_jobs_bad_token_or_status_answers_validation_exception(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    with pytest.raises(ClientError, match=r"ValidationException.*pagination token"):
        sagemaker.list_training_jobs(NextToken="not-a-token")
    with pytest.raises(ClientError, match="statusEquals"):
        sagemaker.list_processing_jobs(StatusEquals="Running")


def test_stop_processing_job_goes_stopping_with_event_then_stopped(runtime: runtime_module.Runtime) -> None:
    queue_url = events_queue("SageMaker Processing Job State Change")
    sagemaker = client("sagemaker")
    _processing("p1")
    sagemaker.stop_processing_job(ProcessingJobName="p1")
    assert ("stop", ("processing", "p1")) in runtime.sagemaker.calls  # type: ignore[union-attr]
    # The job's own start report, if late, does not undo the stop.
    SageMakerStatusPublisher().job_status_changed("processing", "p1", "InProgress", {})
    listed = sagemaker.list_processing_jobs(StatusEquals="Stopping")["ProcessingJobSummaries"]
    assert [j["ProcessingJobName"] for j in listed] == ["p1"]
    SageMakerStatusPublisher().job_status_changed("processing", "p1", "Stopped", {})
    events = [e["detail"] for e in received(queue_url)]
    assert [(d["ProcessingJobName"], d["ProcessingJobStatus"]) for d in events] == [
        ("p1", "Stopping"),
        ("p1", "Stopping"),
        ("p1", "Stopped"),
    ]


def test_stop_training_job_terminal_or_unknown_answers_as_aws(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    _training("t1")
    SageMakerStatusPublisher().job_status_changed("training", "t1", "Completed", {})
    with pytest.raises(ClientError) as caught:
        sagemaker.stop_training_job(TrainingJobName="t1")
    error = caught.value.response["Error"]
    assert (error["Code"], error["Message"]) == (
        "ValidationException",
        "The request was rejected because the training job is in status Completed.",
    )
    with pytest.raises(ClientError, match="ResourceNotFound"):
        sagemaker.stop_processing_job(ProcessingJobName="nope")


def test_stop_training_job_event_carries_fields_job_events_reads(runtime: runtime_module.Runtime) -> None:
    queue_url = events_queue("SageMaker Training Job State Change")
    _training("t2")
    client("sagemaker").stop_training_job(TrainingJobName="t2")
    SageMakerStatusPublisher().job_status_changed(
        "training", "t2", "Stopped", {"SecondaryStatus": "Stopped", "FailureReason": "stopped by the run"}
    )
    events = [e["detail"] for e in received(queue_url)]
    assert [(d["TrainingJobStatus"], d["SecondaryStatus"]) for d in events] == [
        ("Stopping", "Stopping"),
        ("Stopped", "Stopped"),
    ]
    assert events[-1]["TrainingJobName"] == "t2"
    assert events[-1]["FailureReason"] == "stopped by the run"
    assert events[-1]["TrainingJobArn"].endswith(":training-job/t2")


def test_list_tags_of_jobs_and_endpoint_returns_create_tags(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    tags = [{"Key": "sdflow:run", "Value": "abc123"}, {"Key": "sdflow:execution", "Value": "run-1"}]
    _processing("p-tagged", tags)
    _training("t-tagged", tags)
    sagemaker.create_model(
        ModelName="m", ExecutionRoleArn=TRAINING_REQUEST["RoleArn"], PrimaryContainer={"Image": "i:t"}
    )
    sagemaker.create_endpoint_config(
        EndpointConfigName="c",
        ProductionVariants=[
            {"VariantName": "v", "ModelName": "m", "InitialInstanceCount": 1, "InstanceType": "ml.m5.xlarge"}
        ],
    )
    sagemaker.create_endpoint(EndpointName="e", EndpointConfigName="c", Tags=tags)
    arns = [
        sagemaker.describe_processing_job(ProcessingJobName="p-tagged")["ProcessingJobArn"],
        sagemaker.describe_training_job(TrainingJobName="t-tagged")["TrainingJobArn"],
        sagemaker.describe_endpoint(EndpointName="e")["EndpointArn"],
    ]
    for arn in arns:
        assert sagemaker.list_tags(ResourceArn=arn)["Tags"] == tags, arn


def test_capacity_fault_fails_next_training_job_without_running_it(runtime: runtime_module.Runtime) -> None:
    queue_url = events_queue("SageMaker Training Job State Change")
    faults = Faults(SimpleNamespace(runtime=runtime, deployment=None, status_publisher=SageMakerStatusPublisher()))  # type: ignore[arg-type]
    faults.fail_next_training_jobs(1)
    sagemaker = client("sagemaker")
    _training("t-capacity")
    assert sagemaker.describe_training_job(TrainingJobName="t-capacity")["TrainingJobStatus"] == "InProgress"
    described = wait_for(
        lambda: (
            (d := sagemaker.describe_training_job(TrainingJobName="t-capacity"))["TrainingJobStatus"] == "Failed" and d
        ),
        what="the capacity failure",
    )
    assert described["FailureReason"] == CAPACITY_FAILURE_REASON
    [event] = received(queue_url)
    assert (event["detail"]["TrainingJobStatus"], event["detail"]["FailureReason"]) == (
        "Failed",
        CAPACITY_FAILURE_REASON,
    )
    assert ("training", "t-capacity") not in [(k, r.get("TrainingJobName")) for k, r in runtime.sagemaker.calls]  # type: ignore[union-attr]

    _training("t-after")  # only the next one failed
    time.sleep(0.8)
    assert sagemaker.describe_training_job(TrainingJobName="t-after")["TrainingJobStatus"] == "InProgress"
    assert faults.pending_capacity_failures() == 0
