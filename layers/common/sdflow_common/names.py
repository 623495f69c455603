"""Deterministic SageMaker resource names, one set per run.

SageMaker job names are unique per account and region for ever (a finished job's name can
never be reused), at most 63 characters, `^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$`. A name is built
from:
- a readable prefix and a slug of the run id, for humans browsing the console;
- the run hash: a hash of the execution ARN and its start time. Step Functions lets an
  execution name be used again 90 days after the first execution closed, and the rerun has
  the same ARN: only the start time tells the two runs apart, so a rerun can never meet (and
  adopt) the jobs of the old one. Every name of a run contains the hash verbatim, so
  `ListProcessingJobs(NameContains=<run hash>)` finds all of a run's jobs;
- the redrive count as `-r<n>`: a redriven execution keeps its ARN and start time, and re-runs
  its failed states from RetryCount 0, whose old names are taken for ever;
- the Step Functions retry count (`$$.State.RetryCount`) as `-a<n>`, because a retried task
  must create a new job: the failed attempt's name is taken for ever.
The same inputs always give the same name, which is what makes a re-invoked Lambda find the
job its first invocation created instead of starting a second one."""

from __future__ import annotations

import hashlib
import math
import re
from datetime import UTC, datetime, timedelta

MAX_NAME_LENGTH = 63
NAME_PATTERN = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
HASH_LENGTH = 10

DOWNLOAD_PREFIX = "sdf-dl"
TRAINING_PREFIX = "sdf-tr"
EVALUATION_PREFIX = "sdf-ev"
DEDUP_PREFIX = "sdf-dd"
# Model package groups, one per run_name: `sdf-<run name slug>` (the IAM policies scope to sdf-*).
MODEL_GROUP_PREFIX = "sdf"
UNNAMED_RUN_GROUP = "unnamed"

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ATTEMPT_TAIL = re.compile(r"-a(\d+)$")
_COUNTERS_TAIL = re.compile(r"-r(\d+)-a(\d+)$")
# The readable slug is cut as if the counters had this many digits, so that it is the same for
# every attempt and redrive of a task (Step Functions allows 1,000 redrives of an execution and a
# retrier's MaxAttempts is at most 99,999,999; names with counters wider than this are still
# valid, their slug is just cut shorter).
_COUNTER_ROOM = len("r1000-a1000")


class InvalidNameInput(ValueError):
    """An input cannot make a valid name (empty item, negative attempt, unreadable start time)."""


def short_hash(*parts: str, length: int = HASH_LENGTH) -> str:
    """Hex digest of the parts; the separator keeps ("ab", "c") and ("a", "bc") apart."""
    digest = hashlib.sha256("\x1f".join(parts).encode()).hexdigest()
    return digest[:length]


def slug(text: str, max_length: int) -> str:
    """Lower-case alphanumerics and single hyphens, no hyphen at either end, cut to max_length."""
    if max_length <= 0:
        return ""
    cleaned = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return cleaned[:max_length].rstrip("-")


def execution_name(execution_arn: str) -> str:
    """The execution's own name: the last `:`-separated field of its ARN."""
    return execution_arn.rsplit(":", 1)[-1]


# ---------------------------------------------------------------------------- run identity


def start_millis(start_time: str | int | float | datetime) -> int:
    """The execution's start as epoch milliseconds (floor), from any of its three spellings:
    `$$.Execution.StartTime` (ISO 8601, any precision, `Z`, an offset or none = UTC), the
    "Step Functions Execution Status Change" event's `startDate` (epoch ms, a number) and
    DescribeExecution's `startDate` (a datetime). Floor, not round, so that a microsecond
    ISO time and the millisecond number of the same instant agree."""
    if isinstance(start_time, bool):
        raise InvalidNameInput(f"start_time must be a time, got the boolean {start_time}")
    if isinstance(start_time, int):
        return start_time
    if isinstance(start_time, float):
        if not math.isfinite(start_time):
            raise InvalidNameInput(f"start_time must be epoch milliseconds, got {start_time}")
        return math.floor(start_time)
    if isinstance(start_time, datetime):
        moment = start_time if start_time.tzinfo else start_time.replace(tzinfo=UTC)
        # Integer arithmetic: a float timestamp could land one millisecond off.
        return (moment - _EPOCH) // timedelta(milliseconds=1)
    if isinstance(start_time, str):
        text = start_time.strip()
        if text.isdigit():
            return int(text)
        try:
            parsed = datetime.fromisoformat(text)
        except ValueError:
            raise InvalidNameInput(
                f"start_time '{start_time}' is not an ISO 8601 time such as 2026-11-23T16:48:03.123Z "
                "(pass $$.Execution.StartTime)"
            ) from None
        return start_millis(parsed)
    raise InvalidNameInput(f"start_time must be an ISO string, epoch milliseconds or a datetime, got {start_time!r}")


def run_hash(execution_arn: str, start_time: str | int | float | datetime) -> str:
    """10 hex characters naming one run: the same for every redrive of the execution, different
    for a later execution that reuses its name (it starts at another time)."""
    if not execution_arn:
        raise InvalidNameInput("execution_arn must not be empty ($$.Execution.Id)")
    return short_hash(execution_arn, str(start_millis(start_time)))


# ---------------------------------------------------------------------------- names


def _counter(letter: str, value: int, source: str) -> str:
    if value < 0:
        raise InvalidNameInput(f"{source} must be ≥ 0, got {value}")
    return f"{letter}{value}"


def _counters(redrive: int, attempt: int) -> str:
    redrive_part = _counter("r", redrive, "redrive ($$.Execution.RedriveCount)")
    return f"{redrive_part}-{_counter('a', attempt, 'attempt ($$.State.RetryCount)')}"


def _check(name: str, parts: object) -> str:
    if len(name) > MAX_NAME_LENGTH or not NAME_PATTERN.match(name):
        raise InvalidNameInput(f"could not build a valid SageMaker name from {parts!r} (got '{name}')")
    return name


def _assemble(prefix: str, readable: str, key: str, counters: str) -> str:
    """`prefix-<slug>-<key>-<counters>`, the slug cut so the whole fits in 63 characters.

    The key (run hash, item) and the counters make the name unique, so only the readable part
    is ever shortened, by the same amount for every attempt; with no room left it is dropped."""
    fixed = len(prefix) + len(key) + 3  # three joining hyphens
    room = MAX_NAME_LENGTH - fixed - max(len(counters), _COUNTER_ROOM)
    readable_slug = slug(readable, room)
    parts = [prefix, readable_slug, key, counters]
    return _check("-".join(part for part in parts if part), parts)


def _shard_part(shard_id: str) -> str:
    shard = slug(shard_id, 12)
    if not shard:
        raise InvalidNameInput(f"shard_id '{shard_id}' has no letters or digits")
    return shard


def download_job_name(hash_: str, run_id: str, shard_id: str, redrive: int, attempt: int) -> str:
    """Processing job for one shard: `sdf-dl-<run slug>-<run hash>-<shard>-r<redrive>-a<attempt>`."""
    key = f"{hash_}-{_shard_part(shard_id)}"
    return _assemble(DOWNLOAD_PREFIX, run_id, key, _counters(redrive, attempt))


def download_job_key(hash_: str, shard_id: str) -> str:
    """What every attempt and redrive of one shard's download job name contains, and no other
    job's: `<run hash>-<shard>-r` (the run console matches a child execution to its job by it)."""
    return f"{hash_}-{_shard_part(shard_id)}-r"


def training_job_name(hash_: str, run_id: str, redrive: int, attempt: int) -> str:
    """Training job of a run: `sdf-tr-<run slug>-<run hash>-r<redrive>-a<attempt>`."""
    return _assemble(TRAINING_PREFIX, run_id, hash_, _counters(redrive, attempt))


def evaluation_job_name(hash_: str, run_id: str, redrive: int, attempt: int) -> str:
    """Evaluation processing job of a run: `sdf-ev-<run slug>-<run hash>-r<redrive>-a<attempt>`."""
    return _assemble(EVALUATION_PREFIX, run_id, hash_, _counters(redrive, attempt))


def dedup_job_name(hash_: str, run_id: str, redrive: int, attempt: int) -> str:
    """Dedup processing job of a run (Find duplicates): `sdf-dd-<run slug>-<run hash>-r<redrive>-a<attempt>`."""
    return _assemble(DEDUP_PREFIX, run_id, hash_, _counters(redrive, attempt))


def model_package_group_name(run_name: str | None) -> str:
    """The registry group of every model trained under one run_name: `sdf-<slug>` (63 chars at most;
    runs without a run_name share `sdf-unnamed`)."""
    head = slug(run_name or "", MAX_NAME_LENGTH - len(MODEL_GROUP_PREFIX) - 1) or UNNAMED_RUN_GROUP
    return _check(f"{MODEL_GROUP_PREFIX}-{head}", [MODEL_GROUP_PREFIX, head])


def deployment_name(endpoint_name: str, hash_: str, redrive: int, attempt: int) -> str:
    """Model and endpoint-config name of one deployment: `<endpoint slug>-<run hash>-r<n>-a<n>`.

    Models and endpoint configs live in separate namespaces, so both use this one name; a
    reader of `describe-endpoint` sees at once which run's deployment an endpoint serves."""
    counters = _counters(redrive, attempt)
    tail = f"{hash_}-{counters}"
    room = MAX_NAME_LENGTH - len(hash_) - 2 - max(len(counters), _COUNTER_ROOM)
    head = slug(endpoint_name, room) or "sdf-ep"
    return _check(f"{head}-{tail}", [head, tail])


# ---------------------------------------------------------------------------- lookups


def attempt_of(name: str) -> int | None:
    """The `-a<n>` counter at the end of a name built here, or None."""
    match = _ATTEMPT_TAIL.search(name)
    return int(match.group(1)) if match else None


def counters_of(name: str) -> tuple[int, int] | None:
    """(redrive, attempt) from the `-r<n>-a<n>` at the end of a name built here, or None."""
    match = _COUNTERS_TAIL.search(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def task_key(name: str) -> str | None:
    """A name without its `-r<n>-a<n>`: the same for every attempt and redrive of one task (the
    slug is cut as if the counters were wide), different for any other task. None when the name
    has no counters."""
    match = _COUNTERS_TAIL.search(name)
    return name[: match.start()] if match else None


def training_job_glob(execution_arn: str, start_time: str | int | float | datetime) -> str:
    """A glob matching the training job name of every attempt and redrive of one run."""
    return f"{TRAINING_PREFIX}-*{run_hash(execution_arn, start_time)}-r*-a*"
