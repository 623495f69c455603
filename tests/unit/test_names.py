"""SageMaker resource names: valid, ≤ 63 characters, deterministic, distinct per run/item/redrive/attempt."""

from __future__ import annotations

import fnmatch
from datetime import UTC, datetime, timedelta, timezone

import pytest

from sdflow_common import names
from sdflow_common.names import NAME_PATTERN, InvalidNameInput

ARN = "arn:aws:states:us-east-1:123456789012:execution:sdflow-pipeline:{}"
START = "2026-11-23T16:48:03.123Z"
LONG_RUN_ID = "a-very-long-run-name-that-goes-on-and-on-" + "x" * 38  # 80 characters, SFN's maximum
HASH = names.run_hash(ARN.format("demo"), START)


def assert_valid(name: str) -> None:
    assert len(name) <= names.MAX_NAME_LENGTH, name
    assert NAME_PATTERN.match(name), name


# ---------------------------------------------------------------------------- run identity


@pytest.mark.parametrize(
    "spelling",
    [
        "2026-11-23T16:48:03.123Z",  # $$.Execution.StartTime
        "2026-11-23T16:48:03.123+00:00",
        "2026-11-23T17:48:03.123456+01:00",  # another offset, more precision: floor to the ms
        "2026-11-23T16:48:03.123999999Z",  # nanoseconds
        "2026-11-23T16:48:03.123",  # no offset = UTC
        1795452483123,  # EventBridge startDate (epoch ms)
        1795452483123.9,
        datetime(2026, 11, 23, 16, 48, 3, 123456, tzinfo=UTC),  # DescribeExecution startDate
        datetime(2026, 11, 23, 18, 48, 3, 123000, tzinfo=timezone(timedelta(hours=2))),
    ],
)
def test_start_millis_every_spelling_of_one_instant_agrees(spelling: str | int | float | datetime) -> None:
    assert names.start_millis(spelling) == 1795452483123


@pytest.mark.parametrize("bad", ["yesterday", "", "2026-13-40T00:00:00Z", True, None, float("nan")])
def test_start_millis_unreadable_time_raises_naming_the_source(bad: object) -> None:
    with pytest.raises(InvalidNameInput, match="start_time"):
        names.start_millis(bad)  # type: ignore[arg-type]


def test_run_hash_same_for_redrives_and_spellings_differs_for_reused_execution_name() -> None:
    arn = ARN.format("demo")
    assert names.run_hash(arn, START) == names.run_hash(arn, 1795452483123)
    assert len(names.run_hash(arn, START)) == names.HASH_LENGTH
    # Step Functions allows the name again 90 days later: same ARN, another start time.
    assert names.run_hash(arn, START) != names.run_hash(arn, "2027-02-21T16:48:03.123Z")
    assert names.run_hash(arn, START) != names.run_hash(ARN.format("demo-2"), START)


def test_run_hash_empty_execution_arn_raises() -> None:
    with pytest.raises(InvalidNameInput, match="execution_arn"):
        names.run_hash("", START)


# ---------------------------------------------------------------------------- names


@pytest.mark.parametrize("run_id", ["demo", LONG_RUN_ID, "Run_With.Odd--chars__", "___"])
@pytest.mark.parametrize(("redrive", "attempt"), [(0, 0), (3, 7), (1000, 123), (12345, 99999999)])
def test_download_job_name_any_run_id_is_valid_and_contains_the_run_hash(
    run_id: str, redrive: int, attempt: int
) -> None:
    name = names.download_job_name(HASH, run_id, "00042", redrive, attempt)
    assert_valid(name)
    assert name.startswith("sdf-dl-")
    assert f"-{HASH}-00042-r{redrive}-a{attempt}" in name
    assert name.endswith(f"-00042-r{redrive}-a{attempt}")


def test_download_job_name_same_inputs_same_name() -> None:
    assert names.download_job_name(HASH, "demo", "00001", 0, 0) == names.download_job_name(HASH, "demo", "00001", 0, 0)


def test_download_job_name_attempt_redrive_shard_and_run_each_change_the_name() -> None:
    base = names.download_job_name(HASH, "demo", "00001", 0, 0)
    others = {
        names.download_job_name(HASH, "demo", "00001", 0, 1),
        names.download_job_name(HASH, "demo", "00001", 1, 0),
        names.download_job_name(HASH, "demo", "00002", 0, 0),
        names.download_job_name(names.run_hash(ARN.format("demo"), "2027-01-01T00:00:00Z"), "demo", "00001", 0, 0),
    }
    assert base not in others
    assert len(others) == 4


def test_download_job_name_readable_part_is_cut_the_same_for_every_attempt() -> None:
    # Attempt 9 and attempt 10 differ in width; the slug must not, or NameContains of the
    # task's key would still work but a human could not line the attempts up.
    slugs = {names.download_job_name(HASH, LONG_RUN_ID, "00001", 0, n).split(f"-{HASH}-")[0] for n in (0, 9, 10, 999)}
    assert len(slugs) == 1


def test_training_job_name_is_valid_and_distinct_per_attempt_and_redrive() -> None:
    first = names.training_job_name(HASH, LONG_RUN_ID, 0, 0)
    assert_valid(first)
    assert first.startswith("sdf-tr-a-very-long")
    assert first.endswith(f"-{HASH}-r0-a0")
    assert first != names.training_job_name(HASH, LONG_RUN_ID, 0, 1)
    assert first != names.training_job_name(HASH, LONG_RUN_ID, 1, 0)


def test_deployment_name_longest_endpoint_name_fits() -> None:
    endpoint = "E" * 48  # EndpointOptions.name allows 48 characters
    name = names.deployment_name(endpoint, HASH, 1000, 99)
    assert_valid(name)
    assert name.startswith("e" * 20)
    assert name.endswith(f"-{HASH}-r1000-a99")


def test_deployment_name_differs_per_run_redrive_and_attempt() -> None:
    base = names.deployment_name("sdflow", HASH, 0, 0)
    other_run = names.run_hash(ARN.format("two"), START)
    assert base not in {
        names.deployment_name("sdflow", other_run, 0, 0),
        names.deployment_name("sdflow", HASH, 0, 1),
        names.deployment_name("sdflow", HASH, 1, 0),
    }


@pytest.mark.parametrize(("redrive", "attempt", "source"), [(0, -1, "RetryCount"), (-1, 0, "RedriveCount")])
def test_names_negative_counter_raises_naming_its_source(redrive: int, attempt: int, source: str) -> None:
    with pytest.raises(InvalidNameInput, match=source):
        names.training_job_name(HASH, "demo", redrive, attempt)


def test_download_job_name_shard_without_alphanumerics_raises() -> None:
    with pytest.raises(InvalidNameInput, match="shard_id"):
        names.download_job_name(HASH, "demo", "--", 0, 0)


# ---------------------------------------------------------------------------- lookups


def test_attempt_of_reads_the_attempt_counter_at_the_end_of_the_name() -> None:
    assert names.attempt_of(names.download_job_name(HASH, LONG_RUN_ID, "00001", 2, 10)) == 10
    assert names.attempt_of("someone-elses-job") is None


def test_counters_of_and_task_key_read_redrive_attempt_and_the_task_they_count() -> None:
    long = names.evaluation_job_name(HASH, LONG_RUN_ID, 7, 123)
    assert names.counters_of(long) == (7, 123)
    # The key is the same for every redrive and attempt of one task (the slug is cut the same)...
    assert names.task_key(long) == names.task_key(names.evaluation_job_name(HASH, LONG_RUN_ID, 0, 0))
    # ...and differs for another kind of job of the same run or another run.
    assert names.task_key(long) != names.task_key(names.training_job_name(HASH, LONG_RUN_ID, 7, 123))
    assert names.task_key(long) != names.task_key(names.evaluation_job_name("0" * 10, LONG_RUN_ID, 7, 123))
    assert names.counters_of("someone-elses-job") is None
    assert names.task_key("someone-elses-job-a1") is None


def test_training_job_glob_matches_every_attempt_and_redrive_of_its_run_only() -> None:
    execution = ARN.format("r" * 80)
    pattern = names.training_job_glob(execution, START)
    run = names.run_hash(execution, START)
    for redrive, attempt in ((0, 0), (0, 9), (1, 10), (1000, 123)):
        assert fnmatch.fnmatchcase(names.training_job_name(run, "r" * 80, redrive, attempt), pattern)
    reused = names.run_hash(execution, "2027-02-21T16:48:03.123Z")
    assert not fnmatch.fnmatchcase(names.training_job_name(reused, "r" * 80, 0, 0), pattern)


def test_download_job_key_is_in_every_attempt_of_its_shard_and_no_other_shard() -> None:
    run_hash = names.run_hash("arn:aws:states:us-east-1:123456789012:execution:p:run", 1_700_000_000_000)
    key = names.download_job_key(run_hash, "00007")

    for redrive, attempt in ((0, 0), (3, 12)):
        assert key in names.download_job_name(run_hash, "run", "00007", redrive, attempt)
    assert key not in names.download_job_name(run_hash, "run", "00071", 0, 0)
