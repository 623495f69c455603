"""Environment a function receives from template.yaml, read once and typed.

Every name here is set in template.yaml's Globals or the function's own Environment."""

from __future__ import annotations

import os
from dataclasses import dataclass


def _required(name: str) -> str:
    value = os.environ.get(name, "")
    if not value:
        raise RuntimeError(f"environment variable {name} is not set; template.yaml must define it")
    return value


@dataclass(frozen=True)
class Settings:
    data_bucket: str
    token_table: str
    topic_arn: str
    state_machine_arn: str
    sagemaker_role_arn: str
    training_image_uri: str
    idempotency_table: str
    max_shards: int
    token_ttl_seconds: int
    reconcile_after_seconds: int

    @classmethod
    def from_env(cls) -> Settings:
        return cls(
            data_bucket=os.environ.get("DATA_BUCKET", ""),
            token_table=os.environ.get("TOKEN_TABLE", ""),
            topic_arn=os.environ.get("TOPIC_ARN", ""),
            state_machine_arn=os.environ.get("STATE_MACHINE_ARN", ""),
            sagemaker_role_arn=os.environ.get("SAGEMAKER_ROLE_ARN", ""),
            training_image_uri=os.environ.get("TRAINING_IMAGE_URI", ""),
            idempotency_table=os.environ.get("IDEMPOTENCY_TABLE", ""),
            max_shards=int(os.environ.get("MAX_SHARDS", "10000")),
            # The template speaks in days and minutes (CloudFormation cannot multiply);
            # the *_SECONDS forms win so tests and the local runtime can use short values.
            token_ttl_seconds=int(
                os.environ.get("TOKEN_TTL_SECONDS") or int(os.environ.get("TOKEN_TTL_DAYS", "30")) * 86400
            ),
            reconcile_after_seconds=int(
                os.environ.get("RECONCILE_AFTER_SECONDS") or int(os.environ.get("RECONCILE_AFTER_MINUTES", "30")) * 60
            ),
        )

    def require(self, *names: str) -> None:
        """Fail fast with the variable's name when a function runs without its configuration."""
        for name in names:
            if not getattr(self, name):
                _required(name.upper())
