"""validate_run: the document checked against the stack, the dataset resolved, `$.config` returned."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sdflow_common import validate_run as validate_module
from sdflow_common.errors import DatasetNotFound, InvalidRunDocument
from sdflow_common.run_document import RunDocument
from sdflow_common.validate_run import RunConfig, ValidateRunRequest, validate_run
from tests.constants import ACCOUNT, REGION
from tests.helpers import load_function_module
from tests.unit.helpers import DATA_BUCKET, STATE_MACHINE_NAME, AwsWorld, FakeLambdaContext
from tests.unit.parquet_files import parquet_bytes

PARQUET = parquet_bytes()
EXECUTION = "demo-0123456789abcdef"
EXECUTION_ARN = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:{STATE_MACHINE_NAME}:{EXECUTION}"
MODEL_URI = f"s3://{DATA_BUCKET}/models/tiny-sd/"
CONTRACT_CONFIG_KEYS = {
    "timeouts",
    "holdout_rate",
    "run_id",
    "execution_arn",
    "started_at",
    "bucket",
    "shard_list_key",
    "shard_count",
    "dataset_prefix_uri",
    "run",
    "quota_check",
    "warnings",
}


@pytest.fixture
def world(mocked_aws: AwsWorld) -> AwsWorld:
    mocked_aws.put_json("models/tiny-sd/model_index.json", {"_class_name": "StableDiffusionPipeline"})
    return mocked_aws


def put_parquet(world: AwsWorld, *keys: str, bucket: str = DATA_BUCKET) -> list[str]:
    for key in keys:
        world.s3.put_object(Bucket=bucket, Key=key, Body=PARQUET)
    return [f"s3://{bucket}/{key}" for key in keys]


def request(run: Any) -> ValidateRunRequest:
    return ValidateRunRequest(
        run=run, execution_name=EXECUTION, execution_arn=EXECUTION_ARN, start_time="2025-06-02T09:15:43.512Z"
    )


def document(**dataset: Any) -> dict[str, Any]:
    return {"dataset": dataset, "base_model_uri": MODEL_URI, "download": {"max_concurrency": 3}}


def run(raw: Any, max_shards: int = 50) -> dict[str, Any]:
    return validate_run(request(raw), data_bucket=DATA_BUCKET, max_shards=max_shards)


def problems(exc: pytest.ExceptionInfo[InvalidRunDocument] | pytest.ExceptionInfo[DatasetNotFound]) -> dict[str, str]:
    return {p["field"]: p["message"] for p in json.loads(str(exc.value))}


def test_validate_parquet_list_writes_sorted_shards_and_returns_contract_config(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/laion/b.parquet", "datasets/laion/a.parquet", "datasets/other/c.parquet")

    config = run(document(parquet_uris=uris))

    assert set(config) == CONTRACT_CONFIG_KEYS
    assert config["run_id"] == EXECUTION
    assert config["execution_arn"] == EXECUTION_ARN
    assert config["started_at"] == "2025-06-02T09:15:43.512Z"
    assert config["bucket"] == DATA_BUCKET
    assert config["shard_list_key"] == f"runs/{EXECUTION}/shards.json"
    assert config["shard_count"] == 3
    assert config["dataset_prefix_uri"] == f"s3://{DATA_BUCKET}/runs/{EXECUTION}/dataset/"
    assert RunDocument.model_validate(config["run"]).download.max_concurrency == 3
    defaults = RunDocument.model_validate(config["run"])
    assert config["timeouts"]["download"] > defaults.download.max_runtime_seconds
    assert config["timeouts"]["training"] > defaults.training.max_runtime_seconds
    assert config["timeouts"]["endpoint"] >= defaults.endpoint.max_wait_seconds
    shards = world.get_json(config["shard_list_key"])
    assert [s["parquet_uri"] for s in shards] == sorted(uris)
    assert [s["shard_id"] for s in shards] == ["00000", "00001", "00002"]
    assert {k: v for k, v in shards[1].items() if k != "cache_key"} == {
        "shard_id": "00001",
        "parquet_uri": f"s3://{DATA_BUCKET}/datasets/laion/b.parquet",
        "output_uri": f"s3://{DATA_BUCKET}/runs/{EXECUTION}/dataset/shards/00001/",
        "cached": False,
    }
    assert len({s["cache_key"] for s in shards}) == 3


def test_validate_writes_normalized_run_document_with_defaults(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    config = run(document(parquet_uris=uris))
    stored = world.get_json(f"runs/{EXECUTION}/run.json")
    assert stored == {"execution_arn": EXECUTION_ARN, "start_time": "2025-06-02T09:15:43.512Z", "run": config["run"]}
    assert stored["run"]["training"]["plugin"] == "gemini"  # defaults filled in
    assert stored["run"]["dataset"]["url_column"] == "URL"
    assert "resume" not in config


def test_validate_config_is_parsed_back_by_run_config(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    config = RunConfig.model_validate(run(document(parquet_uris=uris)))
    assert config.run.dataset.parquet_uris == uris
    assert config.run_prefix == f"runs/{EXECUTION}/"


def test_validate_prefix_lists_every_parquet_below_it_across_pages(
    world: AwsWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(validate_module, "LIST_PAGE_SIZE", 2)
    wanted = put_parquet(
        world, *(f"datasets/laion/part-{i:02d}.parquet" for i in range(5)), "datasets/laion/x/y.PARQUET"
    )
    put_parquet(world, "datasets/laion/_SUCCESS", "datasets/laion/readme.json", "datasets/laion-other/z.parquet")

    config = run(document(prefix=f"s3://{DATA_BUCKET}/datasets/laion"))

    shards = world.get_json(config["shard_list_key"])
    assert [s["parquet_uri"] for s in shards] == sorted(wanted)
    assert config["shard_count"] == 6


def test_validate_prefix_without_parquet_is_dataset_not_found(world: AwsWorld) -> None:
    put_parquet(world, "datasets/empty/readme.txt")
    with pytest.raises(DatasetNotFound) as caught:
        run(document(prefix=f"s3://{DATA_BUCKET}/datasets/empty/"))
    assert problems(caught)["dataset.prefix"].startswith("no *.parquet objects below")


def test_validate_prefix_with_more_files_than_max_shards_is_invalid(
    world: AwsWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(validate_module, "LIST_PAGE_SIZE", 2)
    put_parquet(world, *(f"datasets/big/p{i}.parquet" for i in range(6)))
    with pytest.raises(InvalidRunDocument) as caught:
        run(document(prefix=f"s3://{DATA_BUCKET}/datasets/big/"), max_shards=5)
    assert "more than 5" in problems(caught)["dataset.prefix"]


@pytest.mark.parametrize("prefix", [f"s3://{DATA_BUCKET}/", f"s3://{DATA_BUCKET}/runs/old-run/dataset/"])
def test_validate_prefix_over_pipeline_outputs_is_invalid(world: AwsWorld, prefix: str) -> None:
    with pytest.raises(InvalidRunDocument) as caught:
        run(document(prefix=prefix))
    assert "datasets/<name>/" in problems(caught)["dataset.prefix"]


def test_validate_missing_parquet_object_is_dataset_not_found_naming_it(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    missing = f"s3://{DATA_BUCKET}/datasets/missing.parquet"
    with pytest.raises(DatasetNotFound) as caught:
        run(document(parquet_uris=[*uris, missing]))
    assert missing in str(caught.value)
    assert "1 of 2" in str(caught.value)
    assert not world.s3.list_objects_v2(Bucket=DATA_BUCKET, Prefix="runs/").get("Contents")


def test_validate_dataset_outside_stack_bucket_is_invalid_with_copy_hint(world: AwsWorld) -> None:
    world.s3.create_bucket(Bucket="someone-elses-bucket")
    outside = put_parquet(world, "laion/a.parquet", bucket="someone-elses-bucket")
    inside = put_parquet(world, "datasets/a.parquet")
    with pytest.raises(InvalidRunDocument) as caught:
        run(document(parquet_uris=[*inside, *outside]))
    found = problems(caught)
    assert set(found) == {"dataset.parquet_uris.1"}
    assert f"s3://{DATA_BUCKET}/datasets/" in found["dataset.parquet_uris.1"]


def test_validate_prefix_outside_stack_bucket_is_invalid(world: AwsWorld) -> None:
    with pytest.raises(InvalidRunDocument) as caught:
        run(document(prefix="s3://someone-elses-bucket/laion/"))
    assert "outside this stack's bucket" in problems(caught)["dataset.prefix"]


def test_validate_base_model_outside_stack_bucket_is_invalid_with_copy_hint(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    raw = {**document(parquet_uris=uris), "base_model_uri": "s3://public-models/sd15/"}
    with pytest.raises(InvalidRunDocument) as caught:
        run(raw)
    assert f"s3://{DATA_BUCKET}/models/" in problems(caught)["base_model_uri"]


@pytest.mark.parametrize("model_uri", [f"s3://{DATA_BUCKET}/models/nothing/", f"s3://{DATA_BUCKET}/models/tiny"])
def test_validate_base_model_without_model_index_is_not_found(world: AwsWorld, model_uri: str) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    raw = {**document(parquet_uris=uris), "base_model_uri": model_uri}
    with pytest.raises(DatasetNotFound) as caught:
        run(raw)
    assert "model_index.json" in problems(caught)["base_model_uri"]


def test_validate_prompts_uri_outside_stack_bucket_is_invalid(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    raw = {**document(parquet_uris=uris), "evaluation": {"prompts_uri": "s3://elsewhere/prompts.txt"}}
    with pytest.raises(InvalidRunDocument) as caught:
        run(raw)
    assert "outside this stack's bucket" in problems(caught)["evaluation.prompts_uri"]


def test_validate_missing_prompts_file_is_not_found_naming_the_field(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    missing = f"s3://{DATA_BUCKET}/datasets/prompts.txt"
    raw = {**document(parquet_uris=uris), "evaluation": {"prompts_uri": missing}}
    with pytest.raises(DatasetNotFound) as caught:
        run(raw)
    assert missing in problems(caught)["evaluation.prompts_uri"]
    world.s3.put_object(Bucket=DATA_BUCKET, Key="datasets/prompts.txt", Body=b"a red circle on a blue background\n")
    assert run(raw)["timeouts"]["evaluation"] > 3600


def test_validate_base_model_uri_without_trailing_slash_is_accepted(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    raw = {**document(parquet_uris=uris), "base_model_uri": f"s3://{DATA_BUCKET}/models/tiny-sd"}
    assert run(raw)["shard_count"] == 1


def test_validate_invalid_document_raises_json_error_list(world: AwsWorld) -> None:
    with pytest.raises(InvalidRunDocument) as caught:
        run({"dataset": {"parquet_uris": []}, "base_model_uri": MODEL_URI, "trainning": {}})
    assert set(problems(caught)) == {"dataset.parquet_uris", "trainning"}


def test_validate_more_listed_shards_than_max_is_invalid(world: AwsWorld) -> None:
    uris = [f"s3://{DATA_BUCKET}/datasets/p{i}.parquet" for i in range(4)]
    with pytest.raises(InvalidRunDocument) as caught:
        run(document(parquet_uris=uris), max_shards=3)
    assert "at most 3" in problems(caught)["dataset.parquet_uris"]


def test_handler_returns_config_for_state_machine_payload(world: AwsWorld) -> None:
    app = load_function_module("validate_run")
    uris = put_parquet(world, "datasets/a.parquet", "datasets/b.parquet")
    payload = {
        "run": document(parquet_uris=uris),
        "execution_name": EXECUTION,
        "execution_arn": EXECUTION_ARN,
        "start_time": "2025-06-02T09:15:43.512Z",
    }
    config = app.lambda_handler(payload, FakeLambdaContext())
    assert config["shard_count"] == 2
    assert len(json.dumps(config)) < 4096


def test_handler_raises_named_error_for_step_functions_catch(world: AwsWorld) -> None:
    app = load_function_module("validate_run")
    payload = {
        "run": {"dataset": {"prefix": "https://x/"}, "base_model_uri": MODEL_URI},
        "execution_name": EXECUTION,
        "execution_arn": EXECUTION_ARN,
        "start_time": "2025-06-02T09:15:43.512Z",
    }
    with pytest.raises(InvalidRunDocument) as caught:
        app.lambda_handler(payload, FakeLambdaContext())
    assert type(caught.value).__name__ == "InvalidRunDocument"
    assert "dataset.prefix" in problems(caught)


# ------------------------------------------------------------------ reserved folders, endpoint prefix (H6)
def _locations(dataset: dict[str, Any], endpoint: str = "sdflow-cats", prefix: str = "sdflow") -> None:
    raw = {"dataset": dataset, "base_model_uri": MODEL_URI, "endpoint": {"name": endpoint}}
    validate_module.check_locations(RunDocument.model_validate(raw), DATA_BUCKET, prefix)


def _location_problems(
    dataset: dict[str, Any], endpoint: str = "sdflow-cats", prefix: str = "sdflow"
) -> dict[str, str]:
    with pytest.raises(InvalidRunDocument) as caught:
        _locations(dataset, endpoint, prefix)
    return problems(caught)


@pytest.mark.parametrize(
    "key",
    [
        "runs",  # listed as runs/: S3's own reading
        "runs/",
        "//runs/",
        "/runs",
        "./runs",
        "datasets/../runs/",
        "../runs/x/",
        "runs/../x/",  # S3 reads the key literally: under runs/
        "datasets/./../rejected",
        "manifests",
        ".",
        "//",
        "datasets/..",
    ],
)
def test_check_locations_prefix_reaching_pipeline_files_in_any_spelling_is_invalid(key: str) -> None:
    found = _location_problems({"prefix": f"s3://{DATA_BUCKET}/{key}"})
    assert "would include the pipeline's own files" in found["dataset.prefix"]
    assert f"s3://{DATA_BUCKET}/datasets/<name>/" in found["dataset.prefix"]


@pytest.mark.parametrize("key", ["RUNS/", "Runs", "runs-old/", "runsx", "datasets/runs/", "datasets/cats", "my.runs/"])
def test_check_locations_prefix_beside_reserved_folders_is_accepted(key: str) -> None:
    # S3 keys are case-sensitive ("Naming Amazon S3 objects"): RUNS/ never lists an object under runs/.
    _locations({"prefix": f"s3://{DATA_BUCKET}/{key}"})


# Path pieces that a path-normalising tool reduces to nothing: "", ".", "..", "<name>/..".
NOISE = st.lists(st.sampled_from(["", ".", "..", "datasets/..", "cats/./.."]), max_size=4)


@settings(max_examples=200, deadline=None)
@given(
    reserved=st.sampled_from(["runs", "rejected", "manifests"]),
    before=NOISE,
    after=st.lists(st.sampled_from(["", ".", "old-run", "dataset"]), max_size=3),
    leading_slashes=st.integers(min_value=0, max_value=2),
)
def test_check_locations_prefix_normalising_into_a_reserved_folder_is_invalid(
    reserved: str, before: list[str], after: list[str], leading_slashes: int
) -> None:
    key = "/" * leading_slashes + "/".join([*before, reserved, *after])
    assert "dataset.prefix" in _location_problems({"prefix": f"s3://{DATA_BUCKET}/{key}"}), key


@settings(max_examples=200, deadline=None)
@given(st.lists(st.from_regex(r"\A[A-Za-z0-9_-]{1,12}\Z"), min_size=1, max_size=4))
def test_check_locations_plain_folder_outside_reserved_ones_is_accepted(parts: list[str]) -> None:
    assume(parts[0] not in ("runs", "rejected", "manifests"))
    _locations({"prefix": f"s3://{DATA_BUCKET}/{'/'.join(parts)}/"})


def test_check_locations_endpoint_outside_the_prefix_is_invalid_naming_field_and_prefix() -> None:
    found = _location_problems({"prefix": f"s3://{DATA_BUCKET}/datasets/cats/"}, endpoint="cats", prefix="team-a-")
    assert set(found) == {"endpoint.name"}
    assert "'cats' does not start with 'team-a-'" in found["endpoint.name"]
    assert "EndpointNamePrefix" in found["endpoint.name"]
    assert "e.g. 'team-a-cats'" in found["endpoint.name"]


@pytest.mark.parametrize("endpoint", ["Team-a-cats", "team-cats", "xteam-a-cats"])
def test_check_locations_endpoint_prefix_compared_exactly(endpoint: str) -> None:
    found = _location_problems({"prefix": f"s3://{DATA_BUCKET}/datasets/cats/"}, endpoint=endpoint, prefix="team-a-")
    assert "endpoint.name" in found


def test_check_locations_endpoint_under_the_prefix_is_accepted() -> None:
    _locations({"prefix": f"s3://{DATA_BUCKET}/datasets/cats/"}, endpoint="team-a-cats", prefix="team-a-")


def test_check_locations_reports_endpoint_and_prefix_problems_together() -> None:
    found = _location_problems({"prefix": f"s3://{DATA_BUCKET}/runs"}, endpoint="cats")
    assert set(found) == {"dataset.prefix", "endpoint.name"}


def test_validate_endpoint_prefix_comes_from_the_function_environment(
    world: AwsWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    put_parquet(world, "datasets/cats/a.parquet")
    raw = {**document(prefix=f"s3://{DATA_BUCKET}/datasets/cats/"), "endpoint": {"name": "sdflow-cats"}}
    monkeypatch.setenv("ENDPOINT_NAME_PREFIX", "team-a-")
    with pytest.raises(InvalidRunDocument) as caught:
        run(raw)
    assert "does not start with 'team-a-'" in problems(caught)["endpoint.name"]
    monkeypatch.delenv("ENDPOINT_NAME_PREFIX")  # the template's default, sdflow
    assert run(raw)["shard_count"] == 1


def test_validate_parquet_uri_sagemaker_would_refuse_is_refused_before_anything_is_written(world: AwsWorld) -> None:
    """S3 takes a 1,010-character key; CreateProcessingJob's S3Uri takes at most 1,024 characters in all."""
    uris = put_parquet(world, "datasets/a.parquet", "datasets/" + "k" * 993 + ".parquet")

    with pytest.raises(InvalidRunDocument) as caught:
        run(document(parquet_uris=uris))

    found = problems(caught)
    assert set(found) == {"dataset.parquet_uris.1"}
    assert "CreateProcessingJob" in found["dataset.parquet_uris.1"]
    assert "length less than or equal to 1024" in found["dataset.parquet_uris.1"]
    assert world.s3.list_objects_v2(Bucket=DATA_BUCKET, Prefix="runs/").get("KeyCount") == 0


def test_validate_execution_name_with_marks_step_functions_allows_is_accepted(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    name = "my(run)!it's"
    arn = EXECUTION_ARN.replace(EXECUTION, name)
    raw = ValidateRunRequest(
        run=document(parquet_uris=uris), execution_name=name, execution_arn=arn, start_time="2025-06-02T09:15:43.512Z"
    )

    config = validate_run(raw, data_bucket=DATA_BUCKET, max_shards=50)

    assert config["run_id"] == name


@pytest.mark.parametrize(
    ("training", "download", "field"),
    [
        ({"method": "lora", "plugin": "gemini"}, {}, "training.plugin"),
        ({"resolution": 512}, {"image_size": 256}, "training.resolution"),
    ],
)
def test_validate_training_rule_across_fields_names_the_field_to_change(
    world: AwsWorld, training: dict[str, Any], download: dict[str, Any], field: str
) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    raw = document(parquet_uris=uris) | {"training": training}
    raw["download"] |= download
    with pytest.raises(InvalidRunDocument) as caught:
        run(raw)
    assert list(problems(caught)) == [field]
