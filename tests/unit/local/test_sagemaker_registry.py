"""SageMaker Model Registry: groups, versions, approval and its event, and serving an approved version."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdflow.local import runtime as runtime_module
from sdflow.local.sagemaker import endpoints as sagemaker_endpoints
from sdflow.local.sagemaker.engine import DeploymentFailed, JobSetupError, LocalSageMaker
from sdflow.local.sagemaker.registry import ModelPackageUnusable, serving_container
from sdflow.local.sagemaker.service import SageMakerStatusPublisher
from tests.constants import ACCOUNT, REGION
from tests.unit.local.helpers import client, events_queue, fake_training_image, received

GROUP = "sdflow-models"
ARTIFACT = "s3://data/runs/run/training/sdf-tr-run-a0/output/model.tar.gz"
INFERENCE = {
    "Containers": [{"Image": "image:tag", "ModelDataUrl": ARTIFACT, "Environment": {"SDFLOW_STEPS": "20"}}],
    "SupportedContentTypes": ["application/json"],
    "SupportedResponseMIMETypes": ["image/png"],
}
DETAIL_TYPE = "SageMaker Model Package State Change"


def _register(sagemaker: Any, **extra: Any) -> str:
    request = {"ModelPackageGroupName": GROUP, "InferenceSpecification": INFERENCE, **extra}
    return str(sagemaker.create_model_package(**request)["ModelPackageArn"])


def _error(call: Any, **kwargs: Any) -> dict[str, str]:
    with pytest.raises(ClientError) as raised:
        call(**kwargs)
    return dict(raised.value.response["Error"])


# ------------------------------------------------------------------------------------ moto alone


def test_moto_gap_duplicate_group_replaced_and_update_wipes_metadata(aws: None) -> None:
    sagemaker = client("sagemaker")
    sagemaker.create_model_package_group(ModelPackageGroupName=GROUP, ModelPackageGroupDescription="first")
    sagemaker.create_model_package_group(ModelPackageGroupName=GROUP, ModelPackageGroupDescription="second")
    described = sagemaker.describe_model_package_group(ModelPackageGroupName=GROUP)
    assert described["ModelPackageGroupDescription"] == "second"
    arn = _register(sagemaker, CustomerMetadataProperties={"run": "r1"}, ModelApprovalStatus="PendingManualApproval")
    sagemaker.update_model_package(ModelPackageArn=arn, ApprovalDescription="looks good")
    package = sagemaker.describe_model_package(ModelPackageName=arn)
    assert "CustomerMetadataProperties" not in package
    assert "ModelApprovalStatus" not in package


def test_moto_gap_client_token_retry_makes_second_version(aws: None) -> None:
    sagemaker = client("sagemaker")
    sagemaker.create_model_package_group(ModelPackageGroupName=GROUP)
    first = _register(sagemaker, ClientToken="run-1")
    assert _register(sagemaker, ClientToken="run-1") != first


# ------------------------------------------------------------------------------------ groups


def test_create_group_bad_names_answer_validation_exception(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    for name in ("-leading-hyphen", "trailing-", "under_score", "a" * 64):
        error = _error(sagemaker.create_model_package_group, ModelPackageGroupName=name)
        assert error["Code"] == "ValidationException", name
        assert "modelPackageGroupName" in error["Message"], name
    sagemaker.create_model_package_group(ModelPackageGroupName="a" * 63)
    sagemaker.create_model_package_group(ModelPackageGroupName="a--b-9")


def test_create_group_twice_refused_and_first_kept(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    arn = sagemaker.create_model_package_group(ModelPackageGroupName=GROUP, ModelPackageGroupDescription="first")[
        "ModelPackageGroupArn"
    ]
    for name in (GROUP, GROUP.upper()):
        error = _error(sagemaker.create_model_package_group, ModelPackageGroupName=name)
        assert error == {"Code": "ValidationException", "Message": f"Model Package Group already exists: {arn}"}
    described = sagemaker.describe_model_package_group(ModelPackageGroupName=GROUP)
    assert described["ModelPackageGroupDescription"] == "first"


# ------------------------------------------------------------------------------------ versions


def test_create_package_versions_count_per_group_and_start_pending(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    sagemaker.create_model_package_group(ModelPackageGroupName=GROUP)
    sagemaker.create_model_package_group(ModelPackageGroupName="other")
    first, second = _register(sagemaker), _register(sagemaker)
    other = _register(sagemaker, ModelPackageGroupName="other")
    assert (first.rsplit("/", 1)[1], second.rsplit("/", 1)[1], other.rsplit("/", 1)[1]) == ("1", "2", "1")
    package = sagemaker.describe_model_package(ModelPackageName=second)
    assert (package["ModelPackageVersion"], package["ModelApprovalStatus"]) == (2, "PendingManualApproval")


def test_create_package_same_client_token_returns_first_version(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    group_arn = sagemaker.create_model_package_group(ModelPackageGroupName=GROUP)["ModelPackageGroupArn"]
    first = _register(sagemaker, ClientToken="run-1-train-a0")
    assert _register(sagemaker, ClientToken="run-1-train-a0", ModelPackageGroupName=group_arn) == first
    assert _register(sagemaker, ClientToken="run-1-train-a1").endswith("/2")
    listed = sagemaker.list_model_packages(ModelPackageGroupName=GROUP)["ModelPackageSummaryList"]
    assert len(listed) == 2


def test_create_package_bad_status_token_or_group_refused(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    error = _error(sagemaker.create_model_package, ModelPackageGroupName=GROUP, InferenceSpecification=INFERENCE)
    group_arn = f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:model-package-group/{GROUP}"
    assert error == {"Code": "ValidationException", "Message": f"ModelPackageGroup {group_arn} does not exist."}
    sagemaker.create_model_package_group(ModelPackageGroupName=GROUP)
    error = _error(sagemaker.create_model_package, ModelPackageGroupName=GROUP, ModelApprovalStatus="Approve")
    assert "enum value set: [Approved, Rejected, PendingManualApproval]" in error["Message"]
    error = _error(sagemaker.create_model_package, ModelPackageGroupName=GROUP, ClientToken="not_a_token")
    assert "clientToken" in error["Message"]
    assert sagemaker.list_model_packages(ModelPackageGroupName=GROUP)["ModelPackageSummaryList"] == []


def test_list_packages_by_group_and_approval_status(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    sagemaker.create_model_package_group(ModelPackageGroupName=GROUP)
    sagemaker.create_model_package_group(ModelPackageGroupName="other")
    pending = _register(sagemaker)
    approved = _register(sagemaker, ModelApprovalStatus="Approved")
    _register(sagemaker, ModelPackageGroupName="other", ModelApprovalStatus="Approved")

    def listed(**filters: Any) -> list[str]:
        summaries = sagemaker.list_model_packages(ModelPackageGroupName=GROUP, **filters)["ModelPackageSummaryList"]
        return [s["ModelPackageArn"] for s in summaries]

    assert listed() == [pending, approved]
    assert listed(ModelApprovalStatus="Approved") == [approved]
    assert listed(ModelApprovalStatus="PendingManualApproval") == [pending]


# ------------------------------------------------------------------------------------ approval


def test_update_package_keeps_metadata_unless_named(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    sagemaker.create_model_package_group(ModelPackageGroupName=GROUP)
    arn = _register(sagemaker, CustomerMetadataProperties={"run": "r1", "score": "0.8"})
    sagemaker.update_model_package(ModelPackageArn=arn, ModelApprovalStatus="Approved", ApprovalDescription="ok")
    package = sagemaker.describe_model_package(ModelPackageName=arn)
    assert package["CustomerMetadataProperties"] == {"run": "r1", "score": "0.8"}
    assert (package["ModelApprovalStatus"], package["ApprovalDescription"]) == ("Approved", "ok")
    sagemaker.update_model_package(
        ModelPackageArn=arn, CustomerMetadataProperties={"note": "x"}, CustomerMetadataPropertiesToRemove=["score"]
    )
    package = sagemaker.describe_model_package(ModelPackageName=arn)
    assert package["CustomerMetadataProperties"] == {"run": "r1", "note": "x"}
    assert (package["ModelApprovalStatus"], package["ApprovalDescription"]) == ("Approved", "ok")
    error = _error(sagemaker.update_model_package, ModelPackageArn=arn, ModelApprovalStatus="approved")
    assert error["Code"] == "ValidationException"
    assert sagemaker.describe_model_package(ModelPackageName=arn)["ModelApprovalStatus"] == "Approved"


def test_state_change_event_on_create_and_approval_reaches_rule_target(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    queue_url = events_queue(DETAIL_TYPE)
    sagemaker.create_model_package_group(ModelPackageGroupName=GROUP)
    arn = _register(sagemaker, ClientToken="t-1", MetadataProperties={"GeneratedBy": "run-1"})
    _register(sagemaker, ClientToken="t-1")  # a retry: nothing changed, no event
    [created] = received(queue_url)
    assert (created["source"], created["detail-type"], created["resources"]) == ("aws.sagemaker", DETAIL_TYPE, [arn])
    detail = created["detail"]
    assert (detail["ModelPackageGroupName"], detail["ModelPackageVersion"], detail["ModelPackageArn"]) == (
        GROUP,
        1,
        arn,
    )
    assert (detail["ModelApprovalStatus"], detail["ModelPackageStatus"]) == ("PendingManualApproval", "Completed")
    assert detail["InferenceSpecification"]["Containers"][0]["ModelDataUrl"] == ARTIFACT
    assert detail["MetadataProperties"] == {"GeneratedBy": "run-1"}
    assert "CreatedBy" not in detail
    for key in ("CreationTime", "LastModifiedTime"):  # "2021-02-24T17:00:14Z" in AWS's example
        assert dt.datetime.strptime(detail[key], "%Y-%m-%dT%H:%M:%SZ"), detail[key]

    sagemaker.update_model_package(ModelPackageArn=arn, ModelApprovalStatus="Approved")
    sagemaker.update_model_package(ModelPackageArn=arn, ModelApprovalStatus="Approved")  # no change, no event
    [approved] = received(queue_url)
    assert approved["detail"]["ModelApprovalStatus"] == "Approved"
    assert approved["resources"] == [arn]


def test_state_change_event_kept_for_redelivery(runtime: runtime_module.Runtime) -> None:
    publisher = SageMakerStatusPublisher()
    runtime.sagemaker.listener = publisher  # type: ignore[union-attr]
    sagemaker = client("sagemaker")
    sagemaker.create_model_package_group(ModelPackageGroupName=GROUP)
    arn = _register(sagemaker)
    [event] = publisher.published
    assert (event["DetailType"], event["Resources"], bool(event["EventId"])) == (DETAIL_TYPE, [arn], True)
    assert json.loads(event["Detail"])["ModelPackageArn"] == arn


# ------------------------------------------------------------------------------------ serving


def _model(package: str, **container: Any) -> dict[str, Any]:
    return {"ModelName": "m", "PrimaryContainer": {"ModelPackageName": package, **container}}


def test_serving_container_resolves_approved_version_by_arn_or_name(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    sagemaker.create_model_package_group(ModelPackageGroupName=GROUP)
    arn = _register(sagemaker, ModelApprovalStatus="Approved")
    resolved = serving_container({"ModelPackageName": arn, "Environment": {"EXTRA": "1"}}, "e", REGION)
    assert (resolved["Image"], resolved["ModelDataUrl"]) == ("image:tag", ARTIFACT)
    assert resolved["Environment"] == {"SDFLOW_STEPS": "20", "EXTRA": "1"}
    assert serving_container({"ModelPackageName": f"{GROUP}/1"}, "e", REGION)["ModelDataUrl"] == ARTIFACT


def test_serving_container_refuses_missing_or_unapproved_version(runtime: runtime_module.Runtime) -> None:
    sagemaker = client("sagemaker")
    sagemaker.create_model_package_group(ModelPackageGroupName=GROUP)
    arn = _register(sagemaker)
    with pytest.raises(ModelPackageUnusable, match=r"is PendingManualApproval.*--model-approval-status Approved"):
        serving_container({"ModelPackageName": arn}, "e", REGION)
    sagemaker.update_model_package(ModelPackageArn=arn, ModelApprovalStatus="Rejected")
    with pytest.raises(ModelPackageUnusable, match="is Rejected"):
        serving_container({"ModelPackageName": arn}, "e", REGION)
    with pytest.raises(ModelPackageUnusable, match=r"/7 does not exist.*CreateModelPackage"):
        serving_container({"ModelPackageName": arn.replace("/1", "/7")}, "e", REGION)


class _DownloadRecorder:
    """Stands in for the model's S3 access: records the artifact asked for, then fails the download."""

    def __init__(self) -> None:
        self.urls: list[str] = []

    def download_file(self, url: str, dest: Path, field: str) -> None:
        self.urls.append(url)
        raise JobSetupError(f"{field} {url}: recorded, not downloaded")


def test_start_serving_model_package_downloads_the_package_artifact(
    runtime: runtime_module.Runtime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sagemaker_endpoints, "free_port", lambda: 65000)  # no socket in unit tests
    sagemaker = client("sagemaker")
    sagemaker.create_model_package_group(ModelPackageGroupName=GROUP)
    arn = _register(sagemaker)
    image = fake_training_image(tmp_path, {"serve": "print('never started')\n"})
    sm = LocalSageMaker(tmp_path / "sm", "http://127.0.0.1:9", SageMakerStatusPublisher(), training_image_dir=image)
    recorder = _DownloadRecorder()
    monkeypatch.setattr(sm, "_s3_for", lambda role: recorder)
    try:
        with pytest.raises(DeploymentFailed, match=rf"model m: model package {arn} is PendingManualApproval"):
            sm._start_serving("e", "c", _model(arn))
        assert recorder.urls == []
        sagemaker.update_model_package(ModelPackageArn=arn, ModelApprovalStatus="Approved")
        with pytest.raises(DeploymentFailed, match="recorded, not downloaded"):
            sm._start_serving("e", "c", _model(arn))
        assert recorder.urls == [ARTIFACT]
    finally:
        sm.shutdown()
