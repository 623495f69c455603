"""The download job's row filters (`--filters`, sdflow_image.download.filters) on parquet files built here: each
filter drops its rows, a row failing several counts under the first, a missing value is dropped by its filter,
the counts reach `_SUCCESS`, a filtered-out URL is never fetched, and a file whose every row is filtered out
ends with an empty `_SUCCESS`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from download_fixtures import S3, captions_in_s3, job_args

from sdflow.samples import ImageServer, SampleRow, make_images, make_laion_parquet, write_parquet
from sdflow_image.download import download, filters

pytestmark = pytest.mark.image

NAN = math.nan
# One row that passes every filter of ALL_FILTERS, and the column values that make a row fail each one alone.
PASSING = {"WIDTH": 512, "HEIGHT": 384, "punsafe": 0.01, "pwatermark": 0.1, "aesthetic": 6.0, "similarity": 0.3}
PASSING_CAPTION = "a cat on a mat"
FAILING: dict[str, dict[str, Any]] = {
    "min_width": {"WIDTH": 255},
    "min_height": {"HEIGHT": 255},
    "max_aspect_ratio": {"WIDTH": 1024, "HEIGHT": 256},  # 4:1
    "max_punsafe": {"punsafe": 0.51},
    "max_pwatermark": {"pwatermark": 0.81},
    "min_aesthetic": {"aesthetic": 4.99},
    "min_similarity": {"similarity": 0.27},
    "min_caption_length": {"TEXT": "cat"},
    "max_caption_length": {"TEXT": "c" * 41},
}
BOUNDS: dict[str, float] = {
    "min_width": 256,
    "min_height": 256,
    "max_aspect_ratio": 2.0,
    "max_punsafe": 0.5,
    "max_pwatermark": 0.8,
    "min_aesthetic": 5.0,
    "min_similarity": 0.28,
    "min_caption_length": 5,
    "max_caption_length": 40,
}
COLUMNS = {"min_width": ["WIDTH"], "min_height": ["HEIGHT"], "max_aspect_ratio": ["WIDTH", "HEIGHT"]}
COLUMNS |= {f"max_{name}": [name] for name in ("punsafe", "pwatermark")}
COLUMNS |= {f"min_{name}": [name] for name in ("aesthetic", "similarity")}
COLUMNS |= {name: ["TEXT"] for name in ("min_caption_length", "max_caption_length")}


def flag_values(*names: str) -> list[str]:
    """`--filters` values as the starter passes them: one JSON object per filter."""
    return [json.dumps({name: {"columns": COLUMNS[name], "bound": BOUNDS[name]}}) for name in names]


def row_filters(*names: str) -> list[filters.RowFilter]:
    return filters.resolve([filters.parse_filter(value) for value in flag_values(*names)])


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    """A LAION-style parquet of `rows` (each PASSING with its changes), URL `u<i>`, in the file's own types."""
    full = [
        {"URL": f"http://127.0.0.1:9/u{i}.jpg", "TEXT": PASSING_CAPTION, **PASSING, **row} for i, row in enumerate(rows)
    ]
    schema = pa.schema(
        [("URL", pa.string()), ("TEXT", pa.string()), ("WIDTH", pa.int64()), ("HEIGHT", pa.int32())]
        + [(name, pa.float64()) for name in ("punsafe", "pwatermark", "aesthetic")]
        + [("similarity", pa.float32())]
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(full, schema=schema), path)
    return path


def kept_urls(result: filters.Filtered) -> list[str]:
    return [str(url) for url in pq.read_table(result.parquet)["URL"].to_pylist()]


def test_filter_names_match_run_document_order() -> None:
    from sdflow_common.dataset_filters import CAPTION_FILTERS, FILTER_NAMES

    assert filters.FILTER_NAMES == FILTER_NAMES
    assert filters.CAPTION_FILTERS == CAPTION_FILTERS


@pytest.mark.parametrize("name", list(FAILING))
def test_apply_filters_each_filter_drops_only_its_failing_row(name: str, tmp_path: Path) -> None:
    parquet = write_rows(tmp_path / "in.parquet", [{}, FAILING[name], {}])

    result = filters.apply_filters(parquet, row_filters(*FAILING), tmp_path / "filtered", 3)

    assert kept_urls(result) == ["http://127.0.0.1:9/u0.jpg", "http://127.0.0.1:9/u2.jpg"]
    assert result.filter_drops == {other: int(other == name) for other in FAILING}
    assert result.counts()["rows_to_download"] == 2
    assert result.counts()["rows_read"] == 3


@pytest.mark.parametrize("name", list(FAILING))
def test_apply_filters_bound_itself_is_kept(name: str, tmp_path: Path) -> None:
    # The bounds are inclusive: a value equal to the bound passes.
    at_bound: dict[str, dict[str, Any]] = {
        "min_width": {"WIDTH": 256},
        "min_height": {"HEIGHT": 256},
        "max_aspect_ratio": {"WIDTH": 512, "HEIGHT": 256},
        "max_punsafe": {"punsafe": 0.5},
        "max_pwatermark": {"pwatermark": 0.8},
        "min_aesthetic": {"aesthetic": 5.0},
        "min_similarity": {"similarity": 0.28125},  # float32 holds it exactly; 0.28 it would round below
        "min_caption_length": {"TEXT": "c" * 5},
        "max_caption_length": {"TEXT": "c" * 40},
    }
    bounds = {**BOUNDS, "min_similarity": 0.28125}
    values = [json.dumps({name: {"columns": COLUMNS[name], "bound": bounds[name]}})]
    parquet = write_rows(tmp_path / "in.parquet", [at_bound[name]])

    result = filters.apply_filters(parquet, filters.resolve([filters.parse_filter(values[0])]), tmp_path / "f", 1)

    assert result.filter_drops == {name: 0}
    assert len(kept_urls(result)) == 1


def test_apply_filters_row_failing_several_counts_under_first_in_document_order(tmp_path: Path) -> None:
    rows = [
        {**FAILING["max_punsafe"], **FAILING["min_width"], **FAILING["min_caption_length"]},  # min_width first
        {**FAILING["max_caption_length"], **FAILING["min_aesthetic"]},  # min_aesthetic before the caption
        {**FAILING["max_pwatermark"], **FAILING["max_punsafe"]},  # max_punsafe before max_pwatermark
        {},
    ]
    parquet = write_rows(tmp_path / "in.parquet", rows)
    # Given in another order than the document's: the job applies them in the document's.
    values = flag_values("max_caption_length", "max_pwatermark", "min_aesthetic", "max_punsafe")
    values += flag_values("min_caption_length", "min_width")
    chosen = filters.resolve([filters.parse_filter(value) for value in values])

    result = filters.apply_filters(parquet, chosen, tmp_path / "filtered", 4)

    assert [f.name for f in chosen] == [
        "min_width", "max_punsafe", "max_pwatermark", "min_aesthetic", "min_caption_length", "max_caption_length",
    ]  # fmt: skip
    assert result.filter_drops == {
        "min_width": 1, "max_punsafe": 1, "max_pwatermark": 0, "min_aesthetic": 1,
        "min_caption_length": 0, "max_caption_length": 0,
    }  # fmt: skip
    assert sum(result.filter_drops.values()) == 3  # each dropped row once
    assert kept_urls(result) == ["http://127.0.0.1:9/u3.jpg"]


@pytest.mark.parametrize(
    ("name", "missing"),
    [
        ("min_width", {"WIDTH": None}),
        ("max_aspect_ratio", {"HEIGHT": None}),
        ("max_aspect_ratio", {"HEIGHT": 0}),  # no ratio without a height
        ("max_punsafe", {"punsafe": None}),
        ("max_punsafe", {"punsafe": NAN}),
        ("min_aesthetic", {"aesthetic": NAN}),
        ("min_similarity", {"similarity": None}),
        ("min_caption_length", {"TEXT": None}),
        ("max_caption_length", {"TEXT": None}),
    ],
)
def test_apply_filters_missing_value_dropped_by_that_filter(name: str, missing: dict[str, Any], tmp_path: Path) -> None:
    parquet = write_rows(tmp_path / "in.parquet", [missing, {}])

    result = filters.apply_filters(parquet, row_filters(name), tmp_path / "filtered", 2)

    assert result.filter_drops == {name: 1}
    assert kept_urls(result) == ["http://127.0.0.1:9/u1.jpg"]


def test_apply_filters_unset_filter_keeps_missing_values(tmp_path: Path) -> None:
    # A null in a column no filter reads is no reason to drop a row.
    parquet = write_rows(tmp_path / "in.parquet", [{"punsafe": None, "aesthetic": None}, {"WIDTH": 10}])

    result = filters.apply_filters(parquet, row_filters("min_width"), tmp_path / "filtered", 2)

    assert result.filter_drops == {"min_width": 1}
    assert kept_urls(result) == ["http://127.0.0.1:9/u0.jpg"]


def test_apply_filters_caption_length_counts_characters_not_bytes(tmp_path: Path) -> None:
    # 5 characters, 15 bytes in UTF-8: kept by min_caption_length 5; 41 of them: dropped by max 40.
    parquet = write_rows(tmp_path / "in.parquet", [{"TEXT": "猫猫猫猫猫"}, {"TEXT": "é" * 41}])

    result = filters.apply_filters(parquet, row_filters("min_caption_length", "max_caption_length"), tmp_path / "f", 2)

    assert result.filter_drops == {"min_caption_length": 0, "max_caption_length": 1}
    assert kept_urls(result) == ["http://127.0.0.1:9/u0.jpg"]


def test_apply_filters_batches_count_as_one_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [FAILING[name] if i % 3 == 0 else {} for i, name in enumerate(list(FAILING) * 3)]
    parquet = write_rows(tmp_path / "in.parquet", rows)
    whole = filters.apply_filters(parquet, row_filters(*FAILING), tmp_path / "whole", len(rows))
    monkeypatch.setattr(filters, "BATCH_ROWS", 2)

    batched = filters.apply_filters(parquet, row_filters(*FAILING), tmp_path / "batched", len(rows))

    assert batched.filter_drops == whole.filter_drops
    assert sum(whole.filter_drops.values()) == 9
    assert kept_urls(batched) == kept_urls(whole)
    assert pq.read_table(batched.parquet).schema == pq.read_table(parquet).schema


def test_apply_filters_without_filters_reads_the_parquet_as_is(tmp_path: Path) -> None:
    parquet = write_rows(tmp_path / "in.parquet", [{}, {"WIDTH": None}])

    result = filters.apply_filters(parquet, [], tmp_path / "filtered", 2)

    assert result.parquet == parquet
    assert result.counts() == {"rows_read": 2, "filter_drops": {}, "rows_to_download": 2}
    assert not (tmp_path / "filtered").exists()


def test_apply_filters_missing_column_names_column_filter_and_file(tmp_path: Path) -> None:
    parquet = write_rows(tmp_path / "part-7.parquet", [{}])
    chosen = filters.resolve([filters.parse_filter('{"min_aesthetic": {"columns": ["AESTHETIC"], "bound": 5}}')])

    with pytest.raises(filters.MissingColumn) as caught:
        filters.apply_filters(parquet, chosen, tmp_path / "filtered", 1)

    assert "column 'AESTHETIC' (--filters min_aesthetic) is not in part-7.parquet" in str(caught.value)
    assert "'aesthetic'" in str(caught.value)  # the columns that are there


@pytest.mark.parametrize(("name", "column"), [("min_width", "TEXT"), ("min_caption_length", "WIDTH")])
def test_apply_filters_column_of_wrong_type_names_it(name: str, column: str, tmp_path: Path) -> None:
    parquet = write_rows(tmp_path / "in.parquet", [{}])
    chosen = filters.resolve([filters.parse_filter(json.dumps({name: {"columns": [column], "bound": 5}}))])

    with pytest.raises(filters.ColumnType, match=f"column '{column}' \\(--filters {name}\\) in in.parquet holds"):
        filters.apply_filters(parquet, chosen, tmp_path / "filtered", 1)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("min_width=256", "is not JSON"),
        ("[]", "is not a JSON object of filters"),
        ('{"min_size": {"columns": ["W"], "bound": 1}}', "names the filter 'min_size'; known filters: min_width"),
        ('{"min_width": {"columns": ["W"]}}', 'expected {"columns": [...], "bound": <number>}'),
        ('{"min_width": {"columns": ["W"], "bound": true}}', "must be a finite number"),
        ('{"min_width": {"columns": ["W"], "bound": "256"}}', "must be a finite number"),
        ('{"max_aspect_ratio": {"columns": ["W"], "bound": 2}}', "a list of 2 column name(s)"),
        ('{"min_width": {"columns": "W", "bound": 2}}', "a list of 1 column name(s)"),
    ],
)
def test_download_filters_flag_bad_value_refused_naming_flag(value: str, message: str, tmp_path: Path) -> None:
    argv = job_args(tmp_path, "s3://b/runs/x/", tmp_path / "work", "--filters", value)

    with pytest.raises(download.flags.FlagError) as caught:
        download.parse_args(argv)

    assert "--filters" in str(caught.value)
    assert message in str(caught.value)


def test_download_filters_flag_same_filter_twice_refused(tmp_path: Path) -> None:
    args = download.parse_args(
        job_args(tmp_path, "s3://b/runs/x/", tmp_path / "work", "--filters", *flag_values("min_width", "min_width"))
    )

    with pytest.raises(download.flags.FlagError, match="--filters gives min_width twice"):
        filters.resolve(args.filters)


# --- the job, end to end (moto's S3, the local image server) -------------------------------------------


def served_rows(server: ImageServer, changes: list[dict[str, Any]]) -> list[SampleRow]:
    """One served image per entry of `changes`, its row PASSING's scores with the entry's changes."""
    images = make_images(len(changes), seed=21, formats=("jpeg",), prefix=f"filtered{len(changes)}")
    server.add(images)
    rows = []
    for image, change in zip(images, changes, strict=True):
        values = {**PASSING, **change}
        rows.append(
            SampleRow(
                server.url_for(image.name), image.caption, values["WIDTH"], values["HEIGHT"],
                punsafe=values["punsafe"], pwatermark=values["pwatermark"], aesthetic=values["aesthetic"],
                similarity=values["similarity"],
            )
        )  # fmt: skip
    return rows


@pytest.mark.slow
def test_download_with_filters_fetches_only_kept_rows_and_counts_in_success(
    image_server: ImageServer, download_s3: S3, tmp_path: Path, opt_ml: Path
) -> None:
    changes = [{}, FAILING["max_punsafe"], {"WIDTH": None}, {}, FAILING["max_aspect_ratio"], {"punsafe": 0.9}, {}]
    rows = served_rows(image_server, changes)
    parquet = write_parquet(tmp_path / "in" / "part.parquet", rows)
    uri = download_s3.uri("filtered")
    values = flag_values("min_width", "max_aspect_ratio", "max_punsafe")

    status = download.main(download.parse_args(job_args(parquet, uri, tmp_path / "work", "--filters", *values)))

    assert status == 0, (opt_ml / "output" / "failure").read_text()
    kept = [rows[i] for i in (0, 3, 6)]
    assert captions_in_s3(download_s3, uri) == {row.url: row.caption for row in kept}
    dropped = [row for row in rows if row not in kept]
    # A filtered-out row is never fetched.
    assert all(image_server.hits[row.url.removeprefix(image_server.base_url)] == 0 for row in dropped)
    success = json.loads(download_s3.read(uri, "_SUCCESS"))
    assert success["rows_read"] == 7
    assert success["filter_drops"] == {"min_width": 1, "max_aspect_ratio": 1, "max_punsafe": 2}
    assert success["rows_to_download"] == 3 == success["samples"]
    assert success["options"]["filters"]["max_punsafe"] == {"columns": ["punsafe"], "bound": 0.5}


def test_download_every_row_filtered_out_ends_with_empty_success(
    image_server: ImageServer, download_s3: S3, tmp_path: Path, opt_ml: Path
) -> None:
    rows = served_rows(image_server, [FAILING["min_width"], {"WIDTH": None}, FAILING["max_punsafe"]])
    parquet = write_parquet(tmp_path / "in" / "part.parquet", rows)
    uri = download_s3.uri("all-filtered")
    values = flag_values("min_width", "max_punsafe")

    status = download.main(download.parse_args(job_args(parquet, uri, tmp_path / "work", "--filters", *values)))

    assert status == 0, (opt_ml / "output" / "failure").read_text()
    # No tar; an empty hashes file, so the dedup job counts the shard hashed (0 samples), not unknown.
    assert set(download_s3.names(uri)) == {"_SUCCESS", "hashes.parquet"}
    success = json.loads(download_s3.read(uri, "_SUCCESS"))
    assert (success["rows_read"], success["rows_to_download"], success["hashed_samples"]) == (3, 0, 0)
    assert success["filter_drops"] == {"min_width": 2, "max_punsafe": 1}
    assert (success["samples"], success["failed"], success["tar_files"]) == (0, 0, [])
    assert sum(image_server.hits[row.url.removeprefix(image_server.base_url)] for row in rows) == 0
    assert (opt_ml / "output" / "message").read_text().startswith("ok: 0 samples")


def test_download_filter_column_missing_fails_with_missing_column(
    download_s3: S3, tmp_path: Path, opt_ml: Path
) -> None:
    parquet = write_parquet(tmp_path / "in" / "part.parquet", [SampleRow("http://127.0.0.1:9/a.jpg", "a cat")])
    value = '{"min_aesthetic": {"columns": ["AESTHETIC_SCORE"], "bound": 5}}'
    argv = job_args(parquet, download_s3.uri("no-column"), tmp_path / "work", "--filters", value)

    assert download.main(download.parse_args(argv)) == 1

    failure = (opt_ml / "output" / "failure").read_text()
    assert failure.startswith(
        "MissingColumn: column 'AESTHETIC_SCORE' (--filters min_aesthetic) is not in part.parquet"
    )
    assert "_SUCCESS" not in download_s3.names(download_s3.uri("no-column"))


def test_demo_filters_drop_some_of_the_demo_rows_before_download(image_server: ImageServer, tmp_path: Path) -> None:
    # The demo's run document through the same path as a run: the layer's job arguments, the job's filters.
    from sdflow.demo import DEMO_FILTERS, DemoOptions
    from sdflow_common.dataset_filters import DatasetFilters

    options = DemoOptions()
    values = DatasetFilters.model_validate(DEMO_FILTERS).job_arguments("TEXT")
    chosen = filters.resolve([filters.parse_filter(value) for value in values])
    read = dropped = 0
    for shard in range(options.shards):
        sample = make_laion_parquet(
            tmp_path / f"part-{shard:05d}.parquet", image_server, good=options.images_per_shard,
            missing=options.broken_per_shard, seed=shard, min_size=64, max_size=64,
        )  # fmt: skip
        result = filters.apply_filters(sample.path, chosen, tmp_path / f"filtered-{shard}", len(sample.rows))
        read += result.rows_read
        dropped += sum(result.filter_drops.values())
        assert set(result.filter_drops) == set(DEMO_FILTERS)
        assert 0 < sum(result.filter_drops.values()) < 0.15 * result.rows_read

    assert (read, dropped) == (306, 27)  # the README's figure
