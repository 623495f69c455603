"""Task tokens of waiting Step Functions tasks, keyed by the SageMaker resource they wait on.

A starter Lambda claims `resource_name → task token` before it creates the resource; the
job_events Lambda (or the reconciler) looks the token up when the resource reaches a
terminal state and deletes the item once the token is resolved. Item shape: docs/contracts.md
"Task tokens". Each claim carries its task's `deadline` (claim time + the task's TimeoutSeconds:
by then the task has timed out), which is when the reconciler looks at the resource itself; the
table's TTL attribute `expires_at` is a day after the deadline, so a claim outlives its task
however long the task may wait (up to SageMaker's 28 days) and forgotten items still clean
themselves up."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from botocore.exceptions import ClientError

from sdflow_common import aws
from sdflow_common.errors import EndpointBusy, TokenConflict
from sdflow_common.settings import Settings

# "evaluation" and "dedup" are processing jobs too; "approval" waits on a model package (keyed by its ARN).
Kind = Literal["download", "training", "evaluation", "dedup", "endpoint", "approval"]
KINDS: tuple[Kind, ...] = ("download", "training", "evaluation", "dedup", "endpoint", "approval")
# How long a claim is kept after its task's deadline: room for the reconciler to stop a job that
# outlived its task and for a late event to find its (dead) token, which it then cleans up.
EXPIRY_SLACK_SECONDS = 86_400
# BatchGetItem reads at most 100 items a call (DynamoDB API reference, BatchGetItem).
BATCH_GET_MAX_KEYS = 100
# Step Functions' largest TimeoutSeconds (99,999,999 s); a callback task cannot wait longer.
MAX_TIMEOUT_SECONDS = 99_999_999


@dataclass(frozen=True)
class TokenRecord:
    resource_name: str
    task_token: str
    execution_arn: str
    kind: Kind
    created_at: int
    deadline: int
    expires_at: int
    context: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Claim:
    """`new` is False when this exact token already held the name (a re-invoked Lambda)."""

    new: bool
    record: TokenRecord


def _to_item(record: TokenRecord) -> dict[str, Any]:
    return {
        "resource_name": {"S": record.resource_name},
        "task_token": {"S": record.task_token},
        "execution_arn": {"S": record.execution_arn},
        "kind": {"S": record.kind},
        "created_at": {"N": str(record.created_at)},
        "deadline": {"N": str(record.deadline)},
        "expires_at": {"N": str(record.expires_at)},
        "context": {"M": {key: {"S": value} for key, value in record.context.items()}},
    }


def _from_item(item: Mapping[str, Any]) -> TokenRecord:
    kind = item["kind"]["S"]
    if kind not in KINDS:
        raise ValueError(f"token item {item['resource_name']['S']} has unknown kind '{kind}'")
    context = {key: value.get("S", "") for key, value in item.get("context", {}).get("M", {}).items()}
    created_at = int(item["created_at"]["N"])
    return TokenRecord(
        resource_name=item["resource_name"]["S"],
        task_token=item["task_token"]["S"],
        execution_arn=item["execution_arn"]["S"],
        kind=kind,
        created_at=created_at,
        # Claims written before deadlines existed count as due at once: the reconciler checks them.
        deadline=int(item.get("deadline", {}).get("N", created_at)),
        expires_at=int(item["expires_at"]["N"]),
        context=context,
    )


class TokenStoreBusy(RuntimeError):
    """BatchGetItem kept answering some keys unprocessed (the table's throughput is exhausted)."""


def _is_conditional_failure(exc: ClientError) -> bool:
    return exc.response.get("Error", {}).get("Code") == "ConditionalCheckFailedException"


class TokenStore:
    """DynamoDB-backed; every write is conditional, so concurrent Lambdas cannot overwrite
    each other's tokens."""

    def __init__(
        self,
        table_name: str,
        slack_seconds: int = EXPIRY_SLACK_SECONDS,
        *,
        client: Any | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not table_name:
            raise RuntimeError("TOKEN_TABLE is not set; template.yaml must give the function the table name")
        self.table_name = table_name
        self.slack_seconds = slack_seconds
        self._client = client
        self._clock = clock

    @classmethod
    def from_settings(cls, settings: Settings) -> TokenStore:
        return cls(settings.token_table)

    @property
    def client(self) -> Any:
        return self._client if self._client is not None else aws.client("dynamodb")

    def _now(self) -> int:
        return int(self._clock())

    def claim(
        self,
        resource_name: str,
        token: str,
        execution_arn: str,
        kind: Kind,
        context: Mapping[str, str] | None = None,
        *,
        timeout_seconds: int,
    ) -> Claim:
        """Bind resource_name to token, once, until the task's deadline (now + timeout_seconds,
        the task's TimeoutSeconds) and a day beyond.

        - nobody holds the name (or the holder's TTL passed) → stored, `new=True`;
        - this token already holds it → `new=False` (the same task invoked again);
        - an earlier attempt of the same execution holds it → taken over, `new=True`: Step
          Functions runs one attempt of a task at a time, so the earlier token is dead;
        - another execution holds it → TokenConflict, or EndpointBusy for an endpoint (another
          run is deploying to it; the state's Retry waits for it to finish)."""
        if not 0 < timeout_seconds <= MAX_TIMEOUT_SECONDS:
            raise ValueError(
                f"timeout_seconds must be the task's TimeoutSeconds, 1 to {MAX_TIMEOUT_SECONDS}; got {timeout_seconds}"
            )
        now = self._now()
        deadline = now + timeout_seconds
        record = TokenRecord(
            resource_name=resource_name,
            task_token=token,
            execution_arn=execution_arn,
            kind=kind,
            created_at=now,
            deadline=deadline,
            expires_at=deadline + self.slack_seconds,
            context=dict(context or {}),
        )
        held = None
        # Two rounds: the holder may delete its claim between our put and our read.
        for _round in range(2):
            try:
                self.client.put_item(
                    TableName=self.table_name,
                    Item=_to_item(record),
                    # DynamoDB deletes expired items only eventually (up to days later), so an
                    # expired claim counts as free.
                    ConditionExpression="attribute_not_exists(resource_name) OR expires_at < :now",
                    ExpressionAttributeValues={":now": {"N": str(now)}},
                )
                return Claim(new=True, record=record)
            except ClientError as exc:
                if not _is_conditional_failure(exc):
                    raise
            held = self.get(resource_name)
            if held is not None:
                break
        if held is None:
            raise TokenConflict(f"{resource_name} is being claimed and released concurrently; retry")
        if held.task_token == token:
            return Claim(new=False, record=held)
        if held.execution_arn == execution_arn:
            self._replace(held, record)
            return Claim(new=True, record=record)
        message = (
            f"{resource_name} is held by execution {held.execution_arn} (kind {held.kind}, "
            f"since epoch {held.created_at}); this task belongs to {execution_arn}"
        )
        if kind == "endpoint":
            raise EndpointBusy(f"{message}. Another run is deploying to this endpoint; retry later.")
        raise TokenConflict(message)

    def take_over(self, held: TokenRecord, token: str, context: Mapping[str, str], *, timeout_seconds: int) -> Claim:
        """Bind `held`'s name to `token` only while `held.task_token` still holds it: a redrive
        adopting a job an earlier end left running. Unlike `claim`, a name nobody holds is not
        taken: the run cleanup deletes a job's claim and then stops the job, so a claim gone is a
        job being stopped. TokenConflict when the claim changed hands or went since it was read."""
        if held.task_token == token:
            return Claim(new=False, record=held)
        now = self._now()
        deadline = now + timeout_seconds
        record = TokenRecord(
            resource_name=held.resource_name,
            task_token=token,
            execution_arn=held.execution_arn,
            kind=held.kind,
            created_at=now,
            deadline=deadline,
            expires_at=deadline + self.slack_seconds,
            context=dict(context),
        )
        self._replace(held, record)
        return Claim(new=True, record=record)

    def _replace(self, held: TokenRecord, record: TokenRecord) -> None:
        try:
            self.client.put_item(
                TableName=self.table_name,
                Item=_to_item(record),
                ConditionExpression="task_token = :held",
                ExpressionAttributeValues={":held": {"S": held.task_token}},
            )
        except ClientError as exc:
            if _is_conditional_failure(exc):
                raise TokenConflict(
                    f"{record.resource_name} changed hands while this task was taking it over; retry"
                ) from exc
            raise

    def update_context(self, resource_name: str, token: str, context: Mapping[str, str]) -> None:
        """Merge keys into the context of a claim this token holds."""
        names = {f"#k{i}": key for i, key in enumerate(context)}
        values: dict[str, Any] = {f":v{i}": {"S": value} for i, value in enumerate(context.values())}
        values[":token"] = {"S": token}
        sets = ", ".join(f"#ctx.#k{i} = :v{i}" for i in range(len(context)))
        if not sets:
            return
        self.client.update_item(
            TableName=self.table_name,
            Key={"resource_name": {"S": resource_name}},
            UpdateExpression=f"SET {sets}",
            ConditionExpression="task_token = :token",
            ExpressionAttributeNames={"#ctx": "context", **names},
            ExpressionAttributeValues=values,
        )

    def get(self, resource_name: str) -> TokenRecord | None:
        response = self.client.get_item(
            TableName=self.table_name,
            Key={"resource_name": {"S": resource_name}},
            ConsistentRead=True,
        )
        item = response.get("Item")
        return _from_item(item) if item else None

    def get_many(self, resource_names: Sequence[str]) -> list[TokenRecord]:
        """The claims held on any of these names (BatchGetItem: 100 keys a call, consistent
        reads; unprocessed keys are asked again after a growing pause, as DynamoDB advises)."""
        found: list[TokenRecord] = []
        for start in range(0, len(resource_names), BATCH_GET_MAX_KEYS):
            keys = [{"resource_name": {"S": name}} for name in resource_names[start : start + BATCH_GET_MAX_KEYS]]
            request: dict[str, Any] = {self.table_name: {"Keys": keys, "ConsistentRead": True}}
            for pause in (0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6):
                time.sleep(pause)
                response = self.client.batch_get_item(RequestItems=request)
                found += [_from_item(item) for item in response.get("Responses", {}).get(self.table_name, [])]
                request = response.get("UnprocessedKeys") or {}
                if not request:
                    break
            else:
                raise TokenStoreBusy(f"DynamoDB left {len(request[self.table_name]['Keys'])} keys unread 7 times")
        return found

    def delete(self, resource_name: str, token: str | None = None) -> bool:
        """Remove the claim; with `token`, only if that token holds it.

        With a token, True means this call removed that token's claim: DeleteItem's
        ConditionExpression is evaluated on the item as stored, atomically with the delete, and a
        condition that is false (another token holds the name, or no item is there) answers
        ConditionalCheckFailedException and deletes nothing (DynamoDB API reference, DeleteItem).
        The run cleanup stops a job only on True: a claim taken over since it was read (a
        redrive adopting the job) or already released is not the cleanup's to act on."""
        kwargs: dict[str, Any] = {
            "TableName": self.table_name,
            "Key": {"resource_name": {"S": resource_name}},
        }
        if token is not None:
            kwargs["ConditionExpression"] = "task_token = :token"
            kwargs["ExpressionAttributeValues"] = {":token": {"S": token}}
        try:
            self.client.delete_item(**kwargs)
        except ClientError as exc:
            if _is_conditional_failure(exc):
                return False
            raise
        return True

    def restore(self, record: TokenRecord) -> bool:
        """Put back a claim this caller deleted (the run cleanup, whose stop of the job then
        failed: the job runs on, and its claim is how a redrive and the reconciler find it).
        False when the name was claimed again in between: the new claim stands."""
        try:
            self.client.put_item(
                TableName=self.table_name,
                Item=_to_item(record),
                ConditionExpression="attribute_not_exists(resource_name)",
            )
        except ClientError as exc:
            if _is_conditional_failure(exc):
                return False
            raise
        return True

    def _scan(self, page_size: int | None, **filters: Any) -> Iterator[TokenRecord]:
        """Every item matching the filter. A scan: the table holds one item per waiting task, so
        it stays small (10,000 shards = 10,000 small items); pages are followed all the same."""
        paginator = self.client.get_paginator("scan")
        pages = paginator.paginate(
            TableName=self.table_name,
            ConsistentRead=True,
            PaginationConfig={"PageSize": page_size} if page_size else {},
            **filters,
        )
        for page in pages:
            for item in page.get("Items", []):
                yield _from_item(item)

    def past_deadline(self, *, lead_seconds: int = 0, page_size: int | None = None) -> Iterator[TokenRecord]:
        """Claims whose deadline has passed, or passes within `lead_seconds` (the reconciler looks
        a little before the task times out, so a finished job whose event was lost still answers
        a live task). Claims without a deadline (written before deadlines existed) are due."""
        horizon = self._now() + lead_seconds
        return self._scan(
            page_size,
            FilterExpression="attribute_not_exists(deadline) OR deadline <= :horizon",
            ExpressionAttributeValues={":horizon": {"N": str(horizon)}},
        )

    def all_claims(self, *, page_size: int | None = None) -> Iterator[TokenRecord]:
        """Every claim (the reconciler's one read of the table a period)."""
        return self._scan(page_size)

    def for_execution(self, execution_arn: str, *, page_size: int | None = None) -> Iterator[TokenRecord]:
        """The claims of one run: its execution's ARN (download claims carry the parent execution's
        ARN, not the Map child's), for the cleanup when the run fails, is stopped or times out."""
        return self._scan(
            page_size,
            FilterExpression="execution_arn = :arn",
            ExpressionAttributeValues={":arn": {"S": execution_arn}},
        )
