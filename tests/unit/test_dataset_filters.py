"""`dataset.filters`: the model refuses nonsense naming the field; Validate run (and start_pipeline, through the same
checks) refuses a filter whose column is not in a parquet, or holds another type, naming the filter, the column,
the object and the columns it has; the download request carries `--filters`, one JSON item per bound, within
SageMaker's argument limit; the shard cache key changes with the filters."""

from __future__ import annotations

import copy
import json
from typing import Any

import pyarrow as pa
import pytest

from sdflow_common import resume, sagemaker_jobs
from sdflow_common.dataset_files import nearest_first
from sdflow_common.dataset_filters import COLUMN_NAME_LIMIT, FILTER_NAMES, DatasetFilters, filter_arguments
from sdflow_common.errors import InvalidRunDocument
from sdflow_common.request_plan import check_requests, planned_requests
from sdflow_common.run_document import parse_run_document, problems_of
from sdflow_common.settings import Settings
from sdflow_common.validate_run import ValidateRunRequest, check_inputs, validate_run
from tests.helpers import load_function_module
from tests.unit.helpers import DATA_BUCKET, AwsWorld, FakeLambdaContext, load_event
from tests.unit.job_requests import download_name
from tests.unit.parquet_files import parquet_bytes, put_object

MODEL_URI = f"s3://{DATA_BUCKET}/models/tiny-sd/"
ROWS = 4
LAION_SCORES = {
    "punsafe": pa.array([0.01] * ROWS, pa.float64()),
    "pwatermark": pa.array([0.2] * ROWS, pa.float64()),
    "aesthetic": pa.array([5.5] * ROWS, pa.float32()),
    "similarity": pa.array([0.3] * ROWS, pa.float64()),
}
EVERY_FILTER = {
    "min_width": 64,
    "min_height": 64,
    "max_aspect_ratio": 2.0,
    "max_punsafe": 0.5,
    "max_pwatermark": 0.8,
    "min_aesthetic": 5.0,
    "min_similarity": 0.28,
    "min_caption_length": 3,
    "max_caption_length": 200,
}


def raw_document(filters: Any, uris: list[str] | None = None, **dataset: Any) -> dict[str, Any]:
    return {
        "dataset": {"parquet_uris": uris or [f"s3://{DATA_BUCKET}/datasets/a.parquet"], "filters": filters, **dataset},
        "base_model_uri": MODEL_URI,
        "training": {"train_batch_size": 1},  # one global batch of 4 (ml.g5.12xlarge's GPUs) fits the rows
    }


def refused(raw: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(InvalidRunDocument) as caught:
        parse_run_document(raw)
    return {problem["field"]: problem["message"] for problem in problems_of(caught.value)}


# ---------------------------------------------------------------------------- the model


def test_dataset_filters_defaults_are_laion_columns_and_bounds_in_job_order() -> None:
    document = parse_run_document(raw_document({"min_caption_length": 5, "max_punsafe": 0.1, "min_width": 256}))

    filters = document.dataset.filters
    assert filters is not None
    assert list(filters.bounds()) == ["min_width", "max_punsafe", "min_caption_length"]
    assert filters.columns.model_dump() == {
        "width": "WIDTH", "height": "HEIGHT", "punsafe": "punsafe", "pwatermark": "pwatermark",
        "aesthetic": "aesthetic", "similarity": "similarity",
    }  # fmt: skip
    assert filters.columns_of("max_aspect_ratio", "TEXT") == ("WIDTH", "HEIGHT")
    assert filters.columns_of("min_caption_length", "caption") == ("caption",)


def test_run_document_without_filters_has_none() -> None:
    raw = raw_document(None)
    del raw["dataset"]["filters"]

    assert parse_run_document(raw).dataset.filters is None


@pytest.mark.parametrize(
    ("filters", "field", "words"),
    [
        ({"max_aspect_ratio": 0.5}, "dataset.filters.max_aspect_ratio", "never below 1; set it to 1 or more"),
        ({"min_caption_length": 10, "max_caption_length": 5}, "dataset.filters.min_caption_length", "no caption fits"),
        ({"max_punsafe": 1.5}, "dataset.filters.max_punsafe", "less than or equal to 1"),
        ({"max_pwatermark": -0.1}, "dataset.filters.max_pwatermark", "greater than or equal to 0"),
        ({"min_similarity": -2}, "dataset.filters.min_similarity", "greater than or equal to -1"),
        ({"min_width": 0}, "dataset.filters.min_width", "greater than or equal to 1"),
        ({"min_width": 25.5}, "dataset.filters.min_width", "valid integer"),
        ({"min_width": True}, "dataset.filters.min_width", "valid integer"),
        ({"min_height": "256"}, "dataset.filters.min_height", "valid integer"),
        ({"max_punsafe": "0.5"}, "dataset.filters.max_punsafe", "valid number"),
        ({"min_aesthetic": float("nan")}, "dataset.filters.min_aesthetic", "finite number"),
        ({"max_caption_length": -1}, "dataset.filters.max_caption_length", "greater than or equal to 0"),
        ({}, "dataset.filters", "sets no bound, so it filters nothing"),
        ({"columns": {"punsafe": "nsfw"}}, "dataset.filters", "sets no bound"),
        ({"max_punsafe": 0.5, "colums": {}}, "dataset.filters.colums", "did you mean `columns`?"),
        ({"max_punsafe": 0.5, "columns": {"nsfw": "x"}}, "dataset.filters.columns.nsfw", "unknown field"),
        ({"max_punsafe": 0.5, "columns": {"punsafe": ""}}, "dataset.filters.columns.punsafe", "at least 1 character"),
        (
            {"min_width": 1, "columns": {"width": "w" * (COLUMN_NAME_LIMIT + 1)}},
            "dataset.filters.columns.width",
            f"at most {COLUMN_NAME_LIMIT} characters",
        ),
    ],
)
def test_dataset_filters_nonsense_refused_naming_field(filters: dict[str, Any], field: str, words: str) -> None:
    found = refused(raw_document(filters))

    assert set(found) == {field}
    assert words in found[field]


def test_dataset_filters_every_bound_set_is_accepted() -> None:
    filters = parse_run_document(raw_document(EVERY_FILTER)).dataset.filters

    assert filters is not None
    assert list(filters.bounds()) == list(FILTER_NAMES)


def test_job_arguments_one_json_object_per_bound_with_columns_resolved() -> None:
    raw = raw_document({"max_aspect_ratio": 2, "max_punsafe": 0.1, "columns": {"width": "w", "height": "h"}})
    filters = parse_run_document(raw).dataset.filters

    assert filter_arguments(filters, "TEXT") == [
        '{"max_aspect_ratio":{"columns":["w","h"],"bound":2.0}}',
        '{"max_punsafe":{"columns":["punsafe"],"bound":0.1}}',
    ]
    assert filter_arguments(None, "TEXT") == []


def test_job_arguments_longest_possible_item_fits_a_container_argument() -> None:
    # The longest item: two column names at their limit and the longest text a float prints as.
    longest = "w" * COLUMN_NAME_LIMIT
    filters = DatasetFilters(
        max_aspect_ratio=1.0000000000000002e300, columns={"width": longest, "height": longest.upper()}
    )

    [item] = filters.job_arguments("TEXT")

    assert len(item) <= 256
    assert len(item) > 2 * COLUMN_NAME_LIMIT


# ---------------------------------------------------------------------------- the request and the starter


def config(dataset: dict[str, Any]) -> dict[str, Any]:
    """`$.config` of events/register_model_task.json, its dataset changed."""
    found = copy.deepcopy(load_event("register_model_task.json")["config"])
    found["run"]["dataset"] = {**found["run"]["dataset"], **dataset}
    return dict(found)


@pytest.mark.usefixtures("aws_env")
def test_download_request_carries_filters_after_the_flag_each_item_its_own() -> None:
    requests = planned_requests(config({"filters": {"min_width": 256, "max_punsafe": 0.5}}), Settings.from_env())

    download = next(planned for planned in requests if planned.label == "download job")
    arguments = download.request["AppSpecification"]["ContainerArguments"]
    position = arguments.index("--filters")
    assert arguments[position + 1 :] == [
        '{"min_width":{"columns":["WIDTH"],"bound":256}}',
        '{"max_punsafe":{"columns":["punsafe"],"bound":0.5}}',
    ]
    assert download.field_of(f"appSpecification.containerArguments.{position + 3}.member") == "dataset.filters"


@pytest.mark.usefixtures("aws_env")
def test_download_request_without_filters_has_no_filters_flag() -> None:
    requests = planned_requests(config({}), Settings.from_env())

    download = next(planned for planned in requests if planned.label == "download job")
    assert "--filters" not in download.request["AppSpecification"]["ContainerArguments"]


@pytest.mark.usefixtures("aws_env")
def test_check_requests_caption_filter_item_over_256_characters_is_refused_naming_filters() -> None:
    # The caption length filters read dataset.caption_column, whose length the model does not bound.
    raw = config({"caption_column": "c" * 240, "filters": {"min_caption_length": 3}})

    with pytest.raises(InvalidRunDocument) as caught:
        check_requests(raw, Settings.from_env())

    found = {problem["field"]: problem["message"] for problem in problems_of(caught.value)}
    assert set(found) == {"dataset.filters"}  # 240 characters fit --caption_col's own item
    assert "length less than or equal to 256" in found["dataset.filters"]
    assert "change dataset.filters so that the value fits" in found["dataset.filters"]


def test_download_container_arguments_put_filters_last() -> None:
    document = parse_run_document(raw_document({"min_height": 128}))

    arguments = sagemaker_jobs.download_container_arguments(
        document.download, "URL", "TEXT", output_uri="s3://b/o/", shard_id="00000",
        filters=filter_arguments(document.dataset.filters, "TEXT"),
    )  # fmt: skip

    assert arguments[-2:] == ["--filters", '{"min_height":{"columns":["HEIGHT"],"bound":128}}']


def test_shard_cache_key_changes_with_filters_and_not_without() -> None:
    plain = raw_document(None)
    del plain["dataset"]["filters"]
    unfiltered = resume.shard_content_digest(parse_run_document(plain))
    before_filters_existed = resume._digest(
        {
            "download": {
                name: getattr(parse_run_document(plain).download, name) for name in resume.SHARD_CONTENT_OPTIONS
            },
            "dataset": {"url_column": "URL", "caption_column": "TEXT"},
        }
    )

    filtered = resume.shard_content_digest(parse_run_document(raw_document({"max_punsafe": 0.5})))
    stricter = resume.shard_content_digest(parse_run_document(raw_document({"max_punsafe": 0.1})))

    assert unfiltered == before_filters_existed  # earlier runs' shards stay reusable
    assert len({unfiltered, filtered, stricter}) == 3


@pytest.mark.usefixtures("events_execution")
def test_start_download_passes_the_task_filters_to_the_job(mocked_aws: AwsWorld) -> None:
    event = load_event("start_download_task.json")
    event["dataset"]["filters"] = {"max_pwatermark": 0.8, "min_width": 256, "columns": {"width": "width"}}

    load_function_module("start_download").lambda_handler(event, FakeLambdaContext())

    job = mocked_aws.sagemaker.describe_processing_job(ProcessingJobName=download_name(event))
    arguments = job["AppSpecification"]["ContainerArguments"]
    assert arguments[arguments.index("--filters") :] == [
        "--filters",
        '{"min_width":{"columns":["width"],"bound":256}}',
        '{"max_pwatermark":{"columns":["pwatermark"],"bound":0.8}}',
    ]


@pytest.mark.usefixtures("events_execution")
def test_start_download_task_without_filters_passes_none(mocked_aws: AwsWorld) -> None:
    """A task from a state machine deployed before the filters: its dataset has no `filters`."""
    event = load_event("start_download_task.json")

    load_function_module("start_download").lambda_handler(event, FakeLambdaContext())

    job = mocked_aws.sagemaker.describe_processing_job(ProcessingJobName=download_name(event))
    assert "--filters" not in job["AppSpecification"]["ContainerArguments"]


# ---------------------------------------------------------------------------- Validate run: the parquet's columns


@pytest.fixture
def world(intake_world: AwsWorld) -> AwsWorld:
    return intake_world


def check(raw: dict[str, Any]) -> Any:
    return check_inputs(parse_run_document(raw), data_bucket=DATA_BUCKET, max_shards=50)


def check_refused(raw: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(InvalidRunDocument) as caught:
        check(raw)
    return {problem["field"]: problem["message"] for problem in problems_of(caught.value)}


def test_check_inputs_every_filter_on_laion_columns_passes(world: AwsWorld) -> None:
    uri = put_object(world, "datasets/a.parquet", parquet_bytes(ROWS, extra=LAION_SCORES))

    checked = check(raw_document(EVERY_FILTER, [uri]))

    assert checked.warnings == []
    assert checked.document.dataset.filters is not None


def test_check_inputs_filter_column_missing_names_filter_column_object_and_nearest_columns(
    world: AwsWorld,
) -> None:
    scores = {**LAION_SCORES, "AESTHETIC_SCORE": LAION_SCORES["aesthetic"]}
    del scores["aesthetic"]
    uri = put_object(world, "datasets/a.parquet", parquet_bytes(ROWS, extra=scores))

    found = check_refused(raw_document({"min_aesthetic": 5.0, "max_punsafe": 0.5}, [uri]))

    assert set(found) == {"dataset.filters.min_aesthetic"}
    message = found["dataset.filters.min_aesthetic"]
    assert (
        f"reads column 'aesthetic' (dataset.filters.columns.aesthetic), which is not in the object ({uri})" in message
    )
    assert f"{uri} has the columns (nearest first): AESTHETIC_SCORE, " in message
    assert "did you mean 'AESTHETIC_SCORE'? Set dataset.filters.columns.aesthetic to the column's name" in message


def test_check_inputs_filter_columns_mapped_to_the_files_names_pass(world: AwsWorld) -> None:
    extra = {"nsfw": LAION_SCORES["punsafe"], "w": pa.array([64] * ROWS, pa.int16())}
    uri = put_object(world, "datasets/a.parquet", parquet_bytes(ROWS, extra=extra))
    filters = {"max_punsafe": 0.5, "max_aspect_ratio": 1.5, "columns": {"punsafe": "nsfw", "width": "w"}}

    assert check(raw_document(filters, [uri])).warnings == []


def test_check_inputs_aspect_ratio_names_each_missing_column(world: AwsWorld) -> None:
    uri = put_object(world, "datasets/a.parquet", parquet_bytes(ROWS))
    filters = {"max_aspect_ratio": 2.0, "columns": {"width": "W", "height": "H"}}

    with pytest.raises(InvalidRunDocument) as caught:
        check(raw_document(filters, [uri]))

    found = [(problem["field"], problem["message"]) for problem in problems_of(caught.value)]
    assert [field for field, _ in found] == ["dataset.filters.max_aspect_ratio"] * 2
    assert "reads column 'W' (dataset.filters.columns.width)" in found[0][1]
    assert "reads column 'H' (dataset.filters.columns.height)" in found[1][1]


@pytest.mark.parametrize(
    ("filters", "column", "kind", "field", "wanted"),
    [
        ({"max_punsafe": 0.5}, pa.array(["0.1"] * ROWS), "string", "dataset.filters.max_punsafe", "numbers"),
        ({"max_punsafe": 0.5}, pa.array([True] * ROWS), "boolean", "dataset.filters.max_punsafe", "numbers"),
        (
            {"max_punsafe": 0.5},
            pa.array([0] * ROWS, pa.timestamp("ms")),
            "timestamp",
            "dataset.filters.max_punsafe",
            "numbers",
        ),
        (
            {"max_punsafe": 0.5},
            pa.array([1] * ROWS, pa.decimal128(5, 2)),
            "decimal",
            "dataset.filters.max_punsafe",
            "numbers",
        ),
    ],
)
def test_check_inputs_numeric_filter_on_column_of_other_type_is_refused(
    world: AwsWorld, filters: dict[str, Any], column: Any, kind: str, field: str, wanted: str
) -> None:
    uri = put_object(world, "datasets/a.parquet", parquet_bytes(ROWS, extra={"punsafe": column}))

    found = check_refused(raw_document(filters, [uri]))

    assert set(found) == {field}
    assert f"reads column 'punsafe' (dataset.filters.columns.punsafe), which holds {kind}, not {wanted}" in found[field]
    assert uri in found[field]


def test_check_inputs_caption_filter_on_caption_column_of_numbers_is_refused(world: AwsWorld) -> None:
    uri = put_object(world, "datasets/a.parquet", parquet_bytes(ROWS, extra={"N": pa.array([1] * ROWS, pa.int64())}))

    found = check_refused(raw_document({"max_caption_length": 80}, [uri], caption_column="N"))

    assert "which holds int64, not text" in found["dataset.filters.max_caption_length"]
    assert "(dataset.caption_column)" in found["dataset.filters.max_caption_length"]


def test_check_inputs_caption_filter_missing_caption_column_reported_once_at_caption_column(
    world: AwsWorld,
) -> None:
    uri = put_object(world, "datasets/a.parquet", parquet_bytes(ROWS))

    found = check_refused(raw_document({"min_caption_length": 3}, [uri], caption_column="caption"))

    assert set(found) == {"dataset.caption_column"}


def test_check_inputs_filter_column_missing_in_few_objects_within_tolerance_is_a_warning(
    world: AwsWorld,
) -> None:
    good = [put_object(world, f"datasets/p{i:02d}.parquet", parquet_bytes(ROWS, extra=LAION_SCORES)) for i in range(19)]
    bare = put_object(world, "datasets/p19.parquet", parquet_bytes(ROWS))
    raw = raw_document({"max_punsafe": 0.5}, [*good, bare])
    raw["download"] = {"tolerated_failure_percent": 10.0}

    checked = check(raw)

    [warning] = checked.warnings
    assert warning["field"] == "dataset.filters.max_punsafe"
    assert f"is not in 1 of 20 objects ({bare})" in warning["message"]


def test_validate_run_refuses_filter_column_missing_before_writing_anything(world: AwsWorld) -> None:
    uri = put_object(world, "datasets/a.parquet", parquet_bytes(ROWS))
    request = ValidateRunRequest(
        run=raw_document({"min_similarity": 0.28}, [uri]),
        execution_name="run-filters",
        execution_arn="arn:aws:states:us-east-1:123456789012:execution:sdflow-pipeline:run-filters",
        start_time="2025-06-02T09:15:43.512Z",
    )

    with pytest.raises(InvalidRunDocument) as caught:
        validate_run(request, data_bucket=DATA_BUCKET, max_shards=50)

    [problem] = json.loads(str(caught.value))
    assert problem["field"] == "dataset.filters.min_similarity"
    assert "column 'similarity'" in problem["message"]
    assert "KeyCount" in world.s3.list_objects_v2(Bucket=DATA_BUCKET, Prefix="runs/")
    assert world.s3.list_objects_v2(Bucket=DATA_BUCKET, Prefix="runs/")["KeyCount"] == 0


def test_nearest_first_puts_likest_names_first_keeping_file_order_for_ties() -> None:
    columns = ["URL", "TEXT", "WIDTH", "HEIGHT", "width_px", "AESTHETIC_SCORE"]

    assert nearest_first("width", columns)[:2] == ["WIDTH", "width_px"]
    assert nearest_first("aesthetic", columns)[0] == "AESTHETIC_SCORE"
    assert sorted(nearest_first("x", columns)) == sorted(columns)
