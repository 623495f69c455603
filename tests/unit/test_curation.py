"""What was kept and why (sdflow_common.curation): a shard's counts from its `_SUCCESS` and the dedup
summary, the run's totals, and the funnel as the notification and `sdflow status` word it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sdflow import progress
from sdflow_common import curation, notify
from tests.constants import ACCOUNT, REGION

ARN = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:sdflow-pipeline-test:cats-v1"
FRESH = {
    "samples": 780, "failed": 40, "failed_to_download": 35, "failed_to_resize": 5, "holdout_samples": 20,
    "rows_read": 1000, "filter_drops": {"max_punsafe": 40, "min_width": 120}, "rows_to_download": 840,
    "hashes_file": "hashes.parquet", "hashed_samples": 800,
}  # fmt: skip
OLD = {"samples": 50, "failed": 2, "failed_to_download": 2, "failed_to_resize": 0}
SUMMARY = {
    "version": 1,
    "shards": {"00000": {"url_duplicates": 8, "image_duplicates": 4, "dropped_file": "dropped/00000.json"}},
    "unhashed_shards": ["00001"],
}
TOTALS = {
    "rows_read": 1000, "filter_drops": {"min_width": 120, "max_punsafe": 40}, "rows_to_download": 840,
    "failed_to_download": 35, "failed_to_resize": 5, "holdout": 20, "url_duplicates": 8, "image_duplicates": 4,
    "kept": 768, "deduplicated": True, "unhashed_shards": 0,
}  # fmt: skip
FILTERS = {"min_width": 256, "max_punsafe": 0.1, "columns": {"width": "WIDTH"}}


def test_shard_counts_fresh_shard_with_dedup_counts_every_stage() -> None:
    counts = curation.shard_counts(FRESH, SUMMARY, "00000")

    assert counts == {
        "rows_read": 1000, "filter_drops": {"min_width": 120, "max_punsafe": 40}, "rows_to_download": 840,
        "failed_to_download": 35, "failed_to_resize": 5, "holdout": 20, "url_duplicates": 8, "image_duplicates": 4,
        "kept": 768,
    }  # fmt: skip
    assert list(counts["filter_drops"]) == ["min_width", "max_punsafe"]  # the filters' order, not the marker's


def test_shard_counts_hashed_shard_the_summary_does_not_list_has_no_duplicates() -> None:
    counts = curation.shard_counts(FRESH | {"shard_id": "00002"}, SUMMARY, "00002")

    assert (counts["url_duplicates"], counts["image_duplicates"], counts["kept"]) == (0, 0, 780)


def test_shard_counts_older_cache_without_fields_stays_unknown_not_zero() -> None:
    counts = curation.shard_counts(OLD, SUMMARY, "00001")

    assert (counts["rows_read"], counts["filter_drops"], counts["rows_to_download"]) == (None, None, None)
    assert (counts["url_duplicates"], counts["image_duplicates"]) == (None, None)  # unhashed: not deduplicated
    assert (counts["holdout"], counts["kept"]) == (0, 50)  # before the split: none held out


def test_shard_counts_without_dedup_leave_duplicates_unknown() -> None:
    counts = curation.shard_counts(FRESH, None, "00000")

    assert (counts["url_duplicates"], counts["image_duplicates"], counts["kept"]) == (None, None, 780)


def test_shard_counts_malformed_filter_drops_are_unknown() -> None:
    assert curation.shard_counts(FRESH | {"filter_drops": {"min_width": -1}}, None, "0")["filter_drops"] is None
    assert curation.shard_counts(FRESH | {"rows_read": "1000"}, None, "0")["rows_read"] is None


def test_sum_counts_one_unknown_shard_makes_the_total_unknown() -> None:
    fresh = curation.shard_counts(FRESH, SUMMARY, "00000")
    old = curation.shard_counts(OLD, SUMMARY, "00001")

    total = curation.sum_counts([fresh, fresh, old])

    assert total["rows_read"] is None
    assert total["filter_drops"] is None
    assert total["failed_to_download"] == 72
    assert total["kept"] == 768 * 2 + 50
    assert curation.sum_counts([fresh, fresh])["filter_drops"] == {"min_width": 240, "max_punsafe": 80}


def test_data_lines_read_as_a_funnel_with_shares_of_rows_read() -> None:
    assert curation.data_lines(TOTALS, FILTERS) == [
        "1,000 rows read",
        "160 filtered (16.0%): 120 by min_width=256, 40 by max_punsafe=0.1",
        "40 failed (4.0%): 35 to download, 5 to resize",
        "20 held out for evaluation (2.0%)",
        "12 duplicates (1.2%): 8 url, 4 image",
        "768 kept for training (76.8%)",
    ]


def test_data_lines_unknown_counts_say_so_instead_of_zero() -> None:
    old = TOTALS | {"rows_read": None, "filter_drops": None, "url_duplicates": None, "holdout": 0}

    lines = curation.data_lines(old | {"deduplicated": False})

    assert lines[0] == "rows read unknown (shards from before the counts)"
    assert "duplicates not checked (deduplication off)" in lines
    assert lines[-1] == "768 kept for training"  # no share of an unknown total
    unhashed = curation.data_lines(old | {"unhashed_shards": 3})
    assert "duplicates unknown (3 shards without hashes)" in unhashed


def test_metadata_text_counts_first_then_each_filter() -> None:
    assert curation.metadata_text(TOTALS) == (
        "read=1000 filtered=160 failed=40 holdout=20 url_dup=8 image_dup=4 kept=768 min_width=120 max_punsafe=40"
    )
    assert "url_dup=unchecked" in curation.metadata_text(TOTALS | {"deduplicated": False})
    assert curation.metadata_text(None) == ""


def _compose(state: dict[str, Any]) -> str:
    request = notify.NotifyRequest(
        outcome="succeeded",
        execution_arn=ARN,
        execution_name="cats-v1",
        start_time="2026-11-22T10:00:00.000Z",
        stop_time="2026-11-22T10:30:00.000Z",
        state=state,
    )
    return notify.compose(request, now=datetime(2026, 11, 23, tzinfo=UTC)).message


def test_notify_data_lines_show_each_stage_under_the_dataset_line() -> None:
    dataset = {
        "index_uri": "s3://b/i.json", "total_samples": 768, "shards_ok": 2, "shards_empty": 1, "shards_failed": 0,
        "curation": TOTALS,
    }  # fmt: skip
    config = {"run_id": "cats-v1-abc", "run": {"run_name": "cats-v1", "dataset": {"filters": FILTERS}}}

    text = _compose({"config": config, "dataset": dataset})

    print(text)  # read as a user: pytest -s shows the message
    start = text.index("Dataset:")
    assert text[start:].splitlines()[:7] == [
        "Dataset:   1 of 2 shards downloaded, 768 samples; 1 held nothing to train on",
        "Data:      1,000 rows read",
        "           → 160 filtered (16.0%): 120 by min_width=256, 40 by max_punsafe=0.1",
        "           → 40 failed (4.0%): 35 to download, 5 to resize",
        "           → 20 held out for evaluation (2.0%)",
        "           → 12 duplicates (1.2%): 8 url, 4 image",
        "           → 768 kept for training (76.8%)",
    ]


def test_status_shows_the_data_funnel_from_the_index() -> None:
    snap = progress.Progress(execution_arn=ARN, status="SUCCEEDED", states={"Build dataset index": "succeeded"})
    snap.curation = TOTALS | {"filters": FILTERS}

    lines = progress.render_lines(snap)

    print("\n".join(lines))
    assert lines[2:] == [
        "  data: 1,000 rows read",
        "        → 160 filtered (16.0%): 120 by min_width=256, 40 by max_punsafe=0.1",
        "        → 40 failed (4.0%): 35 to download, 5 to resize",
        "        → 20 held out for evaluation (2.0%)",
        "        → 12 duplicates (1.2%): 8 url, 4 image",
        "        → 768 kept for training (76.8%)",
    ]


def test_nothing_kept_reason_every_sample_held_out_names_the_holdout() -> None:
    counts = TOTALS | {"filter_drops": {}, "url_duplicates": 0, "image_duplicates": 0, "holdout": 5, "kept": 0}

    reason = curation.nothing_kept_reason(1, 1, counts)

    assert "the 5 samples that downloaded were all held out for the evaluation" in reason
    assert "evaluation.holdout_samples" in reason
    assert "reachable" not in reason
