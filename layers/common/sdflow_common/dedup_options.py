"""The run document's `deduplication` block: the dedup job of *Find duplicates* (docs/contracts.md "The dedup
job"), between *Download shards* and *Build dataset index* (run_document assembles the document)."""

from __future__ import annotations

from pydantic import Field

from sdflow_common.training_options import INSTANCE_TYPE, PROCESSING_MAX_RUNTIME_LIMIT
from sdflow_common.training_options import StrictOptions as _Strict

# ProcessingResources.ClusterConfig.VolumeSizeInGB (SageMaker API reference: 1 to 16384).
DEDUP_VOLUME_MAX_GB = 16384
# One instance: the job groups every hash itself (its processes share the instance's disk).
DEDUP_INSTANCE_COUNT = 1


class DeduplicationOptions(_Strict):
    """Find duplicates: one processing job reads every downloaded shard's hashes (URL and decoded pixels) and
    lists the training samples that repeat an earlier sample (a held-out one first), which training skips."""

    enabled: bool = Field(
        default=True,
        description="Run *Find duplicates*. `false`: the state is skipped and every downloaded sample trains.",
    )
    instance_type: str = Field(
        default="ml.m5.2xlarge",
        pattern=INSTANCE_TYPE,
        description="The dedup job's processing instance (CPU: it reads hash files, never images).",
    )
    volume_size_gb: int = Field(
        default=50,
        ge=1,
        le=DEDUP_VOLUME_MAX_GB,
        description="The job's volume (GB), holding the hash partitions it spills to disk.",
    )
    processes: int = Field(
        default=8, ge=1, le=96, description="Processes reading shards and grouping partitions (≈ vCPUs)."
    )
    max_runtime_seconds: int = Field(
        default=3600,
        ge=60,
        le=PROCESSING_MAX_RUNTIME_LIMIT,
        description="The dedup job's stopping condition.",
    )
