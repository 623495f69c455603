"""SageMaker managed warm pools on the local cloud: DescribeTrainingJob's WarmPoolStatus and
UpdateTrainingJob's retention, as AWS answers them (the run cleanup ends a failed run's warm pool)."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError

from sdflow.local import runtime as runtime_module
from sdflow.local.runtime import current_clock
from sdflow.local.sagemaker.quotas import SageMakerQuotas
from sdflow.local.sagemaker.service import SageMakerStatusPublisher
from tests.unit.local.helpers import TRAINING_REQUEST, client


@pytest.fixture(autouse=True)
def _room_for_three_jobs(request: pytest.FixtureRequest) -> None:
    """Three jobs at once: more than the small default instance quota allows."""
    if "runtime" in request.fixturenames:
        runtime = request.getfixturevalue("runtime")
        runtime.sagemaker_quotas = SageMakerQuotas(overrides={"training job": 10})


def _training(name: str, keep_alive: int | None) -> None:
    resources = dict(TRAINING_REQUEST["ResourceConfig"])
    if keep_alive is not None:
        resources["KeepAlivePeriodInSeconds"] = keep_alive
    client("sagemaker").create_training_job(
        **{**TRAINING_REQUEST, "TrainingJobName": name, "ResourceConfig": resources}
    )


def _end(name: str, status: str = "Completed") -> None:
    SageMakerStatusPublisher().job_status_changed("training", name, status, {"TrainingEndTime": current_clock().now()})


def test_describe_training_job_with_keep_alive_ended_shows_its_warm_pool_available(
    runtime: runtime_module.Runtime,
) -> None:
    """SageMaker developer guide, "Warm pool lifecycle": after the job the warm pool is Available
    for KeepAlivePeriodInSeconds; stopped after its cluster started, the job keeps one too."""
    _training("t-warm", 1800)
    _training("t-stopped", 600)
    _training("t-cold", None)
    assert "WarmPoolStatus" not in client("sagemaker").describe_training_job(TrainingJobName="t-warm")

    _end("t-warm")
    _end("t-stopped", "Stopped")
    _end("t-cold")

    sagemaker = client("sagemaker")
    described = sagemaker.describe_training_job(TrainingJobName="t-warm")
    assert described["WarmPoolStatus"]["Status"] == "Available"
    assert described["ResourceConfig"]["KeepAlivePeriodInSeconds"] == 1800
    assert sagemaker.describe_training_job(TrainingJobName="t-stopped")["WarmPoolStatus"]["Status"] == "Available"
    assert "WarmPoolStatus" not in sagemaker.describe_training_job(TrainingJobName="t-cold")


def test_update_training_job_keep_alive_zero_terminates_the_warm_pool(runtime: runtime_module.Runtime) -> None:
    _training("t-warm", 1800)
    _end("t-warm")
    sagemaker = client("sagemaker")

    answer = sagemaker.update_training_job(TrainingJobName="t-warm", ResourceConfig={"KeepAlivePeriodInSeconds": 0})

    assert answer["TrainingJobArn"].endswith(":training-job/t-warm")
    described = sagemaker.describe_training_job(TrainingJobName="t-warm")
    assert described["ResourceConfig"]["KeepAlivePeriodInSeconds"] == 0
    assert described["WarmPoolStatus"]["Status"] == "Terminated"


def test_warm_pool_past_its_keep_alive_is_terminated(runtime: runtime_module.Runtime) -> None:
    _training("t-warm", 60)
    _end("t-warm")
    current_clock().advance(61)

    described = client("sagemaker").describe_training_job(TrainingJobName="t-warm")

    assert described["WarmPoolStatus"]["Status"] == "Terminated"


def test_update_training_job_unknown_job_is_resource_not_found(runtime: runtime_module.Runtime) -> None:
    """API reference, UpdateTrainingJob: ResourceNotFound, "Resource being access is not found"."""
    with pytest.raises(ClientError) as caught:
        client("sagemaker").update_training_job(
            TrainingJobName="t-none", ResourceConfig={"KeepAlivePeriodInSeconds": 0}
        )
    assert caught.value.response["Error"]["Code"] == "ResourceNotFound"
    assert "t-none" in caught.value.response["Error"]["Message"]


def test_update_training_job_keep_alive_above_the_limit_is_refused(runtime: runtime_module.Runtime) -> None:
    """botocore's model: ResourceConfigForUpdate.KeepAlivePeriodInSeconds is 0 to 21600."""
    _training("t-warm", 1800)
    with pytest.raises(ClientError) as caught:
        client("sagemaker").update_training_job(
            TrainingJobName="t-warm", ResourceConfig={"KeepAlivePeriodInSeconds": 21601}
        )
    assert caught.value.response["Error"]["Code"] == "ValidationException"
    assert "resourceConfig.keepAlivePeriodInSeconds" in caught.value.response["Error"]["Message"]


def test_moto_gap_no_update_training_job_and_no_warm_pool_status(aws: None) -> None:
    """The pinned moto has neither: warm_pools.py adds both (an upgrade that brings them forces a review)."""
    resources = {**TRAINING_REQUEST["ResourceConfig"], "KeepAlivePeriodInSeconds": 600}
    client("sagemaker").create_training_job(**{**TRAINING_REQUEST, "ResourceConfig": resources})
    assert "WarmPoolStatus" not in client("sagemaker").describe_training_job(TrainingJobName="sdf-tr-run-a0")
    with pytest.raises(Exception, match=r"update_training_job|not.*implemented|NotImplemented"):
        client("sagemaker").update_training_job(
            TrainingJobName="sdf-tr-run-a0", ResourceConfig={"KeepAlivePeriodInSeconds": 0}
        )
