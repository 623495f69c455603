"""SageMaker: jobs and endpoints handed to the local SageMaker, status events published."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdflow.local import runtime as runtime_module
from sdflow.local.sagemaker.service import SageMakerStatusPublisher
from tests.unit.local.helpers import PROCESSING_REQUEST, ROLE, TRAINING_REQUEST, client, events_queue, received


def test_moto_gap_processing_job_completed_at_once(aws: None) -> None:
    client("sagemaker").create_processing_job(**PROCESSING_REQUEST)
    described = client("sagemaker").describe_processing_job(ProcessingJobName="sdf-dl-run-00000-a0")
    assert described["ProcessingJobStatus"] == "Completed"


def test_describe_processing_job_after_create_returns_resources_and_environment(
    runtime: runtime_module.Runtime,
) -> None:
    sagemaker = client("sagemaker")
    sagemaker.create_processing_job(**PROCESSING_REQUEST, Environment={"STAGE": "notebook"})
    described = sagemaker.describe_processing_job(ProcessingJobName="sdf-dl-run-00000-a0")
    assert described["ProcessingResources"] == PROCESSING_REQUEST["ProcessingResources"]
    assert described["Environment"] == {"STAGE": "notebook"}


def test_patch_processing_job_runs_locally_and_publishes_state_change(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    queue_url = events_queue("SageMaker Processing Job State Change")
    sagemaker.create_processing_job(**PROCESSING_REQUEST)
    assert sagemaker.describe_processing_job(ProcessingJobName="sdf-dl-run-00000-a0")["ProcessingJobStatus"] == (
        "InProgress"
    )
    assert runtime.sagemaker.calls == [("processing", PROCESSING_REQUEST)]  # type: ignore[union-attr]
    with pytest.raises(ClientError, match="ResourceInUse"):
        sagemaker.create_processing_job(**PROCESSING_REQUEST)

    SageMakerStatusPublisher().job_status_changed(
        "processing", "sdf-dl-run-00000-a0", "Failed", {"FailureReason": "AlgorithmError: 3 of 3 URLs failed"}
    )
    described = sagemaker.describe_processing_job(ProcessingJobName="sdf-dl-run-00000-a0")
    assert described["ProcessingJobStatus"] == "Failed"
    assert described["FailureReason"] == "AlgorithmError: 3 of 3 URLs failed"
    [event] = received(queue_url)
    assert event["source"] == "aws.sagemaker"
    assert event["detail"]["ProcessingJobStatus"] == "Failed"
    assert event["detail"]["FailureReason"] == "AlgorithmError: 3 of 3 URLs failed"
    assert isinstance(event["detail"]["CreationTime"], int), "event times are epoch milliseconds"


def test_patch_training_job_reports_artifacts_and_metrics(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    queue_url = events_queue("SageMaker Training Job State Change")
    sagemaker.create_training_job(**TRAINING_REQUEST)
    started = sagemaker.describe_training_job(TrainingJobName="sdf-tr-run-a0")
    assert (started["TrainingJobStatus"], "ModelArtifacts" in started) == ("InProgress", False)
    assert started["AlgorithmSpecification"]["MetricDefinitions"][0]["Name"] == "train:loss"
    artifacts = {"S3ModelArtifacts": "s3://data/runs/run/training/sdf-tr-run-a0/output/model.tar.gz"}
    now = datetime.now(UTC)
    metrics = [{"MetricName": "train:loss", "Value": 0.25, "Timestamp": now}]
    fields = {"ModelArtifacts": artifacts, "FinalMetricDataList": metrics, "TrainingEndTime": now}
    SageMakerStatusPublisher().job_status_changed("training", "sdf-tr-run-a0", "Completed", fields)
    described = sagemaker.describe_training_job(TrainingJobName="sdf-tr-run-a0")
    assert described["TrainingJobStatus"] == "Completed"
    assert described["ModelArtifacts"] == artifacts
    assert described["FinalMetricDataList"][0]["Value"] == 0.25
    assert described["TrainingEndTime"].timestamp() == pytest.approx(now.timestamp(), abs=1)
    [event] = received(queue_url)
    assert event["detail"]["ModelArtifacts"] == artifacts
    assert event["detail"]["FinalMetricDataList"][0]["Timestamp"] == int(now.timestamp() * 1000)


def test_moto_gap_no_stop_training_job(aws: None) -> None:
    client("sagemaker").create_training_job(**TRAINING_REQUEST)
    with pytest.raises(Exception, match=r"stop_training_job|not.*implemented|NotImplemented"):
        client("sagemaker").stop_training_job(TrainingJobName="sdf-tr-run-a0")


def test_patch_stop_training_job_stops_local_job(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    sagemaker.create_training_job(**TRAINING_REQUEST)
    sagemaker.stop_training_job(TrainingJobName="sdf-tr-run-a0")
    assert sagemaker.describe_training_job(TrainingJobName="sdf-tr-run-a0")["TrainingJobStatus"] == "Stopping"
    assert ("stop", ("training", "sdf-tr-run-a0")) in runtime.sagemaker.calls  # type: ignore[union-attr]


def _model_and_config(sagemaker: Any, suffix: str) -> None:
    sagemaker.create_model(
        ModelName=f"m-{suffix}",
        ExecutionRoleArn=ROLE,
        PrimaryContainer={"Image": "image:tag", "ModelDataUrl": f"s3://data/{suffix}/model.tar.gz"},
    )
    sagemaker.create_endpoint_config(
        EndpointConfigName=f"c-{suffix}",
        ProductionVariants=[
            {
                "VariantName": "AllTraffic",
                "ModelName": f"m-{suffix}",
                "InitialInstanceCount": 1,
                "InstanceType": "ml.m5.xlarge",
            }
        ],
    )


def test_moto_gap_endpoint_in_service_at_once_and_no_update_endpoint(aws: None) -> None:
    sagemaker = client("sagemaker")
    _model_and_config(sagemaker, "a")
    sagemaker.create_endpoint(EndpointName="e", EndpointConfigName="c-a")
    assert sagemaker.describe_endpoint(EndpointName="e")["EndpointStatus"] == "InService"
    _model_and_config(sagemaker, "b")
    with pytest.raises(Exception, match=r"update_endpoint|not.*implemented|NotImplemented"):
        sagemaker.update_endpoint(EndpointName="e", EndpointConfigName="c-b")
    answer = client("sagemaker-runtime").invoke_endpoint(EndpointName="e", Body=b"prompt")
    assert answer["Body"].read() != b"PNG:prompt"


def test_patch_endpoint_create_update_and_invoke_go_to_local_sagemaker(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    queue_url = events_queue("SageMaker Endpoint State Change")
    publisher = SageMakerStatusPublisher()
    _model_and_config(sagemaker, "a")
    sagemaker.create_endpoint(EndpointName="e", EndpointConfigName="c-a")
    assert sagemaker.describe_endpoint(EndpointName="e")["EndpointStatus"] == "Creating"
    name, config, model = runtime.sagemaker.calls[-1][1]  # type: ignore[union-attr]
    assert (name, config["EndpointConfigName"], model["PrimaryContainer"]["ModelDataUrl"]) == (
        "e",
        "c-a",
        "s3://data/a/model.tar.gz",
    )
    publisher.job_status_changed("endpoint", "e", "InService", {"EndpointConfigName": "c-a"})

    _model_and_config(sagemaker, "b")
    sagemaker.update_endpoint(EndpointName="e", EndpointConfigName="c-b")
    updating = sagemaker.describe_endpoint(EndpointName="e")
    assert (updating["EndpointStatus"], updating["EndpointConfigName"]) == ("Updating", "c-a")
    with pytest.raises(ClientError, match="in-progress"):
        sagemaker.update_endpoint(EndpointName="e", EndpointConfigName="c-b")
    publisher.job_status_changed("endpoint", "e", "InService", {"EndpointConfigName": "c-b"})
    assert sagemaker.describe_endpoint(EndpointName="e")["EndpointConfigName"] == "c-b"
    statuses = [event["detail"]["EndpointStatus"] for event in received(queue_url)]
    assert statuses == ["IN_SERVICE", "IN_SERVICE"]

    answer = client("sagemaker-runtime").invoke_endpoint(
        EndpointName="e", Body=b"a red square", ContentType="text/plain", Accept="image/png"
    )
    assert answer["Body"].read() == b"PNG:a red square"
    assert answer["ContentType"] == "image/png"


# ------------------------------------------------------------------------------------ (f) SNS


def test_describe_model_without_vpc_config_omits_vpc_config_and_containers(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    sagemaker.create_model(
        ModelName="notebook-model",
        PrimaryContainer={"Image": "123456789012.dkr.ecr.us-east-1.amazonaws.com/repo:v1"},
        ExecutionRoleArn=ROLE,
    )
    described = sagemaker.describe_model(ModelName="notebook-model")
    assert "VpcConfig" not in described
    assert "Containers" not in described
    assert described["PrimaryContainer"]["Image"].endswith("repo:v1")


def test_describe_endpoint_config_without_data_capture_omits_it(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    sagemaker.create_model(ModelName="m", PrimaryContainer={"Image": "img"}, ExecutionRoleArn=ROLE)
    sagemaker.create_endpoint_config(
        EndpointConfigName="c",
        ProductionVariants=[
            {"VariantName": "AllTraffic", "ModelName": "m", "InstanceType": "ml.m5.large", "InitialInstanceCount": 1}
        ],
    )
    assert "DataCaptureConfig" not in sagemaker.describe_endpoint_config(EndpointConfigName="c")
