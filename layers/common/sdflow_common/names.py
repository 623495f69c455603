"""Deterministic SageMaker resource names.

SageMaker job names are unique per account and region for ever (a finished job's name can
never be reused), at most 63 characters, `^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$`. So a name is
built from:
- a readable prefix and a slug of the run id, for humans browsing the console;
- a hash of the execution ARN and the item, so two runs (or two shards) never collide even
  when their readable parts are cut short;
- the Step Functions retry count (`$$.State.RetryCount`) as `-a<n>`, because a retried task
  must create a new job: the failed attempt's name is taken for ever.
The same inputs always give the same name, which is what makes a re-invoked Lambda find the
job its first invocation created instead of starting a second one."""

from __future__ import annotations

import hashlib
import re

MAX_NAME_LENGTH = 63
NAME_PATTERN = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
HASH_LENGTH = 10

DOWNLOAD_PREFIX = "sdf-dl"
TRAINING_PREFIX = "sdf-tr"


class InvalidNameInput(ValueError):
    """An input cannot make a valid name (empty item, negative attempt)."""


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


def _attempt_suffix(attempt: int) -> str:
    if attempt < 0:
        raise InvalidNameInput(f"attempt must be ≥ 0 ($$.State.RetryCount), got {attempt}")
    return f"a{attempt}"


def _assemble(prefix: str, readable: str, fixed_tail: list[str]) -> str:
    """`prefix-<slug>-<tail…>`, the slug cut so the whole fits in 63 characters.

    The tail (hash, item, attempt) is what makes the name unique, so only the readable part
    is ever shortened; when there is no room for it at all it is left out."""
    tail = "-".join(part for part in fixed_tail if part)
    room = MAX_NAME_LENGTH - len(prefix) - len(tail) - 2  # two joining hyphens
    readable_slug = slug(readable, room)
    parts = [prefix, readable_slug, tail] if readable_slug else [prefix, tail]
    name = "-".join(part for part in parts if part)
    if len(name) > MAX_NAME_LENGTH or not NAME_PATTERN.match(name):
        raise InvalidNameInput(f"could not build a valid SageMaker name from {parts!r} (got '{name}')")
    return name


def download_job_name(execution_arn: str, run_id: str, shard_id: str, attempt: int) -> str:
    """Processing job for one shard: `sdf-dl-<run slug>-<hash10>-<shard>-a<attempt>`."""
    shard = slug(shard_id, 12)
    if not shard:
        raise InvalidNameInput(f"shard_id '{shard_id}' has no letters or digits")
    digest = short_hash(execution_arn, "download", shard_id)
    return _assemble(DOWNLOAD_PREFIX, run_id, [digest, shard, _attempt_suffix(attempt)])


def training_job_name(execution_arn: str, run_id: str, attempt: int) -> str:
    """Training job of a run: `sdf-tr-<run slug>-<hash10>-a<attempt>`."""
    digest = short_hash(execution_arn, "training")
    return _assemble(TRAINING_PREFIX, run_id, [digest, _attempt_suffix(attempt)])


def training_job_glob(execution_arn: str) -> str:
    """A glob matching every attempt's training job name of the execution (the slug may be
    shortened differently per attempt; the hash never is)."""
    return f"{TRAINING_PREFIX}-*-{short_hash(execution_arn, 'training')}-a*"


def deployment_name(endpoint_name: str, execution_arn: str, attempt: int) -> str:
    """Model and endpoint-config name of one deployment: `<endpoint>-<hash10>-a<attempt>`.

    Models and endpoint configs live in separate namespaces, so both use this one name; a
    reader of `describe-endpoint` sees at once which deployment an endpoint serves."""
    digest = short_hash(execution_arn, "deploy", endpoint_name)
    tail = f"{digest}-{_attempt_suffix(attempt)}"
    room = MAX_NAME_LENGTH - len(tail) - 1
    head = slug(endpoint_name, room) or "sdf-ep"
    name = f"{head}-{tail}"
    if not NAME_PATTERN.match(name):
        raise InvalidNameInput(f"could not build a valid model name from endpoint '{endpoint_name}'")
    return name
