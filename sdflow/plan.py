"""`sdflow plan MANIFEST [--name NAME] [--json]`: what Validate run would decide, without starting anything.

The same code path as Validate run (sdflow_common.run_plan.plan_run → validate_run.prepare_run), run here against
the stack the other commands use (the local cloud, or AWS), with the stack's own settings: the environment of its
Validate run function (the bucket, MaxShards, the job role, the images, the endpoint name prefix). It reads S3,
Step Functions and Service Quotas as Validate run does, and writes nothing. Exit 0: the run would start; 2: it
would be refused (every refusal printed with its field and fix)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from sdflow.errors import CliError
from sdflow.session import DEFAULT_STACK_NAME, LOCAL_STACK_NAME, Session
from sdflow_common import aws
from sdflow_common.run_plan import plan_run
from sdflow_common.settings import Settings
from sdflow_common.start_pipeline import MANIFEST_PREFIX, ManifestRef, execution_name

VALIDATE_RUN_FUNCTION = "ValidateRunFunction"  # template.yaml's logical id
WOULD_START, REFUSED = 0, 2


def stack_environment(session: Session, stack_name: str | None = None) -> dict[str, str]:
    """The environment of the stack's Validate run function: the settings Validate run itself runs with."""
    name = stack_name or (LOCAL_STACK_NAME if session.endpoint_url else DEFAULT_STACK_NAME)
    advice = "start `sdflow local up`, or pass --stack-name for a deployed stack"
    try:
        # ListStackResources, not DescribeStackResource: the local cloud (moto) answers the first only.
        pages = session.client("cloudformation").get_paginator("list_stack_resources").paginate(StackName=name)
        found = [
            resource["PhysicalResourceId"]
            for page in pages
            for resource in page["StackResourceSummaries"]
            if resource["LogicalResourceId"] == VALIDATE_RUN_FUNCTION
        ]
        if not found:
            raise CliError(f"stack {name!r} has no {VALIDATE_RUN_FUNCTION}: is it an sdflow stack? {advice}")
        config = session.client("lambda").get_function_configuration(FunctionName=found[0])
    except (BotoCoreError, ClientError) as exc:
        raise CliError(f"cannot read the Validate run function of stack {name!r} ({exc}): {advice}") from None
    return {key: str(value) for key, value in config.get("Environment", {}).get("Variables", {}).items()}


def _point_layer_at(session: Session, settings: Settings) -> None:
    """The layer reads the environment (its clients, sdflow_common.aws; the endpoint name prefix, Settings): make
    it the session's and the stack's, as in the function. Clients made before are dropped only when it changed."""
    wanted = {"ENDPOINT_NAME_PREFIX": settings.endpoint_name_prefix}
    if session.endpoint_url:
        wanted["AWS_ENDPOINT_URL"] = session.endpoint_url
    if session.region:
        wanted |= {key: os.environ.get(key) or session.region for key in ("AWS_REGION", "AWS_DEFAULT_REGION")}
    changed = {key: value for key, value in wanted.items() if os.environ.get(key) != value}
    os.environ.update(changed)
    if changed.keys() - {"ENDPOINT_NAME_PREFIX"}:
        aws.reset_clients()


def upload_name(manifest: Path, body: bytes, bucket: str, run_name: Any) -> str:
    """The name start_pipeline gives an upload of `manifest` (`sdflow run`): its slug and the hash of the object's
    identity, here the ETag S3 gives a single-part upload (the MD5 of the bytes)."""
    ref = ManifestRef(
        bucket, MANIFEST_PREFIX + manifest.name, etag=hashlib.md5(body, usedforsecurity=False).hexdigest()
    )
    return execution_name(ref, run_name if isinstance(run_name, str) and run_name else None)


def _read(manifest: Path) -> tuple[bytes, Any]:
    try:
        body = manifest.read_bytes()
        return body, json.loads(body)
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read a run document from {manifest}: {exc}") from None


def render(plan: dict[str, Any]) -> list[str]:
    """The plan in words: the choices, each request, each GPU's memory; or every refusal."""
    name = plan["execution_name"]
    if not plan["would_start"]:
        lines = [f"Validate run would refuse run {name}: {len(plan['problems'])} problem(s)"]
        return lines + [f"  - {problem['field']}: {problem['message']}" for problem in plan["problems"]]
    lines = [
        f"Validate run would start run {name}",
        f"  family {plan['family']}, {plan['method']} training on {plan['backend']} (plugin {plan['plugin']}, "
        f"{plan['precision']})",
        f"  {plan['shards']} shard(s): one download job each, {plan['download_concurrency']} at a time",
        "requests (the first attempt's names):",
    ]
    for item in plan["requests"]:
        where = f"  {item['instance_type']} x {item['instance_count']}" if item["instance_type"] else ""
        lines.append(f"  {item['operation']:<24} {item['label']:<20} {item['name']}{where}")
    if plan["memory"]:
        lines.append("memory per GPU (estimate / usable):")
    for fit in plan["memory"]:
        verdict = "fits" if fit["fits"] else "DOES NOT FIT"
        lines.append(
            f"  {fit['field']:<26} {fit['instance_type']} ({fit['gpu']}): {fit['need_gib']} / {fit['usable_gib']} "
            f"GiB, {verdict}"
        )
    lines += [f"warning: {warning['field']}: {warning['message']}" for warning in plan["warnings"]]
    return lines


def plan_manifest(
    session: Session, manifest: Path, *, name: str | None = None, stack_name: str | None = None
) -> dict[str, Any]:
    """Validate run's decision for `manifest` started as `name` (default: the name an upload of it gets)."""
    body, document = _read(manifest)
    environment = stack_environment(session, stack_name)
    settings = Settings.from_env(environment)
    bucket = session.bucket or settings.data_bucket
    run_name = document.get("run_name") if isinstance(document, dict) else None
    _point_layer_at(session, settings)
    return plan_run(
        document,
        name or upload_name(manifest, body, bucket, run_name),
        data_bucket=bucket,
        max_shards=settings.max_shards,
        state_machine_arn=session.pipeline_arn(),
        settings=settings,
    )


def cmd_plan(session: Session, manifest: Path, *, name: str | None, as_json: bool, stack_name: str | None) -> int:
    plan = plan_manifest(session, manifest, name=name, stack_name=stack_name)
    print(json.dumps(plan, indent=2) if as_json else "\n".join(render(plan)))
    return WOULD_START if plan["would_start"] else REFUSED
