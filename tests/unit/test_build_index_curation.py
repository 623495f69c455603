"""build_index with the curation counts (issue 33): each stage's count per shard and for the run from
the download job's _SUCCESS fields and the dedup job's summary.json; unknown counts stay null; a run
whose filters or duplicates left nothing to train on is refused naming them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sdflow_common.build_index import BuildIndexRequest, build_index
from sdflow_common.curation import DedupSummaryMissing
from sdflow_common.errors import NoUsableShards
from sdflow_common.validate_run import RunConfig
from tests.unit.helpers import DATA_BUCKET, AwsWorld
from tests.unit.index_world import RUN_ID, finish_shard, index_of, make_config, manifest_of

DEDUP_URI = f"s3://{DATA_BUCKET}/runs/{RUN_ID}/dataset/dedup/summary.json"


def filtered_counts(read: int, drops: dict[str, int], failed: int = 2) -> dict[str, Any]:
    """The filters' and hashes' `_SUCCESS` fields of a shard downloaded since issue 33."""
    to_download = read - sum(drops.values())
    return {
        "rows_read": read, "filter_drops": drops, "rows_to_download": to_download,
        "failed_to_download": failed, "failed_to_resize": 0, "hashes_file": "hashes.parquet",
        "hashed_samples": to_download - failed,
    }  # fmt: skip


def put_dedup_summary(world: AwsWorld, shards: dict[str, tuple[int, int]], unhashed: list[str] | None = None) -> None:
    """The dedup job's summary.json: shard id -> (url duplicates, image duplicates)."""
    entries = {
        shard: {"url_duplicates": url, "image_duplicates": image,
                "dropped_file": f"dropped/{shard}.json" if url + image else None}
        for shard, (url, image) in shards.items()
    }  # fmt: skip
    world.put_json(
        f"runs/{RUN_ID}/dataset/dedup/summary.json",
        {
            "version": 1, "partitions": 64, "shards": entries,
            "url_duplicates": sum(u for u, _ in shards.values()),
            "image_duplicates": sum(i for _, i in shards.values()),
            "hashed_samples": 0, "unhashed_shards": unhashed or [], "duration_s": 1.0, "peak_rss_mb": 50,
        },
    )  # fmt: skip


def request_with_dedup(config: RunConfig) -> BuildIndexRequest:
    return BuildIndexRequest.model_validate(
        {"config": config.model_dump(mode="json"), "dedup": {"summary_uri": DEDUP_URI, "job_name": "sdf-dd-x"}}
    )


def test_build_index_fresh_shards_with_dedup_count_every_stage(mocked_aws: AwsWorld) -> None:
    config = make_config(mocked_aws, 2)
    finish_shard(mocked_aws, "00000", samples=10, counts=filtered_counts(20, {"min_width": 5, "max_punsafe": 3}))
    finish_shard(mocked_aws, "00001", samples=8, counts=filtered_counts(12, {"max_punsafe": 1, "min_width": 1}))
    put_dedup_summary(mocked_aws, {"00000": (2, 1), "00001": (0, 0)})

    summary = build_index(request_with_dedup(config))

    index = index_of(mocked_aws)
    first, second = index["shards"]
    assert first["counts"] == {
        "rows_read": 20, "filter_drops": {"min_width": 5, "max_punsafe": 3}, "rows_to_download": 12,
        "failed_to_download": 2, "failed_to_resize": 0, "holdout": 0, "url_duplicates": 2, "image_duplicates": 1,
        "kept": 7,
    }  # fmt: skip
    assert (first["samples"], second["samples"], index["total_samples"]) == (7, 8, 15)
    assert first["dropped_file"] == f"{RUN_ID}/dataset/dedup/dropped/00000.json"
    assert "dropped_file" not in second
    # The filters in their order (§1 of the run document's filters), whatever order a marker wrote.
    assert list(second["counts"]["filter_drops"]) == ["min_width", "max_punsafe"]
    assert index["curation"] == {
        "rows_read": 32, "filter_drops": {"min_width": 6, "max_punsafe": 4}, "rows_to_download": 22,
        "failed_to_download": 4, "failed_to_resize": 0, "holdout": 0, "url_duplicates": 2, "image_duplicates": 1,
        "kept": 15, "filters": {}, "deduplicated": True, "unhashed_shards": 0,
    }  # fmt: skip
    assert summary["total_samples"] == 15
    assert summary["curation"] == {k: v for k, v in index["curation"].items() if k != "filters"}
    assert f"{RUN_ID}/dataset/dedup/dropped/00000.json" in manifest_of(mocked_aws)
    assert len(json.dumps(summary["curation"])) < 600  # $.dataset stays small


def test_build_index_older_cache_without_counts_keeps_them_unknown(mocked_aws: AwsWorld) -> None:
    """A reused shard downloaded before the filters and hashes: its counts are unknown, and so are the
    totals that need them; its duplicates unknown (not hashed), never 0."""
    config = make_config(mocked_aws, 2)
    finish_shard(mocked_aws, "00000", samples=10, counts=filtered_counts(12, {"min_width": 0}))
    finish_shard(mocked_aws, "00001", samples=6)  # no rows_read, no hashes_file
    put_dedup_summary(mocked_aws, {"00000": (1, 0)}, unhashed=["00001"])

    build_index(request_with_dedup(config))

    index = index_of(mocked_aws)
    old = index["shards"][1]["counts"]
    assert (old["rows_read"], old["filter_drops"], old["url_duplicates"]) == (None, None, None)
    assert old["kept"] == 6
    totals = index["curation"]
    assert (totals["rows_read"], totals["filter_drops"], totals["url_duplicates"]) == (None, None, None)
    assert (totals["kept"], totals["unhashed_shards"], index["total_samples"]) == (15, 1, 15)


def test_build_index_shard_without_hashes_unlisted_by_summary_counts_unhashed(mocked_aws: AwsWorld) -> None:
    """The run's count of shards without hashes is the count of shards whose duplicates are unknown, also for
    one the summary does not list: the figure explains the unknown total, never "unknown: 0 shards"."""
    config = make_config(mocked_aws, 2)
    finish_shard(mocked_aws, "00000", samples=10, counts=filtered_counts(12, {"min_width": 0}))
    finish_shard(mocked_aws, "00001", samples=6)  # no hashes_file, and the summary names it nowhere
    put_dedup_summary(mocked_aws, {"00000": (1, 0)})

    build_index(request_with_dedup(config))

    totals = index_of(mocked_aws)["curation"]
    assert (totals["url_duplicates"], totals["unhashed_shards"]) == (None, 1)


def test_build_index_dedup_summary_missing_raises_naming_it(mocked_aws: AwsWorld) -> None:
    config = make_config(mocked_aws, 1)
    finish_shard(mocked_aws, "00000", samples=4, counts=filtered_counts(6, {}))

    with pytest.raises(DedupSummaryMissing, match=r"completed without writing its summary .*dedup/summary\.json"):
        build_index(request_with_dedup(config))


def test_build_index_dedup_summary_not_json_raises(mocked_aws: AwsWorld) -> None:
    config = make_config(mocked_aws, 1)
    finish_shard(mocked_aws, "00000", samples=4)
    mocked_aws.s3.put_object(Bucket=DATA_BUCKET, Key=f"runs/{RUN_ID}/dataset/dedup/summary.json", Body=b"[1]")

    with pytest.raises(DedupSummaryMissing, match="is not a summary"):
        build_index(request_with_dedup(config))


def test_build_index_request_dedup_without_s3_uri_is_refused() -> None:
    with pytest.raises(ValueError, match=r"dedup\.summary_uri"):
        BuildIndexRequest.model_validate({"config": {}, "dedup": {"summary_uri": "summary.json"}})


def test_build_index_every_row_filtered_raise_naming_the_filters(mocked_aws: AwsWorld) -> None:
    config = make_config(mocked_aws, 2)
    finish_shard(
        mocked_aws, "00000", samples=0, tars=0, counts=filtered_counts(10, {"min_width": 7, "max_punsafe": 3}, 0)
    )
    finish_shard(
        mocked_aws, "00001", samples=0, tars=0, counts=filtered_counts(5, {"min_width": 5, "max_punsafe": 0}, 0)
    )

    with pytest.raises(NoUsableShards) as caught:
        build_index(BuildIndexRequest(config=config))

    message = str(caught.value)
    assert (
        "dataset.filters dropped every one of the 15 rows read (min_width dropped 12, max_punsafe dropped 3)" in message
    )
    assert "loosen or remove those filters in dataset.filters (min_width, max_punsafe)" in message
    assert "reachable" not in message
    assert index_of(mocked_aws)["curation"]["kept"] == 0  # the record of why is written before the refusal


def test_build_index_every_sample_a_duplicate_raise_naming_dedup(mocked_aws: AwsWorld) -> None:
    config = make_config(mocked_aws, 1)
    finish_shard(mocked_aws, "00000", samples=3, counts=filtered_counts(5, {}))
    put_dedup_summary(mocked_aws, {"00000": (1, 2)})

    with pytest.raises(NoUsableShards, match="3 downloaded training samples were all duplicates"):
        build_index(request_with_dedup(config))


def test_build_index_some_filtered_rest_unreachable_raise_naming_urls_and_filters(mocked_aws: AwsWorld) -> None:
    config = make_config(mocked_aws, 1)
    finish_shard(mocked_aws, "00000", samples=0, tars=0, counts=filtered_counts(10, {"min_width": 4}, failed=6))

    with pytest.raises(NoUsableShards, match=r"no image URL could be fetched \(dataset.filters dropped 4 rows first\)"):
        build_index(BuildIndexRequest(config=config))
