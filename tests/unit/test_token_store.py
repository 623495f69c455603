"""TokenStore: conditional claims in DynamoDB (moto), idempotent per token."""

from __future__ import annotations

import time

import pytest

from sdflow_common.errors import EndpointBusy, TokenConflict
from sdflow_common.token_store import TokenStore
from tests.unit.conftest import TOKEN_TABLE, AwsWorld

TTL = 3600
EXEC_A = "arn:aws:states:us-east-1:123456789012:execution:sdflow:run-a"
EXEC_B = "arn:aws:states:us-east-1:123456789012:execution:sdflow:run-b"


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock(1_750_000_000.0)


@pytest.fixture
def store(mocked_aws: AwsWorld, clock: Clock) -> TokenStore:
    return TokenStore(TOKEN_TABLE, TTL, clock=clock)


def test_claim_free_name_stores_contract_item(store: TokenStore, mocked_aws: AwsWorld, clock: Clock) -> None:
    claim = store.claim("job-1", "token-1", EXEC_A, "download", {"shard_id": "00001"})
    assert claim.new
    item = mocked_aws.ddb.get_item(TableName=TOKEN_TABLE, Key={"resource_name": {"S": "job-1"}})["Item"]
    assert item["task_token"] == {"S": "token-1"}
    assert item["execution_arn"] == {"S": EXEC_A}
    assert item["kind"] == {"S": "download"}
    assert int(item["created_at"]["N"]) == int(clock.now)
    assert int(item["expires_at"]["N"]) == int(clock.now) + TTL
    assert item["context"] == {"M": {"shard_id": {"S": "00001"}}}


def test_claim_same_token_twice_is_not_new(store: TokenStore) -> None:
    store.claim("job-1", "token-1", EXEC_A, "training")
    again = store.claim("job-1", "token-1", EXEC_A, "training")
    assert not again.new
    assert again.record.task_token == "token-1"


def test_claim_other_execution_raises_token_conflict(store: TokenStore) -> None:
    store.claim("job-1", "token-1", EXEC_A, "training")
    with pytest.raises(TokenConflict, match="run-a"):
        store.claim("job-1", "token-2", EXEC_B, "training")
    assert store.get("job-1").task_token == "token-1"  # type: ignore[union-attr]


def test_claim_endpoint_held_by_other_run_raises_endpoint_busy(store: TokenStore) -> None:
    store.claim("sdflow", "token-1", EXEC_A, "endpoint")
    with pytest.raises(EndpointBusy, match="retry later"):
        store.claim("sdflow", "token-2", EXEC_B, "endpoint")


def test_claim_earlier_attempt_of_same_execution_is_taken_over(store: TokenStore) -> None:
    store.claim("sdflow", "token-attempt-0", EXEC_A, "endpoint", {"action": "update"})
    claim = store.claim("sdflow", "token-attempt-1", EXEC_A, "endpoint", {"model_name": "m1"})
    assert claim.new
    held = store.get("sdflow")
    assert held is not None
    assert held.task_token == "token-attempt-1"
    assert held.context == {"model_name": "m1"}


def test_claim_expired_holder_is_replaced(store: TokenStore, clock: Clock) -> None:
    store.claim("sdflow", "token-old", EXEC_A, "endpoint")
    clock.now += TTL + 1
    claim = store.claim("sdflow", "token-new", EXEC_B, "endpoint")
    assert claim.new
    assert store.get("sdflow").execution_arn == EXEC_B  # type: ignore[union-attr]


def test_delete_with_other_token_keeps_the_newer_claim(store: TokenStore) -> None:
    store.claim("job-1", "token-1", EXEC_A, "download")
    assert store.delete("job-1", token="token-stale") is False
    assert store.get("job-1") is not None
    assert store.delete("job-1", token="token-1") is True
    assert store.get("job-1") is None


def test_update_context_merges_keys(store: TokenStore) -> None:
    store.claim("sdflow", "token-1", EXEC_A, "endpoint", {"model_name": "m1"})
    store.update_context("sdflow", "token-1", {"action": "create"})
    assert store.get("sdflow").context == {"model_name": "m1", "action": "create"}  # type: ignore[union-attr]


def test_older_than_returns_only_old_claims(store: TokenStore, clock: Clock) -> None:
    store.claim("old-job", "token-1", EXEC_A, "download")
    clock.now += 2000
    store.claim("young-job", "token-2", EXEC_A, "download")
    clock.now += 100
    assert [record.resource_name for record in store.older_than(1800)] == ["old-job"]
    assert sorted(record.resource_name for record in store.older_than(0)) == ["old-job", "young-job"]


def test_older_than_reads_every_page(store: TokenStore, clock: Clock) -> None:
    for index in range(30):
        store.claim(f"job-{index:02d}", f"token-{index}", EXEC_A, "download")
    clock.now += 10
    found = [record.resource_name for record in store.older_than(5, page_size=7)]
    assert sorted(found) == [f"job-{index:02d}" for index in range(30)]


def test_token_store_without_table_name_raises() -> None:
    with pytest.raises(RuntimeError, match="TOKEN_TABLE"):
        TokenStore("", TTL, clock=time.time)
