"""Register model's quality gate on every evaluation metric (evaluation.gate), the metrics it records in the
package's metadata, and the `$.registry.model` result the notification, `sdflow status`, the SDK and the
console read."""

from __future__ import annotations

import copy
from typing import Any

# The X-Ray SDK opens its UDP emitter's socket on first import (Tracer() triggers it).
import aws_xray_sdk.core  # noqa: F401
import pytest
import regex

from sdflow_common import curation
from sdflow_common.errors import EvaluationJobFailed, QualityGateFailed
from sdflow_common.evaluation import EVALUATION_FILE
from sdflow_common.model_registry import (
    METADATA_ENTRY_LIMIT,
    METADATA_VALUE_LIMIT,
    EvaluationResult,
    RegisterTask,
    gate_metadata,
    model_package_request,
    read_evaluation,
    register_model,
)
from sdflow_common.quality_gate import QualityGate
from sdflow_common.settings import Settings
from tests.helpers import load_function_module
from tests.unit.evaluation_documents import FLAT_SCORES, evaluation_document
from tests.unit.helpers import AwsWorld, FakeLambdaContext, load_event
from tests.unit.job_requests import assert_valid_request

# CustomerMetadataValue's pattern (SageMaker API Reference), matched whole.
METADATA_VALUE = regex.compile(r"[\p{L}\p{Z}\p{N}_.:\/=+\-@]*")
# Every metric, every bound: the longest gate a run document can hold.
pytestmark = pytest.mark.usefixtures("aws_env")  # the template's environment: the training image URI
LARGEST_GATE = {
    metric: {"min": -12345.678, "max": 12345.678, "min_change": -1234.5678, "max_change": 1234.5678}
    for metric in ("clip_score", "kid", "fid", "prompt_adherence")
}


def _event(gate: dict[str, Any] | None = None, **evaluation: Any) -> dict[str, Any]:
    event = copy.deepcopy(load_event("register_model_task.json"))
    event["config"]["run"]["evaluation"] = {**evaluation, **({"gate": gate} if gate is not None else {})}
    return event


def _put(world: AwsWorld, event: dict[str, Any], document: dict[str, Any]) -> None:
    bucket, _, prefix = event["evaluation"]["evaluation_uri"].removeprefix("s3://").partition("/")
    world.put_json(prefix + EVALUATION_FILE, document, bucket=bucket)


def _evaluation(event: dict[str, Any]) -> EvaluationResult:
    return EvaluationResult.model_validate(event["evaluation"])


def _package(event: dict[str, Any], document: dict[str, Any]) -> dict[str, Any]:
    return model_package_request(RegisterTask.model_validate(event), Settings.from_env(), "sdf-g", "Approved", document)


# ---------------------------------------------------------------------------- evaluation.json


def test_read_evaluation_new_document_returns_metrics_missing_and_holdout(mocked_aws: AwsWorld) -> None:
    event = _event()
    _put(mocked_aws, event, evaluation_document(prompt_adherence=None, base_prompt_adherence=None, prompts=None))

    scores = read_evaluation(mocked_aws.s3, _evaluation(event))

    assert set(scores["metrics"]) == {"clip_score", "kid", "prompt_adherence"}
    assert scores["missing"][0]["metric"] == "fid"
    assert scores["holdout"]["grid"] == "holdout.png"


def test_read_evaluation_holdout_only_document_without_adherence_is_accepted(mocked_aws: AwsWorld) -> None:
    metrics = {key: value for key, value in evaluation_document()["metrics"].items() if key != "prompt_adherence"}
    event = _event()
    _put(mocked_aws, event, {"metrics": metrics, "holdout": {"samples": 64, "grid": "holdout.png"}})

    scores = read_evaluation(mocked_aws.s3, _evaluation(event))

    assert "prompt_adherence" not in scores


def test_register_model_old_flat_file_reads_as_prompt_adherence_metric(mocked_aws: AwsWorld) -> None:
    event = _event()
    _put(mocked_aws, event, FLAT_SCORES)

    result = register_model(RegisterTask.model_validate(event), Settings.from_env())

    assert result["metrics"] == {"prompt_adherence": {"trained": 0.86, "base": 0.11, "samples": 48}}
    assert (result["prompt_adherence"], result["base_prompt_adherence"], result["prompts"]) == (0.86, 0.11, 48)
    assert result["missing"] == []
    assert result["gate"] == []
    assert "holdout_grid_uri" not in result


@pytest.mark.parametrize(
    "document",
    [{"settings": {}}, {"metrics": {}, "missing": [{"metric": "kid", "reason": "no CLIP model"}]}],
    ids=["nothing", "empty-metrics"],
)
def test_read_evaluation_without_metrics_or_adherence_raises_evaluation_job_failed(
    mocked_aws: AwsWorld, document: dict[str, Any]
) -> None:
    event = _event()
    _put(mocked_aws, event, document)

    with pytest.raises(EvaluationJobFailed, match=r"holds no metric: neither `metrics`.* nor `prompt_adherence`"):
        read_evaluation(mocked_aws.s3, _evaluation(event))


def test_read_evaluation_not_json_raises_evaluation_job_failed_naming_the_file(mocked_aws: AwsWorld) -> None:
    event = _event()
    bucket, _, prefix = event["evaluation"]["evaluation_uri"].removeprefix("s3://").partition("/")
    mocked_aws.s3.put_object(Bucket=bucket, Key=prefix + EVALUATION_FILE, Body=b"{not json")

    with pytest.raises(EvaluationJobFailed, match=r"evaluation\.json is not JSON"):
        read_evaluation(mocked_aws.s3, _evaluation(event))


# ---------------------------------------------------------------------------- the gate


def test_register_model_relative_gate_failed_registers_rejected_and_lists_every_failed_rule(
    mocked_aws: AwsWorld,
) -> None:
    # KID rose above the base's and the CLIP score fell 2.5 below it; the adherence check passes.
    document = evaluation_document()
    document["metrics"]["kid"] |= {"base": 0.012, "trained": 0.051}
    document["metrics"]["clip_score"] |= {"base": 24.0, "trained": 21.5}
    gate = {"kid": {"max_change": 0}, "clip_score": {"min_change": -1}, "prompt_adherence": {"min": 0.5}}
    event = _event(gate)
    _put(mocked_aws, event, document)

    with pytest.raises(QualityGateFailed) as failure:
        register_model(RegisterTask.model_validate(event), Settings.from_env())

    message = str(failure.value)
    assert "failed 2 of 3 quality gate checks" in message
    assert (
        "✗ clip_score (trained - base ≥ -1): base 24.00 → trained 21.50, change -2.50, below the quality gate -1"
        in message
    )
    assert "✗ kid (trained - base ≤ 0): base 0.0120 → trained 0.0510, change +0.0390, above the quality gate 0" in (
        message
    )
    assert "prompt_adherence" not in message.split("every metric")[0], "a passed check is not a failure"
    listed = mocked_aws.sagemaker.list_model_packages(ModelPackageGroupName="sdf-pokemon-sd15-v2")
    [package] = listed["ModelPackageSummaryList"]
    assert package["ModelApprovalStatus"] == "Rejected"
    assert f"Model package {package['ModelPackageArn']} is registered as Rejected" in message
    assert "keeps serving its current model" in message
    assert f"held-out grid (real | base | trained per caption): {event['evaluation']['evaluation_uri']}holdout.png" in (
        message
    )
    assert f"scores: {event['evaluation']['evaluation_uri']}evaluation.json" in message


def test_register_model_gate_on_a_metric_not_computed_fails_saying_not_computed(mocked_aws: AwsWorld) -> None:
    event = _event({"fid": {"max": 100}})
    _put(mocked_aws, event, evaluation_document())

    with pytest.raises(QualityGateFailed, match=r"✗ fid \(trained ≤ 100\): not computed"):
        register_model(RegisterTask.model_validate(event), Settings.from_env())


def test_register_model_gate_passed_returns_metrics_checks_and_holdout_with_the_flat_keys(
    mocked_aws: AwsWorld, context: FakeLambdaContext
) -> None:
    event = _event({"kid": {"max_change": 0}, "clip_score": {"min_change": -1.0}}, min_prompt_adherence=0.5)
    _put(mocked_aws, event, evaluation_document())

    result = load_function_module("register_model").lambda_handler(event, context)

    assert result["approval_status"] == "Approved"
    assert result["metrics"]["kid"]["trained_std"] == 0.002
    assert result["missing"] == [{"metric": "fid", "reason": evaluation_document()["missing"][0]["reason"]}]
    assert [(check["metric"], check["rule"], check["passed"]) for check in result["gate"]] == [
        ("clip_score", "trained - base >= -1", True),
        ("kid", "trained - base <= 0", True),
        ("prompt_adherence", "trained >= 0.5", True),
    ]
    assert result["gate"][1]["value"] == pytest.approx(-0.039)
    assert result["holdout_samples"] == 64
    assert result["holdout_grid_uri"] == event["evaluation"]["evaluation_uri"] + "holdout.png"
    assert (result["prompt_adherence"], result["base_prompt_adherence"], result["prompts"]) == (0.85, 0.12, 48)
    assert result["min_prompt_adherence"] == 0.5
    assert result["samples_uri"].endswith("/adherence.png")


def test_register_model_without_scene_adherence_has_no_flat_adherence_keys(mocked_aws: AwsWorld) -> None:
    metrics = {key: value for key, value in evaluation_document()["metrics"].items() if key != "prompt_adherence"}
    event = _event({"kid": {"max_change": 0}})
    _put(mocked_aws, event, evaluation_document(metrics=metrics, prompt_adherence=None, grid=None))

    result = register_model(RegisterTask.model_validate(event), Settings.from_env())

    assert result["approval_status"] == "Approved"
    assert not {"prompt_adherence", "base_prompt_adherence", "prompts", "samples_uri"} & result.keys()
    described = mocked_aws.sagemaker.describe_model_package(ModelPackageName=result["model_package_arn"])
    assert "sdflow:samples" not in described["CustomerMetadataProperties"]


def test_register_model_manual_mode_gate_passed_registers_pending(mocked_aws: AwsWorld) -> None:
    event = _event({"kid": {"max_change": 0}})
    event["config"]["run"]["approval"] = {"mode": "manual"}
    _put(mocked_aws, event, evaluation_document())

    result = register_model(RegisterTask.model_validate(event), Settings.from_env())

    assert result["approval_status"] == "PendingManualApproval"


# ---------------------------------------------------------------------------- the package's metadata


def test_model_package_metadata_each_metric_has_base_and_trained_with_four_decimals(mocked_aws: AwsWorld) -> None:
    event = _event({"kid": {"max_change": 0}, "clip_score": {"min_change": -1.0}})
    _put(mocked_aws, event, evaluation_document())

    result = register_model(RegisterTask.model_validate(event), Settings.from_env())

    metadata = mocked_aws.sagemaker.describe_model_package(ModelPackageName=result["model_package_arn"])[
        "CustomerMetadataProperties"
    ]
    assert {key: metadata[key] for key in metadata if key.endswith(("clip_score", "kid", "prompt_adherence"))} == {
        "sdflow:clip_score": "27.9000",
        "sdflow:base_clip_score": "21.3000",
        "sdflow:kid": "0.0120",
        "sdflow:base_kid": "0.0510",
        "sdflow:prompt_adherence": "0.8500",
        "sdflow:base_prompt_adherence": "0.1200",
    }
    assert "sdflow:fid" not in metadata, "a missing metric is not recorded as a number"
    assert metadata["sdflow:holdout_samples"] == "64"
    assert metadata["sdflow:gate"] == "clip_score min_change=-1 kid max_change=0"
    assert metadata["sdflow:holdout_grid"] == event["evaluation"]["evaluation_uri"] + "holdout.png"


def test_model_package_description_names_the_headline_metrics_base_and_trained() -> None:
    description = _package(_event(), evaluation_document())["ModelPackageDescription"]

    assert "clip_score base 21.30 → trained 27.90" in description
    assert "kid base 0.0510 → trained 0.0120" in description
    assert "prompt_adherence base 0.12 → trained 0.85" in description


def test_model_package_largest_gate_lora_and_every_metric_stays_within_entry_limit_and_patterns() -> None:
    # min_prompt_adherence (the older form of gate.prompt_adherence) adds its own entry: both at their largest.
    gate = {key: value for key, value in LARGEST_GATE.items() if key != "prompt_adherence"}
    event = _event(gate, min_prompt_adherence=0.5)
    run = event["config"]["run"]
    run["training"] = {**run["training"], "method": "lora", "plugin": "torch_ddp"}
    run["training"]["lora"] = {"rank": 64, "target_modules": ["to_q", "to_k", "to_v", "to_out.0", "proj_in"]}
    document = evaluation_document()
    document["metrics"]["fid"] = {"base": 80.1, "trained": 40.2, "samples": 1024}
    # The longest data card: every filter, each count at its widest.
    event["dataset"]["curation"] = {
        "rows_read": 10**12, "filter_drops": dict.fromkeys(curation.FILTER_ORDER, 10**11), "rows_to_download": 1,
        "failed_to_download": 10**11, "failed_to_resize": 10**11, "holdout": 10**11, "url_duplicates": 10**11,
        "image_duplicates": 10**11, "kept": 10**11, "deduplicated": True, "unhashed_shards": 0,
    }  # fmt: skip

    request = _package(event, document)

    assert_valid_request("CreateModelPackage", request)  # every key and value pattern, each value ≤ 256
    metadata = request["CustomerMetadataProperties"]
    assert len(metadata) == 27 <= METADATA_ENTRY_LIMIT, sorted(metadata)  # every entry this code can write
    assert len(metadata["sdflow:data"]) <= METADATA_VALUE_LIMIT
    assert METADATA_VALUE.fullmatch(metadata["sdflow:data"])
    assert {f"sdflow:{name}" for name in ("clip_score", "kid", "fid", "prompt_adherence")} <= metadata.keys()
    assert len(metadata["sdflow:gate"]) <= METADATA_VALUE_LIMIT
    assert METADATA_VALUE.fullmatch(metadata["sdflow:gate"])


def test_gate_metadata_over_the_value_limit_names_each_metric_once_and_fits() -> None:
    gate = QualityGate.model_validate(LARGEST_GATE)

    text = gate_metadata(gate)

    assert len(text) <= METADATA_VALUE_LIMIT
    assert text.startswith("clip_score min=-12345.7 max=12345.7 min_change=-1234.57 max_change=1234.57 kid min=")
    assert METADATA_VALUE.fullmatch(text)
    assert not {",", "(", ")", "→"} & set(text)


def test_gate_metadata_empty_gate_is_empty_and_left_out() -> None:
    assert gate_metadata(QualityGate()) == ""
    assert "sdflow:gate" not in _package(_event(), evaluation_document())["CustomerMetadataProperties"]
