"""SageMaker resource names: valid, ≤ 63 characters, deterministic, distinct per run/item/attempt."""

from __future__ import annotations

import pytest

from sdflow_common import names
from sdflow_common.names import NAME_PATTERN, InvalidNameInput

ARN = "arn:aws:states:us-east-1:123456789012:execution:sdflow-pipeline:{}"
LONG_RUN_ID = "a-very-long-run-name-that-goes-on-and-on-" + "x" * 38  # 80 characters, SFN's maximum


def assert_valid(name: str) -> None:
    assert len(name) <= names.MAX_NAME_LENGTH, name
    assert NAME_PATTERN.match(name), name


@pytest.mark.parametrize("run_id", ["demo", LONG_RUN_ID, "Run_With.Odd--chars__", "___"])
@pytest.mark.parametrize("attempt", [0, 7, 123])
def test_download_job_name_any_run_id_is_valid_sagemaker_name(run_id: str, attempt: int) -> None:
    name = names.download_job_name(ARN.format(run_id), run_id, "00042", attempt)
    assert_valid(name)
    assert name.startswith("sdf-dl-")
    assert name.endswith(f"-00042-a{attempt}")


def test_download_job_name_same_inputs_same_name() -> None:
    first = names.download_job_name(ARN.format("demo"), "demo", "00001", 0)
    assert first == names.download_job_name(ARN.format("demo"), "demo", "00001", 0)


def test_download_job_name_retry_attempt_changes_name() -> None:
    attempts = {names.download_job_name(ARN.format("demo"), "demo", "00001", n) for n in range(5)}
    assert len(attempts) == 5


def test_download_job_name_differs_per_shard_and_per_execution() -> None:
    base = names.download_job_name(ARN.format("demo"), "demo", "00001", 0)
    assert base != names.download_job_name(ARN.format("demo"), "demo", "00002", 0)
    assert base != names.download_job_name(ARN.format("demo-2"), "demo", "00001", 0)


def test_download_job_name_runs_sharing_a_truncated_prefix_still_differ() -> None:
    # Both run ids are cut to the same readable slug; only the hash can tell them apart.
    run_a, run_b = LONG_RUN_ID + "-a", LONG_RUN_ID + "-b"
    name_a = names.download_job_name(ARN.format(run_a), run_a, "00001", 0)
    name_b = names.download_job_name(ARN.format(run_b), run_b, "00001", 0)
    assert_valid(name_a)
    assert name_a != name_b


def test_training_job_name_is_valid_and_distinct_per_attempt() -> None:
    first = names.training_job_name(ARN.format(LONG_RUN_ID), LONG_RUN_ID, 0)
    retry = names.training_job_name(ARN.format(LONG_RUN_ID), LONG_RUN_ID, 1)
    assert_valid(first)
    assert_valid(retry)
    assert first.startswith("sdf-tr-a-very-long")
    assert first != retry


def test_deployment_name_longest_endpoint_name_fits() -> None:
    endpoint = "E" * 48  # EndpointOptions.name allows 48 characters
    name = names.deployment_name(endpoint, ARN.format("demo"), 99)
    assert_valid(name)
    assert name.startswith("e" * 20)
    assert name.endswith("-a99")


def test_deployment_name_differs_per_execution_and_attempt() -> None:
    base = names.deployment_name("sdflow", ARN.format("one"), 0)
    assert base != names.deployment_name("sdflow", ARN.format("two"), 0)
    assert base != names.deployment_name("sdflow", ARN.format("one"), 1)


def test_names_negative_attempt_raises() -> None:
    with pytest.raises(InvalidNameInput, match="RetryCount"):
        names.training_job_name(ARN.format("demo"), "demo", -1)


def test_download_job_name_shard_without_alphanumerics_raises() -> None:
    with pytest.raises(InvalidNameInput, match="shard_id"):
        names.download_job_name(ARN.format("demo"), "demo", "--", 0)


def test_training_job_glob_matches_every_attempt_of_its_execution_only() -> None:
    import fnmatch

    execution = "arn:aws:states:us-east-1:123456789012:execution:sdflow-pipeline:" + "r" * 80
    other = "arn:aws:states:us-east-1:123456789012:execution:sdflow-pipeline:other"
    pattern = names.training_job_glob(execution)
    for attempt in (0, 9, 10, 123):
        assert fnmatch.fnmatchcase(names.training_job_name(execution, "r" * 80, attempt), pattern)
    assert not fnmatch.fnmatchcase(names.training_job_name(other, "r" * 80, 0), pattern)
