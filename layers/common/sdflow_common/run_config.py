"""`$.config`: what Validate run returns and every later state reads (docs/contracts.md).

Its own module, below validate_run: the starters and Register model parse it, and Validate run builds every
request they will make (sdflow_common.request_plan) with their own builders before the run starts."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from sdflow_common.resume import ResumeInfo
from sdflow_common.run_document import RunDocument


class RunConfig(BaseModel):
    """`$.config`: what every later state needs to know about the run, without the shard list.

    Later functions parse it with this model; extra keys are ignored so the state machine may grow it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    run_id: str
    execution_arn: str
    started_at: str
    bucket: str
    shard_list_key: str
    shard_count: int = Field(ge=1)
    dataset_prefix_uri: str
    # TimeoutSeconds of the callback tasks (read by TimeoutSecondsPath): download, training, endpoint.
    timeouts: dict[str, int]
    run: RunDocument
    # Tolerated problems found at intake (a few unreadable parquet files), shown in the notification.
    warnings: list[dict[str, str]] = Field(default_factory=list)
    # The share of the dataset's samples held out of training for the evaluation (evaluation_checks.resolve_holdout;
    # the download job's --holdout_rate): 0, no held-out split.
    holdout_rate: float = Field(default=0.0, ge=0, le=1)
    # Only when the document resumes an earlier run: absent, not null, otherwise (the state machine's
    # Choice tests `$.config.resume.training` IsPresent).
    resume: ResumeInfo | None = None

    @model_serializer(mode="wrap")
    def _omit_absent_resume(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("resume") is None:
            data.pop("resume", None)
        return data

    @property
    def run_prefix(self) -> str:
        return f"runs/{self.run_id}/"
