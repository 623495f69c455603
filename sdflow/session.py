"""Where the commands send their calls: the local cloud's state file, or flags and the environment.

`sdflow local up` writes `<workdir>/cloud.json` (its endpoint, the stack's outputs, the CLI's
environment); every other command reads it when no --endpoint-url is given, so a second shell
needs no exports. With real credentials and no endpoint, the same Session talks to AWS."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3

DEFAULT_WORKDIR = Path(".sdflow")
STATE_FILE = "cloud.json"


class CliError(Exception):
    """A problem the user can fix; printed without a traceback."""


def remove_state(workdir: Path) -> None:
    """Delete the state file if this process wrote it (another `local up` may own a newer one)."""
    path = workdir / STATE_FILE
    with contextlib.suppress(FileNotFoundError, ValueError):
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()


def _state(workdir: Path) -> dict[str, Any]:
    path = workdir / STATE_FILE
    if not path.exists():
        return {}
    return json.loads(path.read_text())


@dataclass
class Session:
    """Where the commands send their calls: an endpoint, the stack's outputs, a client factory."""

    client: Callable[..., Any]  # (service, **boto3 client options) -> client
    bucket: str | None
    state_machine_arn: str | None
    workdir: Path | None = None  # the local runtime's folder (job logs for `watch`), if local
    endpoint_url: str | None = None
    region: str | None = None
    outputs: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Session:
        """From flags, else the environment, else the state file `sdflow local up` writes."""
        state = _state(args.workdir)
        endpoint_url = args.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or state.get("endpoint_url")
        if endpoint_url:
            for key, value in state.get("env", {}).items():
                os.environ.setdefault(key, value)
        session = boto3.session.Session(region_name=state.get("region") or os.environ.get("AWS_REGION"))
        outputs = state.get("outputs", {})
        return cls(
            client=lambda name, **options: session.client(name, endpoint_url=endpoint_url, **options),
            bucket=args.bucket or outputs.get("DataBucketName"),
            state_machine_arn=args.state_machine_arn or outputs.get("PipelineStateMachineArn"),
            workdir=Path(state["workdir"]) if state.get("workdir") else None,
            endpoint_url=endpoint_url,
            region=session.region_name,
            outputs=outputs,
        )

    @classmethod
    def for_cloud(cls, cloud: Any) -> Session:
        """A session on a LocalCloud running in this process."""
        return cls(
            client=cloud.client,
            bucket=cloud.outputs["DataBucketName"],
            state_machine_arn=cloud.outputs["PipelineStateMachineArn"],
            workdir=Path(cloud.workdir),
            endpoint_url=cloud.endpoint_url,
            region=cloud.cli_env()["AWS_REGION"],
            outputs=dict(cloud.outputs),
        )

    def console_config(self) -> Any:
        from sdflow.console.server import ConsoleConfig

        return ConsoleConfig(
            client=self.client,
            endpoint_url=self.endpoint_url,
            region=self.region,
            bucket=self.bucket,
            state_machine_arn=self.state_machine_arn,
            notify_log_group=self.outputs.get("NotificationLogGroupName"),
        )

    def data_bucket(self) -> str:
        return self._known(self.bucket, "bucket")

    def pipeline_arn(self) -> str:
        return self._known(self.state_machine_arn, "state_machine_arn")

    @staticmethod
    def _known(value: str | None, name: str) -> str:
        if not value:
            flag = "--" + name.replace("_", "-")
            raise CliError(f"{name} unknown: start `sdflow local up` first, or pass {flag}")
        return value


def write_state(workdir: Path, cloud: Any) -> None:
    state = {
        "endpoint_url": cloud.endpoint_url,
        "outputs": cloud.outputs,
        "env": cloud.cli_env(),
        "region": cloud.cli_env()["AWS_REGION"],
        "workdir": str(cloud.workdir),
        "pid": os.getpid(),
    }
    (workdir / STATE_FILE).write_text(json.dumps(state, indent=2))
