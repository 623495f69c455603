"""Starting, finding, resuming and following runs: what `sdflow run/resume/status/watch` and sdflow.sdk share.

A run is started the two ways docs/run-document.md describes: a manifest uploaded under
`manifests/` (StartPipeline starts it and records the upload in `runs/<name>/started_by.json`),
or StartExecution with the document as the input."""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from sdflow import progress as progress_mod
from sdflow.errors import ManifestRejected, RunNotFound, SdflowError, WaitTimeout
from sdflow.session import Session
from sdflow_common.start_pipeline import MANIFEST_PREFIX, rejected_key, source_key

# Executions still going (ExecutionStatus, Step Functions API Reference): Validate run refuses to resume
# from them, so the CLI says so before starting anything.
UNFINISHED = ("RUNNING", "PENDING_REDRIVE")
MAX_EXECUTION_NAME = 80  # StartExecution's `name`: 1-80 characters
RESUME_SUFFIX = re.compile(r"-resume-\d{8}T\d{6}$")
UPLOAD_START_TIMEOUT_S = 60.0

Document = Path | Mapping[str, Any]


def execution_arn(state_machine_arn: str, name: str) -> str:
    """The ARN an execution of `state_machine_arn` named `name` has."""
    return state_machine_arn.replace(":stateMachine:", ":execution:", 1) + f":{name}"


def executions(sfn: Any, state_machine_arn: str, limit: int = 1000) -> list[dict[str, Any]]:
    """The newest `limit` (at most 1,000) executions, newest first."""
    listed = sfn.list_executions(stateMachineArn=state_machine_arn, maxResults=limit)["executions"]
    return sorted(listed, key=lambda e: e["startDate"], reverse=True)


def describe(session: Session, arn: str) -> dict[str, Any]:
    """DescribeExecution; an execution that does not exist is RunNotFound."""
    try:
        return dict(session.client("stepfunctions").describe_execution(executionArn=arn))
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("ExecutionDoesNotExist", "InvalidArn", "StateMachineDoesNotExist", "ResourceNotFound"):
            raise RunNotFound(
                f"no execution {arn}: check the name (`sdflow status` or pipeline.runs() lists recent runs; "
                "Step Functions keeps an ended execution 90 days)"
            ) from None
        raise


def resolve_execution(session: Session, execution: str | None) -> str:
    """The ARN of the execution named `execution` (a name or an ARN; None: the newest)."""
    if execution and execution.startswith("arn:"):
        return str(describe(session, execution)["executionArn"])
    pipeline = session.pipeline_arn()
    if execution is None:
        newest = executions(session.client("stepfunctions"), pipeline, limit=1)
        if not newest:
            raise RunNotFound(f"no execution yet of {pipeline}: start a run first")
        return str(newest[0]["executionArn"])
    try:
        return str(describe(session, execution_arn(pipeline, execution))["executionArn"])
    except RunNotFound:
        raise RunNotFound(
            f"no execution {execution!r} of {pipeline}: check the name (`sdflow status` or pipeline.runs() lists "
            "recent runs; Step Functions keeps an ended execution 90 days)"
        ) from None


def _document_text(manifest: Document) -> str:
    if not isinstance(manifest, Path):
        return json.dumps(dict(manifest))
    try:
        text = manifest.read_text()
        json.loads(text)  # a broken file is the user's to fix before anything is sent
    except (OSError, ValueError) as exc:
        raise SdflowError(f"cannot read a run document from {manifest}: {exc}") from None
    return text


def _manifest_key(manifest: Document, name: str | None) -> str:
    if name:
        return MANIFEST_PREFIX + name.removesuffix(".json") + ".json"
    if isinstance(manifest, Path):
        return MANIFEST_PREFIX + manifest.name
    # A new key per upload: identical bytes under one key would be a duplicate (the same ETag) in an
    # unversioned bucket, and starting twice would read as a redelivered event.
    run_name = manifest.get("run_name")
    stem = run_name if isinstance(run_name, str) and run_name else "run"
    return f"{MANIFEST_PREFIX}{stem}-{datetime.now(UTC):%Y%m%dT%H%M%S%f}.json"


def start_run(session: Session, manifest: Document, *, api: bool, name: str | None = None) -> str:
    """Start a run; return the execution ARN (for an upload: the one the upload started).

    `name`: the execution's name (api), or the manifest's file name under manifests/ (upload)."""
    document = _document_text(manifest)
    sfn = session.client("stepfunctions")
    if api:
        kwargs: dict[str, Any] = {"stateMachineArn": session.pipeline_arn(), "input": document}
        if name:
            kwargs["name"] = name
        try:
            return str(sfn.start_execution(**kwargs)["executionArn"])
        except ClientError as exc:
            error = exc.response.get("Error", {})
            raise SdflowError(f"StartExecution refused the run ({error.get('Code')}): {error.get('Message')}") from None
    bucket, pipeline = session.data_bucket(), session.pipeline_arn()
    s3 = session.client("s3")
    before = {e["executionArn"] for e in executions(sfn, pipeline)}
    key = _manifest_key(manifest, name)
    put = s3.put_object(Bucket=bucket, Key=key, Body=document.encode(), ContentType="application/json")
    upload = (f"s3://{bucket}/{key}", put.get("VersionId"), str(put.get("ETag", "")).strip('"'))
    deadline = time.monotonic() + UPLOAD_START_TIMEOUT_S
    while time.monotonic() < deadline:
        for item in executions(sfn, pipeline):
            if item["executionArn"] not in before and _started_by(s3, bucket, item["name"], upload):
                return str(item["executionArn"])
        _raise_if_rejected(s3, bucket, key, upload[1])
        time.sleep(0.5)
    raise SdflowError(
        f"no execution started within {UPLOAD_START_TIMEOUT_S:.0f} s of uploading s3://{bucket}/{key}: is the "
        "stack's manifest rule enabled? `sdflow status` shows the newest run if it started later"
    )


def _started_by(s3: Any, bucket: str, name: str, upload: tuple[str, str | None, str]) -> bool:
    """Whether this upload started execution `name`: StartPipeline writes the marker before starting it,
    so another upload (or an API start) at the same moment is told apart."""
    uri, version_id, etag = upload
    try:
        marker = json.loads(s3.get_object(Bucket=bucket, Key=source_key(name))["Body"].read())
    except ClientError as exc:
        # No marker: a run started by StartExecution. A marker the caller may not read: trust the timing.
        return exc.response.get("Error", {}).get("Code") not in ("NoSuchKey", "404")
    if marker.get("manifest") != uri:
        return False
    if version_id:
        return bool(marker.get("version_id") == version_id)
    return str(marker.get("etag") or "").strip('"') == etag


def _raise_if_rejected(s3: Any, bucket: str, key: str, version_id: str | None) -> None:
    report_key = rejected_key(key)
    try:
        report = json.loads(s3.get_object(Bucket=bucket, Key=report_key)["Body"].read())
    except (ClientError, ValueError):
        return
    if version_id and report.get("version_id") not in (None, version_id):
        return  # an earlier upload's report
    problems = "\n".join(f"  {e.get('field')}: {e.get('message')}" for e in report.get("errors", []))
    uri = f"s3://{bucket}/{report_key}"
    raise ManifestRejected(f"manifest rejected ({uri}); fix these and start it again:\n{problems}", report, uri)


def resume_name(old_name: str, now: datetime | None = None) -> str:
    """`<old name>-resume-<UTC time>`; a resumed run's own suffix is replaced, not stacked."""
    suffix = f"-resume-{(now or datetime.now(UTC)):%Y%m%dT%H%M%S}"
    base = RESUME_SUFFIX.sub("", old_name)
    return base[: MAX_EXECUTION_NAME - len(suffix)] + suffix


def start_resume(session: Session, execution: str, *, manifest: Document | None = None, name: str | None = None) -> str:
    """StartExecution of a run that resumes `execution`: its input (or the new document) with
    `resume_from` set. Validate run decides what is reused; returns the new execution's ARN."""
    old_arn = resolve_execution(session, execution)
    old = describe(session, old_arn)
    if old["status"] in UNFINISHED:
        raise SdflowError(
            f"execution {old['name']} is {old['status']}; resume only from an execution that has ended: "
            f"wait for it, or stop it with `aws stepfunctions stop-execution --execution-arn {shlex.quote(old_arn)}`"
        )
    source = f"the input of {old['name']}" if manifest is None else str(manifest)
    try:
        if isinstance(manifest, Path):
            document = json.loads(manifest.read_text())
        else:
            document = json.loads(old.get("input") or "{}") if manifest is None else dict(manifest)
    except (OSError, ValueError) as exc:
        raise SdflowError(f"cannot read a run document from {source}: {exc}") from None
    if not isinstance(document, dict):
        raise SdflowError(f"{source} is not a JSON object (a run document)")
    document["resume_from"] = old_arn
    response = session.client("stepfunctions").start_execution(
        stateMachineArn=old["stateMachineArn"], name=name or resume_name(old["name"]), input=json.dumps(document)
    )
    return str(response["executionArn"])


def follow(
    session: Session, execution_arn: str, *, interval_s: float = 1.0, timeout_s: float | None = None
) -> Iterator[progress_mod.Progress]:
    """A snapshot of the run every `interval_s` until it has ended (the last one yielded is final);
    WaitTimeout once `timeout_s` has passed with the run still going."""
    sfn, s3, bucket = session.client("stepfunctions"), session.client("s3"), session.data_bucket()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        snap = progress_mod.snapshot(sfn, s3, bucket, execution_arn, session.workdir)
        yield snap
        if snap.finished:
            return
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise WaitTimeout(
                f"run {execution_arn.rsplit(':', 1)[-1]} still {snap.status} after {timeout_s} s: wait again, or "
                f"stop it with `aws stepfunctions stop-execution --execution-arn {shlex.quote(execution_arn)}`"
            )
        time.sleep(interval_s if left is None else min(interval_s, left))
