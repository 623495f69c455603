"""Validate run's evaluation checks (evaluation_checks): the held-out split sized from the parquet rows and written
back, the CLIP model read from S3 (config, projection_dim, weights from safetensors headers), the gate refused
where the run cannot compute it, scene adherence resolved, and the evaluation instance chosen per family to hold
one pipeline and the CLIP model."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest

from sdflow_common import evaluation_checks, inference_memory, instance_types, memory_estimate
from sdflow_common.errors import DatasetNotFound, InvalidRunDocument
from sdflow_common.evaluation_options import HOLDOUT_OVERSAMPLE, most_holdout_samples
from sdflow_common.memory_estimate import GIB
from sdflow_common.run_document import parse_run_document
from sdflow_common.training_options import TrainingOptions
from sdflow_common.validate_run import CheckedInputs, ValidateRunRequest, check_inputs, validate_run
from tests.constants import ACCOUNT, REGION
from tests.unit.helpers import DATA_BUCKET, STATE_MACHINE_NAME, AwsWorld
from tests.unit.parquet_files import parquet_bytes

MODEL_URI = f"s3://{DATA_BUCKET}/models/base/"
CLIP_URI = f"s3://{DATA_BUCKET}/models/clip/"
PARQUET_KEY = "datasets/data.parquet"
INDEX = {
    "sd": {"_class_name": "StableDiffusionPipeline"},
    "sdxl": {"_class_name": "StableDiffusionXLPipeline"},
    "qwenimage": {"_class_name": "QwenImagePipeline"},
}
# A CLIP config as transformers' CLIPModel.save_pretrained writes it (the fields Validate run reads).
CLIP_CONFIG = {"model_type": "clip", "projection_dim": 32, "text_config": {}, "vision_config": {}}
# About ViT-L/14's tensors, in two shapes: 427,616,512 parameters in all.
VIT_L = {"vision.weight": [1024, 300_000], "text.weight": [768, 156_784], "logit_scale": []}
VIT_L_PARAMETERS = 1024 * 300_000 + 768 * 156_784 + 1


@pytest.fixture
def world(mocked_aws: AwsWorld) -> AwsWorld:
    return mocked_aws


def safetensors_header(shapes: dict[str, list[int]], padding: int = 0) -> bytes:
    """The start of a safetensors file: its header's length and the header (the tensors' bytes left out: Validate
    run reads only the header)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "note": "x" * padding}}
    offset = 0
    for name, shape in shapes.items():
        size = 4
        for dim in shape:
            size *= dim
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text


def put_clip(
    world: AwsWorld, config: Any = None, weights: dict[str, bytes] | None = None, folder: str = "models/clip/"
) -> None:
    world.s3.put_object(Bucket=DATA_BUCKET, Key=f"{folder}config.json", Body=json.dumps(config or CLIP_CONFIG))
    for name, body in (weights if weights is not None else {"model.safetensors": safetensors_header(VIT_L)}).items():
        world.s3.put_object(Bucket=DATA_BUCKET, Key=f"{folder}{name}", Body=body)


def raw(rows: int, family: str = "sd", world: AwsWorld | None = None, **evaluation: Any) -> dict[str, Any]:
    assert world is not None
    world.put_json("models/base/model_index.json", INDEX[family])
    world.s3.put_object(Bucket=DATA_BUCKET, Key=PARQUET_KEY, Body=parquet_bytes(rows=rows))
    return {
        "dataset": {"parquet_uris": [f"s3://{DATA_BUCKET}/{PARQUET_KEY}"]},
        "base_model_uri": MODEL_URI,
        "training": {"instance_type": "ml.m5.xlarge"},
        "endpoint": {"instance_type": "ml.m5.large"},
        "evaluation": evaluation,
    }


def checked(world: AwsWorld, rows: int, family: str = "sd", **evaluation: Any) -> CheckedInputs:
    document = parse_run_document(raw(rows, family, world, **evaluation))
    return check_inputs(document, data_bucket=DATA_BUCKET, max_shards=50)


def refused(world: AwsWorld, rows: int, family: str = "sd", **evaluation: Any) -> dict[str, str]:
    with pytest.raises((InvalidRunDocument, DatasetNotFound)) as caught:
        checked(world, rows, family, **evaluation)
    return {problem["field"]: problem["message"] for problem in json.loads(str(caught.value))}


# --- the held-out split ---------------------------------------------------------------------------------------


def test_validate_run_auto_holdout_is_written_back_with_its_rate(world: AwsWorld) -> None:
    put_clip(world)
    request = ValidateRunRequest(
        run=raw(2000, world=world, clip_model_uri=CLIP_URI),
        execution_name="holdout-run",
        execution_arn=f"arn:aws:states:{REGION}:{ACCOUNT}:execution:{STATE_MACHINE_NAME}:holdout-run",
        start_time="2025-06-02T09:15:43.512Z",
    )

    config = validate_run(request, data_bucket=DATA_BUCKET, max_shards=50)

    # min(256, floor(2000 x 0.2 / 1.5) = 266) = 256, held out at 1.5 x 256 / 2000.
    assert config["run"]["evaluation"]["holdout_samples"] == 256
    assert config["holdout_rate"] == pytest.approx(HOLDOUT_OVERSAMPLE * 256 / 2000)
    assert config["run"]["evaluation"]["scene_adherence"] is False
    assert config["run"]["evaluation"]["instance_type"] == "ml.g4dn.xlarge"
    assert world.get_json("runs/holdout-run/run.json")["run"]["evaluation"] == config["run"]["evaluation"]


def test_check_inputs_auto_holdout_on_a_small_dataset_is_none_with_a_warning(world: AwsWorld) -> None:
    put_clip(world)
    found = checked(world, 300, clip_model_uri=CLIP_URI)
    assert (found.document.evaluation.holdout_samples, found.holdout_rate) == (0, 0.0)
    [warning] = found.warnings
    assert warning["field"] == "evaluation.holdout_samples"
    assert "300 parquet rows are too few" in warning["message"]
    assert "set evaluation.holdout_samples (at most 40)" in warning["message"]
    # Nothing held out and so no CLIP metric: the scene adherence is what the job scores.
    assert found.document.evaluation.scene_adherence is True


def test_check_inputs_auto_holdout_without_clip_model_warns_nothing(world: AwsWorld) -> None:
    found = checked(world, 300)
    assert found.document.evaluation.holdout_samples == 0
    assert found.warnings == []


def test_check_inputs_explicit_holdout_more_than_the_dataset_holds_is_refused(world: AwsWorld) -> None:
    message = refused(world, 300, holdout_samples=41)["evaluation.holdout_samples"]
    assert "41 held-out samples" in message
    assert "300 parquet rows hold at most 40" in message
    assert "set evaluation.holdout_samples to at most 40" in message


def test_check_inputs_explicit_holdout_at_the_limit_is_accepted(world: AwsWorld) -> None:
    found = checked(world, 300, holdout_samples=40)
    assert found.holdout_rate == pytest.approx(0.2)
    assert found.document.evaluation.holdout_samples == 40


def test_check_inputs_holdout_zero_holds_nothing_out(world: AwsWorld) -> None:
    found = checked(world, 5000, holdout_samples=0)
    assert found.holdout_rate == 0.0


@pytest.mark.parametrize("rows", [1, 7, 8, 479, 480, 1920, 1921, 100_000])
def test_most_holdout_samples_keeps_the_rate_within_the_maximum(rows: int) -> None:
    most = most_holdout_samples(rows)
    assert HOLDOUT_OVERSAMPLE * most / rows <= 0.2 + 1e-12
    assert HOLDOUT_OVERSAMPLE * (most + 1) / rows > 0.2


# --- the CLIP model -------------------------------------------------------------------------------------------


def test_read_clip_model_counts_parameters_from_the_safetensors_header(world: AwsWorld) -> None:
    put_clip(world)
    clip = evaluation_checks.read_clip_model(CLIP_URI)
    assert clip.projection_dim == 32
    assert clip.weight_bytes == VIT_L_PARAMETERS * 4
    assert clip.weights_from == "safetensors headers"


def test_read_clip_model_large_header_and_shards_take_more_reads(
    world: AwsWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(evaluation_checks, "HEADER_PEEK", 64)  # every header is longer: a second ranged GET
    shards = {
        "model-00001-of-00002.safetensors": safetensors_header({"a": [10, 10]}, padding=200),
        "model-00002-of-00002.safetensors": safetensors_header({"b": [5]}),
        "model.fp16.safetensors": safetensors_header({"ignored": [1000]}),  # a variant from_pretrained skips
    }
    put_clip(world, config={"text_config": {}, "vision_config": {}}, weights=shards)
    clip = evaluation_checks.read_clip_model(CLIP_URI.rstrip("/"))
    assert clip.weight_bytes == (100 + 5) * 4
    assert clip.projection_dim == evaluation_checks.DEFAULT_PROJECTION_DIM


def test_read_clip_model_pickle_weights_count_their_file_size(world: AwsWorld) -> None:
    put_clip(world, weights={"pytorch_model.bin": b"\0" * 1234})
    clip = evaluation_checks.read_clip_model(CLIP_URI)
    assert (clip.weight_bytes, clip.weights_from) == (1234, "weight file sizes")


def test_check_inputs_clip_model_missing_is_not_found_naming_the_field(world: AwsWorld) -> None:
    message = refused(world, 2000, clip_model_uri=CLIP_URI)["evaluation.clip_model_uri"]
    assert f"{CLIP_URI}config.json does not exist or is not readable" in message


def test_check_inputs_clip_model_outside_the_bucket_is_refused(world: AwsWorld) -> None:
    message = refused(world, 2000, clip_model_uri="s3://someone-elses-bucket/clip/")["evaluation.clip_model_uri"]
    assert "outside this stack's bucket" in message
    assert f"s3://{DATA_BUCKET}/models/" in message


@pytest.mark.parametrize(
    ("config", "weights", "expected"),
    [
        ({"model_type": "bert"}, None, "not a CLIP model"),
        (["not", "an", "object"], None, "is not a JSON object"),
        ({**CLIP_CONFIG, "projection_dim": 0}, None, "projection_dim is 0"),
        (CLIP_CONFIG, {"tf_model.h5": b"x"}, "holds no model.safetensors"),
        (CLIP_CONFIG, {"model.safetensors": b"\xff" * 16}, "is not a safetensors file"),
    ],
)
def test_check_inputs_clip_model_not_loadable_is_refused(
    world: AwsWorld, config: Any, weights: dict[str, bytes] | None, expected: str
) -> None:
    put_clip(world, config=config, weights=weights)
    assert expected in refused(world, 2000, clip_model_uri=CLIP_URI)["evaluation.clip_model_uri"]


# --- the gate -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", ["clip_score", "kid", "fid"])
def test_check_inputs_holdout_gate_without_clip_model_is_refused(world: AwsWorld, metric: str) -> None:
    message = refused(world, 2000, gate={metric: {"max_change": 0}})[f"evaluation.gate.{metric}"]
    assert "needs a CLIP model: set evaluation.clip_model_uri" in message


def test_check_inputs_holdout_gate_without_holdout_samples_is_refused(world: AwsWorld) -> None:
    put_clip(world)
    message = refused(world, 2000, clip_model_uri=CLIP_URI, holdout_samples=0, gate={"kid": {"max_change": 0}})[
        "evaluation.gate.kid"
    ]
    assert "evaluation.holdout_samples is 0" in message


def test_check_inputs_fid_gate_with_fewer_samples_than_projection_dim_is_refused(world: AwsWorld) -> None:
    put_clip(world)
    problems = refused(world, 2000, clip_model_uri=CLIP_URI, holdout_samples=31, gate={"fid": {"max_change": 0}})
    assert "projection_dim 32" in problems["evaluation.gate.fid"]
    assert "at least 32" in problems["evaluation.gate.fid"]
    found = checked(world, 2000, clip_model_uri=CLIP_URI, holdout_samples=32, gate={"fid": {"max_change": 0}})
    assert found.document.evaluation.gate.fid is not None


def test_check_inputs_prompt_adherence_gate_without_scene_adherence_is_refused(world: AwsWorld) -> None:
    put_clip(world)
    common = {"clip_model_uri": CLIP_URI, "scene_adherence": False}
    gate = refused(world, 2000, **common, gate={"prompt_adherence": {"min": 0.5}})
    assert "evaluation.scene_adherence is false" in gate["evaluation.gate.prompt_adherence"]
    older = refused(world, 2000, **common, min_prompt_adherence=0.5)
    assert "remove evaluation.min_prompt_adherence" in older["evaluation.min_prompt_adherence"]


def test_check_inputs_scene_adherence_off_with_nothing_else_to_score_is_refused(world: AwsWorld) -> None:
    message = refused(world, 2000, scene_adherence=False)["evaluation.scene_adherence"]
    assert "no clip_model_uri" in message
    assert "score nothing" in message


def test_check_inputs_computable_gate_passes_and_scene_adherence_follows_the_gate(world: AwsWorld) -> None:
    put_clip(world)
    gate = {"kid": {"max_change": 0}, "clip_score": {"min_change": -1.0}, "prompt_adherence": {"min": 0.2}}
    found = checked(world, 2000, clip_model_uri=CLIP_URI, gate=gate)
    assert found.document.evaluation.scene_adherence is True
    assert found.document.evaluation.gate.metrics() == ["clip_score", "kid", "prompt_adherence"]


# --- the evaluation instance ----------------------------------------------------------------------------------


def _need(family: str, clip_bytes: int = 0) -> float:
    resolution = TrainingOptions().resolution  # the documents here keep the default
    return inference_memory.evaluation_estimate(family, resolution, clip_bytes=clip_bytes).total_gib


# ml.p5.4xlarge (one H100), not ml.p5.48xlarge: a processing job cannot ask for the latter (ProcessingClusterConfig).
@pytest.mark.parametrize(("family", "expected"), [("sd", "ml.g4dn.xlarge"), ("qwenimage", "ml.p5.4xlarge")])
def test_check_inputs_evaluation_instance_default_is_the_smallest_that_fits_the_family(
    world: AwsWorld, family: str, expected: str
) -> None:
    found = checked(world, 2000, family, holdout_samples=0)
    instance_type = found.document.evaluation.instance_type
    assert instance_type == expected
    gpu = instance_types.GPU_INSTANCES[expected]
    assert memory_estimate.usable_gib(gpu) >= _need(family)
    smaller = [g for g in instance_types.GPU_INSTANCES.values() if g.count == 1 and g.gib < gpu.gib]
    assert all(memory_estimate.usable_gib(g) < _need(family) for g in smaller)


def test_check_inputs_big_clip_model_moves_the_default_to_a_larger_gpu(world: AwsWorld) -> None:
    # 5 B parameters in float32 (20 GB) beside an SDXL pipeline no longer fit a T4 or an A10G.
    put_clip(world, weights={"model.safetensors": safetensors_header({"w": [50_000, 100_000]})})
    without = checked(world, 2000, "sdxl", holdout_samples=0).document.evaluation.instance_type
    with_clip = checked(world, 2000, "sdxl", clip_model_uri=CLIP_URI).document.evaluation.instance_type
    assert without == "ml.g4dn.xlarge"
    assert with_clip is not None
    assert memory_estimate.usable_gib(instance_types.GPU_INSTANCES[with_clip]) >= _need("sdxl", 50 * 10**8 * 4)
    assert instance_types.GPU_INSTANCES[with_clip].gib > instance_types.GPU_INSTANCES["ml.g5.xlarge"].gib


def test_check_inputs_evaluation_instance_too_small_for_pipeline_and_clip_is_refused(world: AwsWorld) -> None:
    put_clip(world, weights={"model.safetensors": safetensors_header({"w": [50_000, 100_000]})})
    message = refused(world, 2000, "sdxl", clip_model_uri=CLIP_URI, instance_type="ml.g5.xlarge")[
        "evaluation.instance_type"
    ]
    need = _need("sdxl", 50 * 10**8 * 4)
    assert "and the CLIP model in float32" in message
    assert f"about {need:.1f} GiB" in message
    assert f"CLIP model {50 * 10**8 * 4 / GIB:.1f}" in message
    suggested = message.split("set evaluation.instance_type to e.g. ")[1].split(" ")[0]
    assert memory_estimate.usable_gib(instance_types.GPU_INSTANCES[suggested]) >= need


def test_check_inputs_explicit_cpu_evaluation_instance_is_kept(world: AwsWorld) -> None:
    found = checked(world, 2000, instance_type="ml.m5.xlarge")
    assert found.document.evaluation.instance_type == "ml.m5.xlarge"
