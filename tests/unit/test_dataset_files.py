"""Intake reads each parquet object's footer and refuses, before any job starts, what the download
job would refuse: not parquet, no rows, no URL column (or not strings), no caption column."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pytest

from sdflow_common import parquet_schema
from sdflow_common.dataset_files import check_parquet_objects
from sdflow_common.errors import DatasetNotFound, InvalidRunDocument
from sdflow_common.parquet_schema import NotParquet, parse_file_metadata, read_schema
from sdflow_common.run_document import parse_run_document
from sdflow_common.validate_run import ValidateRunRequest, check_inputs, validate_run
from tests.unit.helpers import DATA_BUCKET, AwsWorld
from tests.unit.parquet_files import parquet_bytes
from tests.unit.parquet_files import put_object as put

MODEL_URI = f"s3://{DATA_BUCKET}/models/tiny-sd/"


@pytest.fixture
def world(intake_world: AwsWorld) -> AwsWorld:
    return intake_world


def footer_of(data: bytes) -> bytes:
    length = int.from_bytes(data[-8:-4], "little")
    return data[-8 - length : -8]


def inputs(uris: list[str], tolerated: float = 10.0, **dataset: Any) -> Any:
    raw = {
        "dataset": {"parquet_uris": uris, **dataset},
        "base_model_uri": MODEL_URI,
        "download": {"tolerated_failure_percent": tolerated},
        "training": {"train_batch_size": 1},  # one global batch of 4 (ml.g5.12xlarge's GPUs) fits the rows
    }
    return check_inputs(parse_run_document(raw), data_bucket=DATA_BUCKET, max_shards=50)


def problems(caught: pytest.ExceptionInfo[Any]) -> dict[str, str]:
    return {p["field"]: p["message"] for p in json.loads(str(caught.value))}


@pytest.mark.parametrize(
    ("options", "rows"),
    [({}, 3), ({"compression": "zstd", "row_group_size": 1}, 5), ({"use_dictionary": False}, 0)],
)
def test_parse_file_metadata_reads_pyarrow_columns_and_rows(options: dict[str, Any], rows: int) -> None:
    schema = parse_file_metadata(footer_of(parquet_bytes(rows, **options)))

    assert list(schema.columns) == ["URL", "TEXT", "WIDTH", "HEIGHT"]
    assert schema.num_rows == rows
    assert schema.columns["URL"].is_string
    assert not schema.columns["WIDTH"].is_string
    assert schema.columns["WIDTH"].type_name == "int64"


@pytest.mark.parametrize(
    ("url_type", "is_string", "type_name"),
    [
        (pa.large_string(), True, "string"),
        (pa.string_view(), True, "string"),
        (pa.binary(), False, "binary (not UTF-8 text)"),
        (pa.int32(), False, "int32"),
    ],
)
def test_parse_file_metadata_string_columns_are_what_pyarrow_reads_as_strings(
    url_type: Any, is_string: bool, type_name: str
) -> None:
    url = parse_file_metadata(footer_of(parquet_bytes(2, url_type=url_type))).columns["URL"]
    assert (url.is_string, url.type_name) == (is_string, type_name)


def test_parse_file_metadata_nested_columns_count_once_at_top_level() -> None:
    import io

    import pyarrow.parquet as pq

    table = pa.table({"meta": [{"a": 1, "b": [1, 2]}], "URL": ["http://x/1.jpg"], "TEXT": ["c"]})
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    schema = parse_file_metadata(footer_of(buffer.getvalue()))
    assert list(schema.columns) == ["meta", "URL", "TEXT"]
    assert schema.columns["meta"].type_name == "a nested group"


def test_read_schema_large_footer_reads_the_schema_with_a_second_get(
    world: AwsWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(parquet_schema, "FIRST_READ", 64)
    put(world, "datasets/a.parquet", parquet_bytes(7, row_group_size=2))
    schema = read_schema(world.s3, DATA_BUCKET, "datasets/a.parquet")
    assert (list(schema.columns), schema.num_rows) == (["URL", "TEXT", "WIDTH", "HEIGHT"], 7)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"URL,TEXT\nhttp://x/1.jpg,a cat\n", "does not end with the parquet marker PAR1"),
        (b"", "too short"),
        (b"PAR1", "too short"),
        (parquet_bytes()[:-1], "does not end with the parquet marker"),
        (parquet_bytes()[:-4] + b"PARE", "encrypted"),
        (b"PAR1" + b"\x00" * 20 + (5000).to_bytes(4, "little") + b"PAR1", "does not fit in the file"),
        (b"PAR1" + b"\xff" * 20 + (20).to_bytes(4, "little") + b"PAR1", "footer"),
    ],
    ids=["csv", "empty", "magic-only", "truncated", "encrypted", "bad-length", "garbage-footer"],
)
def test_read_schema_not_parquet_names_what_was_found(world: AwsWorld, body: bytes, reason: str) -> None:
    put(world, "datasets/x.parquet", body)
    with pytest.raises(NotParquet, match=reason):
        read_schema(world.s3, DATA_BUCKET, "datasets/x.parquet")


def test_check_inputs_no_url_column_suggests_the_column_present(world: AwsWorld) -> None:
    uris = [put(world, f"datasets/p{i}.parquet", parquet_bytes(url_column="url")) for i in range(3)]
    with pytest.raises(InvalidRunDocument) as caught:
        inputs(uris)
    message = problems(caught)["dataset.url_column"]
    assert "column 'URL' is not in 3 of 3 objects" in message
    assert "did you mean 'url'?" in message
    assert "url, TEXT, WIDTH, HEIGHT" in message


def test_check_inputs_url_column_of_numbers_is_invalid(world: AwsWorld) -> None:
    uri = put(world, "datasets/p.parquet", parquet_bytes(url_type=pa.int64()))
    with pytest.raises(InvalidRunDocument) as caught:
        inputs([uri])
    assert "holds int64, not URL strings" in problems(caught)["dataset.url_column"]


def test_check_inputs_missing_caption_column_and_empty_file_are_both_named(world: AwsWorld) -> None:
    uri = put(world, "datasets/p.parquet", parquet_bytes(rows=0))
    with pytest.raises(InvalidRunDocument) as caught:
        inputs([uri], caption_column="caption")
    found = problems(caught)
    assert "column 'caption' is not in the object" in found["dataset.caption_column"]
    assert "the object has no rows" in found["dataset.parquet_uris"]


def test_check_inputs_prefix_with_a_csv_named_parquet_is_invalid(world: AwsWorld) -> None:
    put(world, "datasets/csv/part-0.parquet", b"URL,TEXT\n")
    raw = {"dataset": {"prefix": f"s3://{DATA_BUCKET}/datasets/csv/"}, "base_model_uri": MODEL_URI}
    with pytest.raises(InvalidRunDocument) as caught:
        check_inputs(parse_run_document(raw), data_bucket=DATA_BUCKET, max_shards=50)
    assert "the object is not a parquet file the download job can read" in problems(caught)["dataset.prefix"]


def test_check_inputs_missing_object_is_dataset_not_found_with_field(world: AwsWorld) -> None:
    good = put(world, "datasets/a.parquet", parquet_bytes())
    with pytest.raises(DatasetNotFound) as caught:
        inputs([good, f"s3://{DATA_BUCKET}/datasets/gone.parquet"])
    assert "1 of 2 objects do not exist" in problems(caught)["dataset.parquet_uris"]


def test_check_inputs_bad_files_within_tolerance_are_warnings(world: AwsWorld) -> None:
    uris = [put(world, f"datasets/p{i}.parquet", parquet_bytes()) for i in range(2)]
    uris.append(put(world, "datasets/p2.parquet", parquet_bytes(url_column="link")))

    checked = inputs(uris, tolerated=34)

    assert checked.parquet_uris == uris
    [warning] = checked.warnings
    assert warning["field"] == "dataset.url_column"
    assert "p2.parquet" in warning["message"]


def test_check_inputs_bad_files_beyond_tolerance_name_the_percentage(world: AwsWorld) -> None:
    uris = [put(world, f"datasets/p{i}.parquet", parquet_bytes()) for i in range(2)]
    uris.append(put(world, "datasets/p2.parquet", b"not parquet"))
    with pytest.raises(InvalidRunDocument) as caught:
        inputs(uris, tolerated=10)
    found = problems(caught)
    assert "1 of 3 objects (33.3%) cannot be downloaded" in found["download.tolerated_failure_percent"]
    assert "p2.parquet" in found["dataset.parquet_uris"]


def test_validate_run_config_carries_tolerated_warnings(world: AwsWorld) -> None:
    uris = [put(world, "datasets/a.parquet", parquet_bytes()), put(world, "datasets/b.parquet", b"{}")]
    raw = {
        "dataset": {"parquet_uris": uris},
        "base_model_uri": MODEL_URI,
        "download": {"tolerated_failure_percent": 50},
        "training": {"train_batch_size": 1},  # one global batch of 4 fits the 4 rows: no batch warning
    }
    request = ValidateRunRequest(
        run=raw, execution_name="r-1", execution_arn="arn:x", start_time="2026-01-01T00:00:00Z"
    )

    config = validate_run(request, data_bucket=DATA_BUCKET, max_shards=50)

    assert config["shard_count"] == 2
    assert [w["field"] for w in config["warnings"]] == ["dataset.parquet_uris"]


def test_check_parquet_objects_sums_the_rows_of_the_usable_objects_only(world: AwsWorld) -> None:
    uris = [put(world, "datasets/a.parquet", parquet_bytes(300)), put(world, "datasets/b.parquet", parquet_bytes(20))]
    uris.append(put(world, "datasets/c.parquet", parquet_bytes(50, url_column="link")))  # tolerated, not downloaded

    dataset = parse_run_document({"dataset": {"parquet_uris": uris}, "base_model_uri": MODEL_URI}).dataset
    found = check_parquet_objects(uris, dataset, "dataset.parquet_uris", 50)

    assert found.rows == 320
    assert [w["field"] for w in found.warnings] == ["dataset.url_column"]
