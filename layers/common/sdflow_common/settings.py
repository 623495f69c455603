"""Environment a function receives from template.yaml, read once and typed.

Every name here is set in template.yaml's Globals or the function's own Environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# template.yaml's EndpointNamePrefix default, for a function run outside the template (tests).
DEFAULT_ENDPOINT_NAME_PREFIX = "sdflow"


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
    # How long before a waiting task's deadline the reconciler describes its resource itself.
    reconcile_lead_seconds: int
    # Every endpoint a run may create or update starts with this (template parameter
    # EndpointNamePrefix; the deploy role's IAM is scoped to it).
    endpoint_name_prefix: str
    # Where notifications link a run: a run console's base URL (template parameter ConsoleUrl; the
    # local runtime sets its `sdflow console`); empty: the AWS Step Functions console.
    console_url: str = ""
    # The notify function, which the reconciler hands the end of a run whose end event was lost.
    notify_function: str = ""
    # The second training image (template parameter AccelerateImageTag): the accelerate backend's jobs and
    # models. Only the functions that start a run's training, evaluation and model package have it.
    accelerate_image_uri: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """From the process's environment, or a function's (`sdflow plan` reads Validate run's)."""
        env = os.environ if environ is None else environ
        return cls(
            data_bucket=env.get("DATA_BUCKET", ""),
            token_table=env.get("TOKEN_TABLE", ""),
            topic_arn=env.get("TOPIC_ARN", ""),
            state_machine_arn=env.get("STATE_MACHINE_ARN", ""),
            sagemaker_role_arn=env.get("SAGEMAKER_ROLE_ARN", ""),
            training_image_uri=env.get("TRAINING_IMAGE_URI", ""),
            idempotency_table=env.get("IDEMPOTENCY_TABLE", ""),
            max_shards=int(env.get("MAX_SHARDS", "10000")),
            # The template speaks in minutes (CloudFormation cannot multiply); the *_SECONDS
            # form wins so tests and the local runtime can use short values.
            reconcile_lead_seconds=int(
                env.get("RECONCILE_LEAD_SECONDS") or int(env.get("RECONCILE_LEAD_MINUTES", "20")) * 60
            ),
            endpoint_name_prefix=env.get("ENDPOINT_NAME_PREFIX") or DEFAULT_ENDPOINT_NAME_PREFIX,
            console_url=env.get("CONSOLE_URL", ""),
            notify_function=env.get("NOTIFY_FUNCTION", ""),
            accelerate_image_uri=env.get("ACCELERATE_IMAGE_URI", ""),
        )

    def image_uri(self, backend: str) -> str:
        """The image of a training backend: the accelerate image for "accelerate", the first image otherwise
        (colossalai, and "auto" of a document that never went through Validate run)."""
        if backend == "accelerate":
            self.require("accelerate_image_uri")
            return self.accelerate_image_uri
        self.require("training_image_uri")
        return self.training_image_uri

    def require(self, *names: str) -> None:
        """Fail fast with the variable's name when a function runs without its configuration."""
        for name in names:
            if not getattr(self, name):
                _required(name.upper())
