"""TokenStore: conditional claims in DynamoDB (moto), idempotent per token."""

from __future__ import annotations

import time

import pytest

from sdflow_common.errors import EndpointBusy, TokenConflict
from sdflow_common.token_store import TokenStore
from tests.unit.helpers import TOKEN_TABLE, AwsWorld

TIMEOUT = 3600  # the task's TimeoutSeconds
SLACK = 86_400
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
    return TokenStore(TOKEN_TABLE, clock=clock)


def test_claim_free_name_stores_contract_item(store: TokenStore, mocked_aws: AwsWorld, clock: Clock) -> None:
    claim = store.claim("job-1", "token-1", EXEC_A, "download", {"shard_id": "00001"}, timeout_seconds=TIMEOUT)
    assert claim.new
    item = mocked_aws.ddb.get_item(TableName=TOKEN_TABLE, Key={"resource_name": {"S": "job-1"}})["Item"]
    assert item["task_token"] == {"S": "token-1"}
    assert item["execution_arn"] == {"S": EXEC_A}
    assert item["kind"] == {"S": "download"}
    assert int(item["created_at"]["N"]) == int(clock.now)
    assert int(item["deadline"]["N"]) == int(clock.now) + TIMEOUT
    # The TTL follows the task's own timeout (up to 28 days for training), plus a day.
    assert int(item["expires_at"]["N"]) == int(clock.now) + TIMEOUT + SLACK
    assert item["context"] == {"M": {"shard_id": {"S": "00001"}}}


def test_claim_same_token_twice_is_not_new(store: TokenStore) -> None:
    store.claim("job-1", "token-1", EXEC_A, "training", timeout_seconds=TIMEOUT)
    again = store.claim("job-1", "token-1", EXEC_A, "training", timeout_seconds=TIMEOUT)
    assert not again.new
    assert again.record.task_token == "token-1"


def test_claim_other_execution_raises_token_conflict(store: TokenStore) -> None:
    store.claim("job-1", "token-1", EXEC_A, "training", timeout_seconds=TIMEOUT)
    with pytest.raises(TokenConflict, match="run-a"):
        store.claim("job-1", "token-2", EXEC_B, "training", timeout_seconds=TIMEOUT)
    assert store.get("job-1").task_token == "token-1"  # type: ignore[union-attr]


def test_claim_endpoint_held_by_other_run_raises_endpoint_busy(store: TokenStore) -> None:
    store.claim("sdflow", "token-1", EXEC_A, "endpoint", timeout_seconds=TIMEOUT)
    with pytest.raises(EndpointBusy, match="retry later"):
        store.claim("sdflow", "token-2", EXEC_B, "endpoint", timeout_seconds=TIMEOUT)


def test_claim_earlier_attempt_of_same_execution_is_taken_over(store: TokenStore) -> None:
    store.claim("sdflow", "token-attempt-0", EXEC_A, "endpoint", {"action": "update"}, timeout_seconds=TIMEOUT)
    claim = store.claim("sdflow", "token-attempt-1", EXEC_A, "endpoint", {"model_name": "m1"}, timeout_seconds=TIMEOUT)
    assert claim.new
    held = store.get("sdflow")
    assert held is not None
    assert held.task_token == "token-attempt-1"
    assert held.context == {"model_name": "m1"}


def test_claim_expired_holder_is_replaced(store: TokenStore, clock: Clock) -> None:
    store.claim("sdflow", "token-old", EXEC_A, "endpoint", timeout_seconds=TIMEOUT)
    clock.now += TIMEOUT + SLACK + 1
    claim = store.claim("sdflow", "token-new", EXEC_B, "endpoint", timeout_seconds=TIMEOUT)
    assert claim.new
    assert store.get("sdflow").execution_arn == EXEC_B  # type: ignore[union-attr]


def test_delete_with_other_token_keeps_the_newer_claim(store: TokenStore) -> None:
    store.claim("job-1", "token-1", EXEC_A, "download", timeout_seconds=TIMEOUT)
    assert store.delete("job-1", token="token-stale") is False
    assert store.get("job-1") is not None
    assert store.delete("job-1", token="token-1") is True
    assert store.get("job-1") is None


def test_update_context_merges_keys(store: TokenStore) -> None:
    store.claim("sdflow", "token-1", EXEC_A, "endpoint", {"model_name": "m1"}, timeout_seconds=TIMEOUT)
    store.update_context("sdflow", "token-1", {"action": "create"})
    assert store.get("sdflow").context == {"model_name": "m1", "action": "create"}  # type: ignore[union-attr]


def test_claim_long_task_keeps_its_claim_past_a_fixed_ttl(store: TokenStore, clock: Clock) -> None:
    # A 28-day training task: a fixed 1-day TTL would let another claim take the name mid-task.
    store.claim("sdf-tr-long", "token-1", EXEC_A, "training", timeout_seconds=28 * 86_400)
    clock.now += 27 * 86_400
    with pytest.raises(TokenConflict):
        store.claim("sdf-tr-long", "token-2", EXEC_B, "training", timeout_seconds=TIMEOUT)


@pytest.mark.parametrize("timeout", [0, -5, 100_000_000])
def test_claim_timeout_outside_step_functions_range_raises(store: TokenStore, timeout: int) -> None:
    with pytest.raises(ValueError, match="timeout_seconds"):
        store.claim("job-1", "token-1", EXEC_A, "download", timeout_seconds=timeout)


def test_past_deadline_returns_only_due_claims(store: TokenStore, clock: Clock) -> None:
    store.claim("short-task", "token-1", EXEC_A, "download", timeout_seconds=600)
    store.claim("long-task", "token-2", EXEC_A, "training", timeout_seconds=86_400)
    clock.now += 601
    assert [record.resource_name for record in store.past_deadline()] == ["short-task"]
    assert store.get("short-task").deadline == int(clock.now) - 1  # type: ignore[union-attr]
    # With a lead, claims whose deadline comes within it are due too.
    due = sorted(record.resource_name for record in store.past_deadline(lead_seconds=86_400))
    assert due == ["long-task", "short-task"]


def test_past_deadline_counts_claims_without_deadline_as_due(
    store: TokenStore, mocked_aws: AwsWorld, clock: Clock
) -> None:
    legacy = {
        "resource_name": {"S": "legacy-job"},
        "task_token": {"S": "token-0"},
        "execution_arn": {"S": EXEC_A},
        "kind": {"S": "download"},
        "created_at": {"N": str(int(clock.now))},
        "expires_at": {"N": str(int(clock.now) + SLACK)},
        "context": {"M": {}},
    }
    mocked_aws.ddb.put_item(TableName=TOKEN_TABLE, Item=legacy)
    [record] = store.past_deadline()
    assert (record.resource_name, record.deadline) == ("legacy-job", int(clock.now))


def test_past_deadline_reads_every_page(store: TokenStore, clock: Clock) -> None:
    for index in range(30):
        store.claim(f"job-{index:02d}", f"token-{index}", EXEC_A, "download", timeout_seconds=5)
    clock.now += 10
    found = [record.resource_name for record in store.past_deadline(page_size=7)]
    assert sorted(found) == [f"job-{index:02d}" for index in range(30)]


def test_for_execution_lists_one_runs_claims_across_pages(store: TokenStore) -> None:
    for index in range(12):
        store.claim(f"a-{index:02d}", f"token-a{index}", EXEC_A, "download", timeout_seconds=TIMEOUT)
    store.claim("b-00", "token-b", EXEC_B, "training", timeout_seconds=TIMEOUT)
    mine = sorted(record.resource_name for record in store.for_execution(EXEC_A, page_size=5))
    assert mine == [f"a-{index:02d}" for index in range(12)]
    assert [record.resource_name for record in store.for_execution(EXEC_B)] == ["b-00"]


def test_token_store_without_table_name_raises() -> None:
    with pytest.raises(RuntimeError, match="TOKEN_TABLE"):
        TokenStore("", clock=time.time)


def test_get_many_reads_claims_of_more_names_than_one_batch(store: TokenStore) -> None:
    for index in range(0, 150, 3):
        store.claim(f"job-{index:03d}", f"token-{index}", EXEC_A, "download", timeout_seconds=TIMEOUT)

    found = store.get_many([f"job-{index:03d}" for index in range(150)])

    assert sorted(record.resource_name for record in found) == [f"job-{index:03d}" for index in range(0, 150, 3)]
    assert store.get_many([]) == []


def test_delete_with_token_of_a_claim_gone_reports_nothing_deleted(store: TokenStore) -> None:
    """Issue 32 item 3: "deleted" means this token's claim was removed, so the cleanup stops a job
    only when it took the claim away; a claim that is gone (the job ended, its event released it)
    is no proof that this caller holds the job."""
    assert store.delete("never-claimed", token="token-1") is False


def test_restore_puts_a_deleted_claim_back_unless_the_name_was_claimed_since(store: TokenStore) -> None:
    claim = store.claim("job-1", "token-1", EXEC_A, "training", {"k": "v"}, timeout_seconds=TIMEOUT)
    assert store.delete("job-1", token="token-1") is True

    assert store.restore(claim.record) is True
    assert store.get("job-1") == claim.record

    store.delete("job-1", token="token-1")
    store.claim("job-1", "token-2", EXEC_A, "training", timeout_seconds=TIMEOUT)
    assert store.restore(claim.record) is False
    assert store.get("job-1").task_token == "token-2"  # type: ignore[union-attr]


def test_take_over_replaces_only_the_claim_as_it_was_read(store: TokenStore) -> None:
    held = store.claim("job-1", "token-1", EXEC_A, "training", timeout_seconds=TIMEOUT).record

    assert store.take_over(held, "token-2", {}, timeout_seconds=TIMEOUT).new
    assert store.get("job-1").task_token == "token-2"  # type: ignore[union-attr]
    with pytest.raises(TokenConflict, match="changed hands"):
        store.take_over(held, "token-3", {}, timeout_seconds=TIMEOUT)

    store.delete("job-1", token="token-2")
    with pytest.raises(TokenConflict):
        store.take_over(held, "token-3", {}, timeout_seconds=TIMEOUT)
    assert store.get("job-1") is None, "a released claim is not taken: its job is being stopped"
