"""A redrive of Train model or Evaluate model adopts the job the ended run left running (issue 23
item 1): the redrive starts its failed state at attempt 0 under new names (`-r<n>-a0`), while the
cleanup skips a run redriven before it ran, so the earlier redrive's job may still run."""

from __future__ import annotations

from typing import Any

# The X-Ray SDK opens its UDP emitter's socket on first import (Tracer() triggers it); import it
# here, at collection, before the unit fixtures block sockets.
import aws_xray_sdk.core  # noqa: F401
import pytest

from sdflow_common import evaluation
from sdflow_common.evaluation import EvaluationTask
from sdflow_common.token_store import TokenStore
from tests.helpers import load_function_module
from tests.unit.helpers import (
    SAGEMAKER_ROLE_ARN,
    TRAINING_IMAGE_URI,
    AwsWorld,
    FakeLambdaContext,
    load_event,
)
from tests.unit.job_requests import (
    evaluation_name,
    processing_job_names,
    processing_status,
    redrive_of,
    sagemaker_client,
    training_name,
    training_status,
)


@pytest.fixture(autouse=True)
def running_execution(events_execution: str) -> str:
    return events_execution


def start_without_adopting(event: dict[str, Any], name: str, store: TokenStore) -> None:
    task = EvaluationTask.model_validate(event)
    store.claim(name, task.token, task.execution_arn, "evaluation", timeout_seconds=task.timeout_seconds)
    request = evaluation.evaluation_job_request(
        job_name=name,
        config=task.config,
        run_hash=task.run_hash,
        model_data_url=task.training.model_data_url,
        prompts_uri=None,
        image_uri=TRAINING_IMAGE_URI,
        role_arn=SAGEMAKER_ROLE_ARN,
    )
    sagemaker_client().create_processing_job(**request)


def test_start_evaluation_redrive_with_earlier_job_running_adopts_it_without_a_second_job(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    handler = load_function_module("start_evaluation").lambda_handler
    first = load_event("start_evaluation_task.json")
    handler(first, context)
    # The run was stopped during Evaluate model and redriven before its cleanup ran.
    processing_status(evaluation_name(first), "InProgress")
    redrive = redrive_of(first, 1)

    result = handler(redrive, context)

    assert result == {"resource_name": evaluation_name(first), "created": False, "adopted": True}
    assert processing_job_names(mocked_aws, "sdf-ev-") == [evaluation_name(first)], "exactly one evaluation job"
    record = store.get(evaluation_name(first))
    assert record is not None
    assert record.task_token == redrive["token"], "the job's event must answer the redrive's task"
    assert store.get(evaluation_name(first, redrive=1)) is None


def test_start_evaluation_redrive_with_earlier_job_completed_starts_a_new_job(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    handler = load_function_module("start_evaluation").lambda_handler
    first = load_event("start_evaluation_task.json")
    handler(first, context)
    processing_status(evaluation_name(first), "Completed")  # its event found the dead token

    result = handler(redrive_of(first, 1), context)

    assert result == {"resource_name": evaluation_name(first, redrive=1), "created": True}
    assert processing_status(evaluation_name(first)) == "Completed"


def test_start_evaluation_second_redrive_adopts_the_newest_running_job_and_stops_the_other(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    handler = load_function_module("start_evaluation").lambda_handler
    first = load_event("start_evaluation_task.json")
    handler(first, context)
    processing_status(evaluation_name(first), "InProgress")
    # Redrive 1's attempt 2 started a job of its own beside redrive 0's (a starter before adoption
    # across redrives): created and claimed as a starter does.
    stray = redrive_of(first, 1, attempt=2)
    start_without_adopting(stray, evaluation_name(first, redrive=1, attempt=2), store)
    processing_status(evaluation_name(first, redrive=1, attempt=2), "InProgress")

    result = handler(redrive_of(first, 2), context)

    assert result["resource_name"] == evaluation_name(first, redrive=1, attempt=2)
    assert processing_status(evaluation_name(first)) == "Stopped"
    assert len(processing_job_names(mocked_aws, "sdf-ev-")) == 2, "no third job"


def test_start_evaluation_retry_within_a_redrive_finds_the_adopted_earlier_redrive_job(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    """Attempt 0 of redrive 1 adopted redrive 0's job (which keeps its name) and its Lambda died:
    attempt 1 must find that job, whose name is not one of its own redrive's."""
    handler = load_function_module("start_evaluation").lambda_handler
    first = load_event("start_evaluation_task.json")
    handler(first, context)
    processing_status(evaluation_name(first), "InProgress")
    handler(redrive_of(first, 1), context)

    result = handler(redrive_of(first, 1, attempt=1), context)

    assert result == {"resource_name": evaluation_name(first), "created": False, "adopted": True}
    assert processing_job_names(mocked_aws, "sdf-ev-") == [evaluation_name(first)]


def test_start_evaluation_redrive_does_not_list_jobs(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    """Issue 23 item 8: the earlier redrive's job is found from the run's claims and one Describe."""
    handler = load_function_module("start_evaluation").lambda_handler
    first = load_event("start_evaluation_task.json")
    handler(first, context)
    processing_status(evaluation_name(first), "InProgress")
    calls: list[str] = []
    sagemaker_client().meta.events.register("before-call.sagemaker.*", lambda model, **_kw: calls.append(model.name))

    handler(redrive_of(first, 1), context)

    assert calls == ["DescribeProcessingJob"]


def test_start_training_redrive_with_earlier_job_running_adopts_it(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    handler = load_function_module("start_training").lambda_handler
    first = load_event("start_training_task.json")
    handler(first, context)
    training_status(training_name(first), "InProgress")
    redrive = redrive_of(first, 1)

    assert handler(redrive, context) == {"resource_name": training_name(first), "created": False, "adopted": True}
    jobs = mocked_aws.sagemaker.list_training_jobs()["TrainingJobSummaries"]
    assert [job["TrainingJobName"] for job in jobs] == [training_name(first)], "one job, its checkpoints kept"
    assert store.get(training_name(first)).task_token == redrive["token"]  # type: ignore[union-attr]


def test_start_download_redrive_does_not_read_the_run_claims(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard's child counts its redrives with the Map child's count, and one scan of the token
    table per shard would read it a thousand times: downloads look only within their redrive."""
    scans: list[str] = []
    monkeypatch.setattr(TokenStore, "for_execution", lambda self, arn, **_kw: scans.append(arn) or iter(()))
    event = {**load_event("start_download_task.json"), "redrive_count": 1}
    result = load_function_module("start_download").lambda_handler(event, context)
    assert result["created"] is True
    assert scans == []


def test_start_evaluation_redrive_claim_released_by_the_cleanup_before_adoption_starts_its_own_job(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32 item 3, the other side of the cleanup-versus-redrive race: the ended run's cleanup
    deletes the job's claim (on the condition of its token) and then stops the job. A redrive that
    read the claim before that delete must not adopt the job after it: it takes the claim over
    only as it was held, and a claim gone means a job being stopped, so it starts its own."""
    from sdflow_common import job_control

    handler = load_function_module("start_evaluation").lambda_handler
    first = load_event("start_evaluation_task.json")
    handler(first, context)
    processing_status(evaluation_name(first), "InProgress")
    found_by_the_redrive = job_control.earlier_redrives

    def cleanup_releases_after_the_read(*args: Any) -> list[str]:
        found = found_by_the_redrive(*args)
        assert store.delete(evaluation_name(first), token=first["token"]), "the cleanup's conditional delete"
        return found

    monkeypatch.setattr(job_control, "earlier_redrives", cleanup_releases_after_the_read)

    result = load_function_module("start_evaluation").lambda_handler(redrive_of(first, 1), context)

    assert result == {"resource_name": evaluation_name(first, redrive=1), "created": True}
    assert store.get(evaluation_name(first)) is None, "the job the cleanup stops is nobody's"
