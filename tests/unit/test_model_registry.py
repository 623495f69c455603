"""Evaluate model, Register model and Wait for approval: the evaluation job's request, the quality
gate, the model package's metrics and lineage, and approvals answered by SageMaker's events."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

# The X-Ray SDK opens its UDP emitter's socket on first import (Tracer() triggers it).
import aws_xray_sdk.core  # noqa: F401
import pytest

from sdflow_common import curation, names
from sdflow_common.errors import EvaluationJobFailed, QualityGateFailed
from sdflow_common.evaluation import EVALUATION_FILE, EvaluationTask, evaluation_job_request
from sdflow_common.job_events import TaskResolver, resolve_event
from sdflow_common.job_starters import start_outcome
from sdflow_common.model_registry import (
    ApprovalTask,
    RegisterTask,
    await_approval,
    model_package_request,
    register_model,
)
from sdflow_common.settings import Settings
from sdflow_common.token_store import TokenStore
from tests.helpers import load_function_module
from tests.unit.helpers import TRAINING_IMAGE_URI, AwsWorld, FakeLambdaContext, load_event
from tests.unit.job_requests import assert_valid_request

SCORES = {"prompt_adherence": 0.86, "base_prompt_adherence": 0.11, "prompts": 48, "shape_accuracy": 0.7}


@pytest.fixture(autouse=True)
def running_execution(events_execution: str) -> str:
    return events_execution


def _with_run(event: dict[str, Any], **sections: dict[str, Any]) -> dict[str, Any]:
    event = copy.deepcopy(event)
    event["config"]["run"].update(sections)
    return event


def _put_scores(world: AwsWorld, event: dict[str, Any], scores: dict[str, Any]) -> None:
    uri = event["evaluation"]["evaluation_uri"]
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    world.put_json(prefix + EVALUATION_FILE, scores, bucket=bucket)


def _settings() -> Settings:
    return Settings.from_env()


# ---------------------------------------------------------------------------- Evaluate model


def test_evaluation_job_request_default_prompts_has_no_prompts_input_and_isolated_network() -> None:
    task = EvaluationTask.model_validate(load_event("start_evaluation_task.json"))
    request = evaluation_job_request(
        job_name="sdf-ev-x-r0-a0",
        config=task.config,
        run_hash="abc",
        model_data_url=task.training.model_data_url,
        prompts_uri=None,
        image_uri=TRAINING_IMAGE_URI,
        role_arn="arn:aws:iam::123456789012:role/job",
    )
    inputs = {item["InputName"]: item["S3Input"] for item in request["ProcessingInputs"]}
    assert set(inputs) == {"model", "base_model"}
    assert inputs["model"]["S3Uri"] == task.training.model_data_url
    assert inputs["base_model"]["S3Uri"] == task.config.run.base_model_uri
    assert request["AppSpecification"]["ContainerEntrypoint"] == ["evaluate"]
    assert "--prompts_file" not in request["AppSpecification"]["ContainerArguments"]
    assert all(len(arg) <= 256 for arg in request["AppSpecification"]["ContainerArguments"])
    assert request["NetworkConfig"]["EnableNetworkIsolation"] is True
    assert_valid_request("CreateProcessingJob", request)
    output = request["ProcessingOutputConfig"]["Outputs"][0]["S3Output"]
    assert output["S3Uri"].endswith("/evaluation/sdf-ev-x-r0-a0/")


def test_start_evaluation_prompt_list_is_written_to_s3_and_passed_as_a_file(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    prompts = ["a red circle on a blue background", "a green square on a white background"]
    event = _with_run(load_event("start_evaluation_task.json"), evaluation={"prompts": prompts})

    result = load_function_module("start_evaluation").lambda_handler(event, context)

    name = result["resource_name"]
    assert name == names.evaluation_job_name(
        names.run_hash(event["execution_arn"], event["start_time"]), event["config"]["run_id"], 0, 0
    )
    job = mocked_aws.sagemaker.describe_processing_job(ProcessingJobName=name)
    arguments = job["AppSpecification"]["ContainerArguments"]
    prompts_file = arguments[arguments.index("--prompts_file") + 1]
    assert prompts_file == "/opt/ml/processing/prompts/prompts.json"
    written = mocked_aws.get_json(f"runs/{event['config']['run_id']}/evaluation/prompts.json")
    assert written == prompts
    record = store.get(name)
    assert record is not None
    assert record.kind == "evaluation"
    assert record.context["output_uri"].endswith(f"/evaluation/{name}/")


def test_start_evaluation_metric_outcome_says_created_then_existing(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext, capsys: pytest.CaptureFixture[str]
) -> None:
    handler = load_function_module("start_evaluation").lambda_handler
    event = load_event("start_evaluation_task.json")

    handler(event, context)
    handler(event, context)  # the same attempt invoked again (a Lambda retry): the job exists

    documents = [json.loads(line) for line in capsys.readouterr().out.splitlines() if '"_aws"' in line]
    outcomes = [d["Outcome"] for d in documents if "EvaluationJobsStarted" in d]
    assert outcomes == ["created", "existing"]


@pytest.mark.parametrize(
    ("result", "outcome"),
    [
        ({"resource_name": "j", "created": True}, "created"),
        ({"resource_name": "j", "created": False, "adopted": True}, "adopted"),
        ({"resource_name": "j", "created": False}, "existing"),
    ],
)
def test_start_outcome_names_what_the_starter_did(result: dict[str, Any], outcome: str) -> None:
    assert start_outcome(result) == outcome


def test_job_events_evaluation_completed_answers_with_the_evaluation_folder(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    event = load_event("start_evaluation_task.json")
    name = load_function_module("start_evaluation").lambda_handler(event, context)["resource_name"]
    completed = load_event("sagemaker_processing_completed.json")
    completed["detail"]["ProcessingJobName"] = name
    sent: list[dict[str, Any]] = []
    resolver = TaskResolver(store, _RecordingSfn(sent), mocked_aws.sagemaker)

    from sdflow_common.job_events import ProcessingJobStateChange

    resolution = resolve_event(ProcessingJobStateChange.model_validate(completed), resolver)

    assert resolution.outcome == "succeeded"
    output = json.loads(sent[0]["output"])
    assert output["job_name"] == name
    assert output["evaluation_uri"] == store_context_uri(event, name)
    assert store.get(name) is None


def test_job_events_evaluation_adopted_job_answers_with_the_job_own_output_folder(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    """Attempt 1 adopted attempt 0's job: the job wrote to attempt 0's folder, whatever the claim says."""
    event = load_event("start_evaluation_task.json")
    name = load_function_module("start_evaluation").lambda_handler(event, context)["resource_name"]
    completed = load_event("sagemaker_processing_completed.json")
    earlier = "s3://sdflow-data-test/runs/x/evaluation/sdf-ev-x-r0-a0/"
    completed["detail"].update(
        ProcessingJobName=name,
        ProcessingOutputConfig={"Outputs": [{"OutputName": "evaluation", "S3Output": {"S3Uri": earlier}}]},
    )
    sent: list[dict[str, Any]] = []
    from sdflow_common.job_events import ProcessingJobStateChange

    resolve_event(
        ProcessingJobStateChange.model_validate(completed),
        TaskResolver(store, _RecordingSfn(sent), mocked_aws.sagemaker),
    )

    assert json.loads(sent[0]["output"])["evaluation_uri"] == earlier


def store_context_uri(event: dict[str, Any], name: str) -> str:
    return f"s3://{event['config']['bucket']}/runs/{event['config']['run_id']}/evaluation/{name}/"


class _RecordingSfn:
    def __init__(self, sent: list[dict[str, Any]]) -> None:
        self.sent = sent

    def send_task_success(self, **kwargs: Any) -> None:
        self.sent.append({"kind": "success", **kwargs})

    def send_task_failure(self, **kwargs: Any) -> None:
        self.sent.append({"kind": "failure", **kwargs})


# ---------------------------------------------------------------------------- Register model


def test_register_model_gate_passed_auto_registers_approved_with_metrics_and_lineage(
    mocked_aws: AwsWorld, context: FakeLambdaContext
) -> None:
    event = _with_run(load_event("register_model_task.json"), evaluation={"min_prompt_adherence": 0.8})
    _put_scores(mocked_aws, event, SCORES)

    result = load_function_module("register_model").lambda_handler(event, context)

    request = model_package_request(
        RegisterTask.model_validate(event), _settings(), "sdf-pokemon-sd15-v2", "Approved", SCORES
    )
    assert_valid_request("CreateModelPackage", request)
    assert len(request["ClientToken"]) <= 36
    assert result["approval_status"] == "Approved"
    assert result["model_package_group"] == "sdf-pokemon-sd15-v2"
    described = mocked_aws.sagemaker.describe_model_package(ModelPackageName=result["model_package_arn"])
    assert described["ModelApprovalStatus"] == "Approved"
    container = described["InferenceSpecification"]["Containers"][0]
    # The training job's uncompressed output, read by S3Prefix: no model.tar.gz to download and untar.
    prefix = event["training"]["model_data_url"]
    assert prefix.endswith("/output/model/")
    assert container == {
        "Image": TRAINING_IMAGE_URI,
        "ModelDataSource": {"S3DataSource": {"S3Uri": prefix, "S3DataType": "S3Prefix", "CompressionType": "None"}},
    }
    metadata = described["CustomerMetadataProperties"]
    assert metadata["sdflow:prompt_adherence"] == "0.8600"
    assert metadata["sdflow:base_prompt_adherence"] == "0.1100"
    assert metadata["sdflow:final_loss"] == "0.081200"
    assert metadata["sdflow:training_job"] == event["training"]["job_name"]
    assert metadata["sdflow:evaluation_job"] == event["evaluation"]["job_name"]
    assert metadata["sdflow:dataset_index"] == event["dataset"]["index_uri"]
    assert metadata["sdflow:samples"].endswith("/adherence.png")
    assert described["MetadataProperties"]["GeneratedBy"] == event["execution_arn"]


def test_register_model_curation_counts_become_data_metadata_and_description(
    mocked_aws: AwsWorld, context: FakeLambdaContext
) -> None:
    """The data card: `sdflow:data` in CustomerMetadataValue's characters, the funnel in the description."""
    event = _with_run(load_event("register_model_task.json"), evaluation={"min_prompt_adherence": 0.8})
    every_filter = dict.fromkeys(curation.FILTER_ORDER, 123_456_789)  # the longest data card there is
    event["dataset"]["curation"] = {
        "rows_read": 9_876_543_210, "filter_drops": every_filter, "rows_to_download": 10**9,
        "failed_to_download": 12_345, "failed_to_resize": 5, "holdout": 4_321, "url_duplicates": 777,
        "image_duplicates": 66, "kept": 987_654_321, "deduplicated": True, "unhashed_shards": 0,
    }  # fmt: skip
    _put_scores(mocked_aws, event, SCORES)

    result = load_function_module("register_model").lambda_handler(event, context)

    request = model_package_request(RegisterTask.model_validate(event), _settings(), "g", "Approved", SCORES)
    assert_valid_request("CreateModelPackage", request)  # the value pattern and the 256-character limit
    described = mocked_aws.sagemaker.describe_model_package(ModelPackageName=result["model_package_arn"])
    data = described["CustomerMetadataProperties"]["sdflow:data"]
    assert len(data) <= 256
    assert re.fullmatch(r"[\w\s.:/=+\-@]*", data)
    assert data.startswith("read=9876543210 filtered=1111111101 failed=12350 holdout=4321 url_dup=777 image_dup=66 ")
    assert "kept=987654321 min_width=123456789" in data
    description = described["ModelPackageDescription"]
    assert "Data: 9,876,543,210 rows read; 1,111,111,101 filtered (11.2%): 123,456,789 by min_width, " in description
    assert "843 duplicates (0.0%): 777 url, 66 image; 987,654,321 kept for training (10.0%)." in description


def test_register_model_without_curation_has_no_data_metadata(mocked_aws: AwsWorld, context: FakeLambdaContext) -> None:
    event = _with_run(load_event("register_model_task.json"), evaluation={"min_prompt_adherence": 0.8})
    event["dataset"].pop("curation", None)  # a run from before the counts
    _put_scores(mocked_aws, event, SCORES)

    result = load_function_module("register_model").lambda_handler(event, context)

    described = mocked_aws.sagemaker.describe_model_package(ModelPackageName=result["model_package_arn"])
    assert "sdflow:data" not in described["CustomerMetadataProperties"]
    assert "Data:" not in described["ModelPackageDescription"]


def test_register_model_below_gate_registers_rejected_and_raises_with_score_and_samples(
    mocked_aws: AwsWorld,
) -> None:
    event = _with_run(load_event("register_model_task.json"), evaluation={"min_prompt_adherence": 0.9})
    _put_scores(mocked_aws, event, SCORES)

    with pytest.raises(QualityGateFailed) as failure:
        register_model(RegisterTask.model_validate(event), _settings())

    message = str(failure.value)
    assert "✗ prompt_adherence (trained ≥ 0.9): base 0.11 → trained 0.86, below the quality gate 0.9" in message
    assert "adherence.png" in message
    assert "keeps serving its current model" in message
    listed = mocked_aws.sagemaker.list_model_packages(ModelPackageGroupName="sdf-pokemon-sd15-v2")
    assert [p["ModelApprovalStatus"] for p in listed["ModelPackageSummaryList"]] == ["Rejected"]


def test_register_model_manual_approval_registers_pending(mocked_aws: AwsWorld) -> None:
    event = _with_run(load_event("register_model_task.json"), approval={"mode": "manual"})
    _put_scores(mocked_aws, event, SCORES)

    result = register_model(RegisterTask.model_validate(event), _settings())

    assert result["approval_status"] == "PendingManualApproval"


def test_register_model_second_run_of_same_name_adds_a_version_to_the_group(mocked_aws: AwsWorld) -> None:
    first = load_event("register_model_task.json")
    second = copy.deepcopy(first)
    second["training"]["job_name"] = first["training"]["job_name"].replace("-a0", "-a1")
    for event in (first, second):
        _put_scores(mocked_aws, event, SCORES)
        register_model(RegisterTask.model_validate(event), _settings())

    listed = mocked_aws.sagemaker.list_model_packages(ModelPackageGroupName="sdf-pokemon-sd15-v2")
    assert sorted(p["ModelPackageVersion"] for p in listed["ModelPackageSummaryList"]) == [1, 2]


def test_register_model_missing_evaluation_file_raises_evaluation_job_failed(mocked_aws: AwsWorld) -> None:
    event = load_event("register_model_task.json")

    with pytest.raises(EvaluationJobFailed, match=r"evaluation\.json"):
        register_model(RegisterTask.model_validate(event), _settings())


def test_run_document_evaluation_prompt_outside_grammar_names_field_and_grammar() -> None:
    from sdflow_common.run_document import InvalidRunDocument, parse_run_document

    raw = {
        "dataset": {"prefix": "s3://sdflow-data-test/datasets/x/"},
        "base_model_uri": "s3://sdflow-data-test/models/m/",
        "evaluation": {"prompts": ["a photo of a cat"]},
    }
    with pytest.raises(InvalidRunDocument) as failure:
        parse_run_document(raw)

    [problem] = json.loads(str(failure.value))
    assert problem["field"] == "evaluation.prompts"
    assert "a <colour> <shape> on a <colour> background" in problem["message"]


def test_run_document_scene_grammar_matches_the_image_scene_grammar() -> None:
    from sdflow_common import run_document
    from sdflow_image import scenes

    assert set(run_document.SCENE_COLOURS) == set(scenes.COLORS)
    assert set(run_document.SCENE_SHAPES) == set(scenes.SHAPES)
    assert run_document.SCENE_GRAMMAR == scenes.GRAMMAR
    for scene in scenes.all_scenes():
        assert run_document.scene_prompt_problem(scene.caption) is None


# ---------------------------------------------------------------------------- Wait for approval


def _registered_pending(world: AwsWorld) -> str:
    event = _with_run(load_event("register_model_task.json"), approval={"mode": "manual"})
    _put_scores(world, event, SCORES)
    return str(register_model(RegisterTask.model_validate(event), _settings())["model_package_arn"])


def _approval_task(arn: str) -> dict[str, Any]:
    event = load_event("await_approval_task.json")
    event["model_package_arn"] = arn
    return event


def test_await_approval_pending_package_parks_token_until_approved_event(
    mocked_aws: AwsWorld, store: TokenStore, context: FakeLambdaContext
) -> None:
    arn = _registered_pending(mocked_aws)
    event = _approval_task(arn)

    result = load_function_module("await_approval").lambda_handler(event, context)

    assert result["waiting"] is True
    record = store.get(arn)
    assert record is not None
    assert record.kind == "approval"
    approved = load_event("sagemaker_model_package_approved.json")
    approved["detail"]["ModelPackageArn"] = arn
    sent: list[dict[str, Any]] = []
    from sdflow_common.job_events import ModelPackageStateChange

    resolution = resolve_event(
        ModelPackageStateChange.model_validate(approved), TaskResolver(store, _RecordingSfn(sent), mocked_aws.sagemaker)
    )
    assert resolution.outcome == "succeeded"
    assert sent[0]["kind"] == "success"
    assert sent[0]["taskToken"] == event["token"]
    assert json.loads(sent[0]["output"])["approval_status"] == "Approved"
    assert store.get(arn) is None


def test_job_events_model_package_rejected_fails_task_with_model_rejected_and_reason(
    mocked_aws: AwsWorld, store: TokenStore
) -> None:
    arn = _registered_pending(mocked_aws)
    await_approval(ApprovalTask.model_validate(_approval_task(arn)), _settings(), store=store)
    rejected = load_event("sagemaker_model_package_rejected.json")
    rejected["detail"]["ModelPackageArn"] = arn
    sent: list[dict[str, Any]] = []
    from sdflow_common.job_events import ModelPackageStateChange

    resolve_event(
        ModelPackageStateChange.model_validate(rejected), TaskResolver(store, _RecordingSfn(sent), mocked_aws.sagemaker)
    )

    assert sent[0]["kind"] == "failure"
    assert sent[0]["error"] == "ModelRejected"
    assert "backgrounds bleed into the shapes" in sent[0]["cause"]


def test_await_approval_package_approved_before_the_wait_answers_at_once(
    mocked_aws: AwsWorld, store: TokenStore
) -> None:
    arn = _registered_pending(mocked_aws)
    mocked_aws.sagemaker.update_model_package(ModelPackageArn=arn, ModelApprovalStatus="Approved")
    sent: list[dict[str, Any]] = []

    result = await_approval(
        ApprovalTask.model_validate(_approval_task(arn)),
        _settings(),
        store=store,
        sagemaker=mocked_aws.sagemaker,
        sfn=_RecordingSfn(sent),
    )

    assert result["waiting"] is False
    assert [item["kind"] for item in sent] == ["success"]
    assert store.get(arn) is None


def test_job_events_pending_status_event_is_ignored(mocked_aws: AwsWorld, store: TokenStore) -> None:
    arn = _registered_pending(mocked_aws)
    await_approval(ApprovalTask.model_validate(_approval_task(arn)), _settings(), store=store)
    pending = load_event("sagemaker_model_package_approved.json")
    pending["detail"].update(ModelPackageArn=arn, ModelApprovalStatus="PendingManualApproval")
    from sdflow_common.job_events import ModelPackageStateChange

    resolution = resolve_event(
        ModelPackageStateChange.model_validate(pending), TaskResolver(store, _RecordingSfn([]), mocked_aws.sagemaker)
    )

    assert resolution.outcome == "ignored"
    assert store.get(arn) is not None
