"""SageMaker's account-level instance quotas and its Create* throttling, kept by the local runtime.

On AWS every instance type has its own concurrent-instance quota per use, named
"<instance type> for <use> usage" (use: processing job, training job, spot training job,
endpoint) in Service Quotas under service code `sagemaker`. A Create* call whose instances
would take the type past its quota is refused with ResourceLimitExceeded (HTTP 400):

    The account-level service limit 'ml.p3.8xlarge for training job usage' is 2 Instances, with
    current utilization of 3 Instances and a request delta of 1 Instances. Please use AWS Service
    Quotas to request an increase for this quota. If AWS Service Quotas is not available, contact
    AWS support to request an increase for this quota.

(the message SageMaker answers, quoted in aws/amazon-sagemaker-examples#1543 and
aws/sagemaker-python-sdk#4939). The instances count until the job ends (Completed, Failed,
Stopped) or the endpoint is deleted; an endpoint being updated holds its old and its new fleet
until the update ends (blue/green). SageMaker's control-plane APIs are also rate limited
("API throttling limits … are not adjustable", SageMaker AI endpoints and quotas): a Create*
call over the rate gets ThrottlingException "Rate exceeded". ListProcessingJobs and
ListTrainingJobs have a bucket of their own: AWS publishes no per-API rate, and users report
ListTrainingJobs at 2 requests a second, account-wide and not adjustable
(aws-solutions/deepracer-on-aws#87; syne-tune/syne-tune#634 sleeps 2 s between pages for it). The
burst of 10 is assumed (AWS documents none); a pipeline that lists jobs to find its own (every
shard's retry, every cleanup) then fails locally as it would in an account with a long history.

Local defaults are small on purpose, so that a pipeline that ignores quotas fails locally as it
would on a new account: 4 instances of each type for processing jobs, 2 for training (on-demand
and spot), 2 for endpoints. Create* calls: 50 a second, bursts of 100 (the demo never reaches
it; tests set it low); List*: 2 a second, bursts of 10. Override with LocalCloud(quotas=…,
sagemaker_create_rate=…, sagemaker_list_rate=…), `sdflow local up
--quota NAME=N`, or SDFLOW_LOCAL_QUOTAS='{"processing job": 8, "ml.g5.xlarge for endpoint usage": 1}'.
A key is either a use (the default for every instance type) or a full quota name."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sdflow.local.clock import REAL_TIME, Clock

USES = ("processing job", "training job", "spot training job", "endpoint")
DEFAULT_INSTANCE_QUOTAS: dict[str, int] = {
    "processing job": 4,
    "training job": 2,
    "spot training job": 2,
    "endpoint": 2,
}
DEFAULT_CREATE_RATE_PER_S = 50.0
DEFAULT_CREATE_BURST = 100
DEFAULT_LIST_RATE_PER_S = 2.0
DEFAULT_LIST_BURST = 10
QUOTAS_ENV = "SDFLOW_LOCAL_QUOTAS"


class QuotaConfigError(ValueError):
    """A quota override names no known quota or gives no whole number."""


class QuotaExceeded(Exception):
    """The Create* call needs more instances than the quota leaves (ResourceLimitExceeded)."""


class RateExceeded(Exception):
    """The Create* call is over SageMaker's API rate (ThrottlingException "Rate exceeded")."""


def quota_name(instance_type: str, use: str) -> str:
    return f"{instance_type} for {use} usage"


def split_quota_name(name: str) -> tuple[str, str] | None:
    """(instance type, use) of "<type> for <use> usage", or None."""
    for use in USES:
        suffix = f" for {use} usage"
        if name.endswith(suffix) and name.startswith("ml."):
            return name[: -len(suffix)], use
    return None


def quota_code(name: str) -> str:
    """A stable code in Service Quotas' format (L- and 8 hex digits). Real codes are assigned by
    AWS per quota; a local stand-in only has to be stable and distinct per name."""
    return "L-" + hashlib.sha256(name.encode()).hexdigest()[:8].upper()


def parse_overrides(overrides: Mapping[str, Any]) -> dict[str, int]:
    """Validated {use or quota name: instances}; QuotaConfigError names the bad key and the fix."""
    parsed: dict[str, int] = {}
    for key, value in overrides.items():
        if key not in USES and split_quota_name(key) is None:
            raise QuotaConfigError(
                f"unknown SageMaker quota {key!r}: use one of {list(USES)} (every instance type) or a "
                "quota name like 'ml.m5.xlarge for processing job usage'"
            )
        if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).isdigit():
            raise QuotaConfigError(f"quota {key!r} must be a whole number of instances >= 0, got {value!r}")
        parsed[key] = int(value)
    return parsed


def overrides_from_env(value: str | None) -> dict[str, int]:
    """SDFLOW_LOCAL_QUOTAS: a JSON object of overrides (empty or unset: none)."""
    if not value:
        return {}
    try:
        loaded = json.loads(value)
    except ValueError as exc:
        raise QuotaConfigError(f"{QUOTAS_ENV} must be a JSON object like '{{\"processing job\": 8}}': {exc}") from None
    if not isinstance(loaded, dict):
        raise QuotaConfigError(f"{QUOTAS_ENV} must be a JSON object like '{{\"processing job\": 8}}'")
    return parse_overrides(loaded)


def overrides_from_flags(flags: Iterable[str]) -> dict[str, int]:
    """`--quota NAME=N` flags (NAME a use or a quota name)."""
    pairs: dict[str, str] = {}
    for flag in flags:
        name, sep, value = flag.rpartition("=")
        if not sep or not name:
            raise QuotaConfigError(f"--quota {flag!r}: expected NAME=N, e.g. --quota 'processing job=8'")
        pairs[name.strip()] = value.strip()
    return parse_overrides(pairs)


@dataclass
class TokenBucket:
    """`rate_per_s` calls a second with bursts of `burst`, refilled on the local cloud's clock
    (sdflow/local/clock.py). Thread-safe."""

    rate_per_s: float
    burst: int
    clock: Clock = field(default=REAL_TIME, repr=False)
    _tokens: float | None = field(default=None, repr=False)
    _refilled_at: float | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.rate_per_s <= 0 or self.burst < 1:
            raise QuotaConfigError(
                f"a rate needs calls per second > 0 and a burst >= 1, got {self.rate_per_s}, {self.burst}"
            )

    def take(self) -> None:
        """One call's token, or RateExceeded."""
        with self._lock:
            now = self.clock.monotonic()
            tokens = float(self.burst) if self._tokens is None else self._tokens
            elapsed = 0.0 if self._refilled_at is None else now - self._refilled_at
            tokens = min(float(self.burst), tokens + elapsed * self.rate_per_s)
            self._refilled_at = now
            if tokens < 1.0:
                self._tokens = tokens
                raise RateExceeded("Rate exceeded")
            self._tokens = tokens - 1.0


@dataclass
class SageMakerQuotas:
    """Instances in use per quota, the limits, and the Create* and List* token buckets. Thread-safe."""

    overrides: dict[str, int] = field(default_factory=dict)
    create_rate_per_s: float = DEFAULT_CREATE_RATE_PER_S
    create_burst: int = DEFAULT_CREATE_BURST
    list_rate_per_s: float = DEFAULT_LIST_RATE_PER_S
    list_burst: int = DEFAULT_LIST_BURST
    # (kind, resource name, generation) -> [(quota name, instances)]
    _held: dict[tuple[str, str, str], list[tuple[str, int]]] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # ListProcessingJobs / ListTrainingJobs calls answered (each Throttled one included).
    list_calls: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        self.overrides = parse_overrides(self.overrides)
        self._create = TokenBucket(self.create_rate_per_s, self.create_burst)
        self._list = TokenBucket(self.list_rate_per_s, self.list_burst)

    @property
    def clock(self) -> Clock:
        return self._create.clock

    @clock.setter
    def clock(self, clock: Clock) -> None:
        # Both buckets refill on the local cloud's clock (sdflow/local/clock.py).
        self._create.clock = clock
        self._list.clock = clock

    def limit(self, name: str) -> int:
        """The quota in force: its own override, else the default for its use."""
        return self.overrides.get(name, self.default_limit(name))

    def default_limit(self, name: str) -> int:
        """The account's default for the quota's use (a use-level override, else the local default)."""
        parts = split_quota_name(name)
        if parts is None:
            raise QuotaConfigError(f"not a SageMaker instance quota name: {name!r}")
        return self.overrides.get(parts[1], DEFAULT_INSTANCE_QUOTAS[parts[1]])

    def named_overrides(self) -> list[str]:
        return [name for name in self.overrides if name not in USES]

    def usage(self, name: str) -> int:
        with self._lock:
            return self._usage(name)

    def _usage(self, name: str) -> int:
        return sum(count for held in self._held.values() for quota, count in held if quota == name)

    def acquire(self, key: tuple[str, str, str], needs: Mapping[str, int]) -> None:
        """Hold `needs` (quota name -> instances) for `key`, or raise QuotaExceeded (nothing held)."""
        with self._lock:
            for name, delta in needs.items():
                limit, used = self.limit(name), self._usage(name)
                if used + delta > limit:
                    raise QuotaExceeded(
                        f"The account-level service limit '{name}' is {limit} Instances, with current utilization "
                        f"of {used} Instances and a request delta of {delta} Instances. Please use AWS Service "
                        "Quotas to request an increase for this quota. If AWS Service Quotas is not available, "
                        "contact AWS support to request an increase for this quota."
                    )
            self._held[key] = [(name, count) for name, count in needs.items() if count]

    def release(self, kind: str, resource: str, keep_generation: str | None = None) -> None:
        """Free what a job or endpoint holds (all of it, or all but one generation of an endpoint)."""
        with self._lock:
            for key in [k for k in self._held if k[0] == kind and k[1] == resource and k[2] != keep_generation]:
                del self._held[key]

    def take_create_token(self) -> None:
        """One Create* call from its token bucket, or RateExceeded."""
        self._create.take()

    def set_list_rate(self, rate_per_s: float, burst: int) -> None:
        """A new List* bucket (full), on the same clock: tests that observe jobs by listing them
        many times a second lift the rate; a test of the pipeline's own calls sets AWS's back."""
        bucket = TokenBucket(rate_per_s, burst, self._list.clock)
        self.list_rate_per_s, self.list_burst, self._list = rate_per_s, burst, bucket

    def take_list_token(self) -> None:
        """One ListProcessingJobs / ListTrainingJobs call from its token bucket, or RateExceeded."""
        with self._lock:
            self.list_calls += 1
        self._list.take()


def processing_needs(request: Mapping[str, Any]) -> dict[str, int]:
    cluster = (request.get("ProcessingResources") or {}).get("ClusterConfig") or {}
    return _needs([(cluster.get("InstanceType"), cluster.get("InstanceCount", 1))], "processing job")


def training_needs(request: Mapping[str, Any]) -> dict[str, int]:
    """ResourceConfig's instances (or its InstanceGroups), under the spot quota for managed spot."""
    use = "spot training job" if request.get("EnableManagedSpotTraining") else "training job"
    resources = request.get("ResourceConfig") or {}
    groups = resources.get("InstanceGroups") or [resources]
    return _needs([(group.get("InstanceType"), group.get("InstanceCount", 1)) for group in groups], use)


def endpoint_needs(config: Mapping[str, Any]) -> dict[str, int]:
    """Every instance-backed production variant (serverless variants hold no instances)."""
    variants = [v for v in config.get("ProductionVariants") or [] if v.get("InstanceType")]
    return _needs([(v["InstanceType"], v.get("InitialInstanceCount", 1)) for v in variants], "endpoint")


def _needs(pairs: Iterable[tuple[Any, Any]], use: str) -> dict[str, int]:
    needs: dict[str, int] = {}
    for instance_type, count in pairs:
        if instance_type:
            name = quota_name(str(instance_type), use)
            needs[name] = needs.get(name, 0) + int(count or 0)
    return needs
