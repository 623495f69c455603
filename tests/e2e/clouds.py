"""Local clouds for the e2e tests: the stack deployed, one-row parquet shards and a stand-in model
uploaded, SageMaker as no-op jobs (sdflow.local.sagemaker.noop) or the real local SageMaker, and the
clock scaled (tests/constants.py TIME_SCALE). tests/e2e/conftest.py builds one per module from the
module's `CLOUD = CloudSpec(...)`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdflow import samples
from sdflow.local.cloud import LocalCloud
from sdflow.local.sagemaker.noop import NoOpSageMaker
from tests.constants import TIME_SCALE


@dataclass(frozen=True)
class CloudSpec:
    """What a test module's cloud holds; every field has the value most modules want."""

    dataset: str = "tiny"  # s3://<bucket>/datasets/<dataset>/part-NNNNN.parquet
    shards: int = 3
    job_seconds: float = 0.3  # each no-op job's hold, on the clock
    # Per kind ("processing", "training"), overriding job_seconds (tests/constants.py hold_for).
    seconds_by_kind: Mapping[str, float] = field(default_factory=dict)
    # Blue/green updates run two fleets for a moment: above the default endpoint quota of 2.
    quotas: Mapping[str, int] = field(default_factory=lambda: {"endpoint": 8})
    parameters: Mapping[str, str] = field(default_factory=dict)
    # Lambda retries a failed asynchronous invocation after about 1 and 2 minutes (on the clock).
    async_retry_delays_s: tuple[float, ...] = (60.0, 120.0)
    time_scale: float = TIME_SCALE
    prewarm: bool = True
    # The tests observe jobs by listing them several times a second (tests/e2e/runs.py); the
    # pipeline lists none, which test_run_end_faults checks at AWS's rate (2 a second, burst 10).
    sagemaker_list_rate: tuple[float, int] = (1000.0, 1000)


@dataclass
class NoOpCloud:
    """A running local cloud whose SageMaker jobs do no work, and what was uploaded to it."""

    cloud: LocalCloud
    sagemaker: NoOpSageMaker
    spec: CloudSpec

    @property
    def dataset_uri(self) -> str:
        return f"s3://{self.cloud.bucket}/datasets/{self.spec.dataset}/"

    @property
    def model_uri(self) -> str:
        return f"s3://{self.cloud.bucket}/models/tiny/"

    def document(self, **sections: Any) -> dict[str, Any]:
        """A run document over this cloud's shards and model; `sections` add or replace top-level fields."""
        return {"dataset": {"prefix": self.dataset_uri}, "base_model_uri": self.model_uri, **sections}


def upload_inputs(cloud: LocalCloud, workdir: Path, dataset: str, shards: int) -> None:
    """`shards` one-row parquet files (their URL answers nothing: no-op jobs never fetch it) and a
    model folder with the model_index.json Validate run reads."""
    s3 = cloud.client("s3")
    row = samples.SampleRow("http://127.0.0.1:9/a.png", "a red circle", 64, 64)
    parquet = samples.write_parquet(workdir / "one.parquet", [row]).read_bytes()
    for i in range(shards):
        s3.put_object(Bucket=cloud.bucket, Key=f"datasets/{dataset}/part-{i:05d}.parquet", Body=parquet)
    s3.put_object(
        Bucket=cloud.bucket, Key="models/tiny/model_index.json", Body=b'{"_class_name": "StableDiffusionPipeline"}'
    )


@contextlib.contextmanager
def noop_cloud(workdir: Path, spec: CloudSpec) -> Iterator[NoOpCloud]:
    made: list[NoOpSageMaker] = []

    def factory(_workdir: Path, url: str, listener: Any) -> NoOpSageMaker:
        made.append(NoOpSageMaker(url, listener, job_seconds=spec.job_seconds))
        made[0].seconds_by_kind.update(spec.seconds_by_kind)
        return made[0]

    with LocalCloud(
        workdir,
        sagemaker_factory=factory,
        parameters=dict(spec.parameters),
        async_retry_delays_s=spec.async_retry_delays_s,
        quotas=dict(spec.quotas),
        sagemaker_list_rate=spec.sagemaker_list_rate,
        time_scale=spec.time_scale,
    ) as cloud:
        upload_inputs(cloud, workdir, spec.dataset, spec.shards)
        if spec.prewarm:
            cloud.prewarm().join(timeout=120)
        yield NoOpCloud(cloud, made[0], spec)
