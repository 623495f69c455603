"""Where the commands send their calls: the local cloud's state file, or flags and the environment.

`sdflow local up` writes `<workdir>/cloud.json` (its endpoint, the stack's outputs, the CLI's
environment); every other command reads it when no --endpoint-url is given, so a second shell
needs no exports. With real credentials and no endpoint, the same Session talks to AWS.
`Session.connect` is the SDK's way in: no flags, and the stack's outputs from CloudFormation
when no local cloud runs."""

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
from botocore.exceptions import BotoCoreError, ClientError

from sdflow.errors import CliError, NotConnected

DEFAULT_WORKDIR = Path(".sdflow")
STATE_FILE = "cloud.json"
DEFAULT_STACK_NAME = "sdflow"  # samconfig.toml's [prod] stack
# sdflow.local.template.DEFAULT_STACK_NAME, the stack a local cloud deploys; not imported from there,
# so that a notebook's venv needs nothing of the local runtime (a unit test keeps the two equal).
LOCAL_STACK_NAME = "sdflow-local"


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


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return True  # no pid recorded: nothing says it ended
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stack_outputs(client: Callable[..., Any], stack_name: str, where: str) -> dict[str, str]:
    try:
        stacks = client("cloudformation").describe_stacks(StackName=stack_name)["Stacks"]
    except (BotoCoreError, ClientError) as exc:
        raise NotConnected(
            f"no sdflow stack {stack_name!r} found ({exc}) and {where}: start `sdflow local up` (pass workdir= "
            "if it runs in another folder), or deploy the stack (`sam deploy`) and pass stack_name=, "
            "or pass bucket= and state_machine_arn="
        ) from None
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stacks[0].get("Outputs", [])}
    missing = [key for key in ("DataBucketName", "PipelineStateMachineArn") if key not in outputs]
    if missing:
        raise NotConnected(
            f"stack {stack_name!r} has no output {', '.join(missing)}: is it an sdflow stack, and done deploying? "
            "Pass the right stack_name=, or bucket= and state_machine_arn="
        )
    return outputs


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
    def connect(
        cls,
        *,
        workdir: Path | str | None = None,
        endpoint_url: str | None = None,
        stack_name: str | None = None,
        bucket: str | None = None,
        state_machine_arn: str | None = None,
        region: str | None = None,
    ) -> Session:
        """The running local cloud (its state file in `workdir`), else `endpoint_url` / $AWS_ENDPOINT_URL,
        else AWS; the stack's outputs from the state file, else CloudFormation (`stack_name`), unless
        `bucket` and `state_machine_arn` are both given."""
        folder = Path(workdir) if workdir is not None else DEFAULT_WORKDIR
        state = _state(folder)
        stale = bool(state) and not _alive(state.get("pid"))
        explicit = endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
        local = bool(state) and not stale and explicit in (None, state.get("endpoint_url"))
        url = explicit or (state.get("endpoint_url") if local else None)
        if local:
            # The local cloud's own credentials, not the caller's: real AWS keys never go to it.
            env = state.get("env", {})
            boto = boto3.session.Session(
                aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"),
                aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
                aws_session_token=env.get("AWS_SESSION_TOKEN"),
                region_name=region or state.get("region"),
            )
        else:
            boto = boto3.session.Session(region_name=region or os.environ.get("AWS_REGION"))
        clients: dict[str, Any] = {}

        def client(name: str, **options: Any) -> Any:
            if options:
                return boto.client(name, endpoint_url=url, **options)  # type: ignore[call-overload]
            # One client per service: an SDK loop polls every few seconds.
            if name not in clients:
                clients[name] = boto.client(name, endpoint_url=url)  # type: ignore[call-overload]
            return clients[name]

        outputs: dict[str, str] = dict(state.get("outputs", {})) if local and not stack_name else {}
        if not outputs and not (bucket and state_machine_arn):
            if not state:
                where = f"no local cloud runs ({folder / STATE_FILE} absent)"
            elif stale:
                where = f"the local cloud of {folder / STATE_FILE} (pid {state.get('pid')}) has ended"
            else:
                where = f"{url} is not the endpoint of the local cloud in {folder / STATE_FILE}"
            name = stack_name or (LOCAL_STACK_NAME if url else DEFAULT_STACK_NAME)
            outputs = _stack_outputs(client, name, where)
        return cls(
            client=client,
            bucket=bucket or outputs.get("DataBucketName"),
            state_machine_arn=state_machine_arn or outputs.get("PipelineStateMachineArn"),
            workdir=Path(state["workdir"]) if local and state.get("workdir") else None,
            endpoint_url=url,
            region=boto.region_name,
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
