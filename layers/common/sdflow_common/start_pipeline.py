"""Turn an uploaded run manifest into a Step Functions execution, or into a rejection report.

Triggered by S3's EventBridge "Object Created" event for `manifests/*.json`. The execution name
is derived from the object's identity (bucket, key, version or ETag), so a redelivered event
maps to the same name and Step Functions refuses to start the run twice."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import unquote_plus

from botocore.exceptions import ClientError

from sdflow_common import aws
from sdflow_common.errors import InvalidRunDocument
from sdflow_common.run_document import MAX_DOCUMENT_BYTES, parse_run_document

log = logging.getLogger(__name__)

MANIFEST_PREFIX = "manifests/"
REJECTED_PREFIX = "rejected/"
EXECUTION_NAME_MAX = 80
HASH_CHARS = 16
# Room for the slug: the name is `<slug>-<hash>`.
SLUG_MAX = EXECUTION_NAME_MAX - HASH_CHARS - 1
SNS_SUBJECT_MAX = 100
# The manifest is read whole; anything much larger than a valid document cannot be one.
MAX_MANIFEST_BYTES = 4 * MAX_DOCUMENT_BYTES

Status = Literal["started", "duplicate", "rejected", "ignored", "superseded", "gone"]


@dataclass(frozen=True)
class ManifestRef:
    """Which object version the event is about (what the execution name is derived from)."""

    bucket: str
    key: str
    version_id: str | None = None
    etag: str | None = None

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


@dataclass(frozen=True)
class Outcome:
    status: Status
    execution_name: str | None = None
    execution_arn: str | None = None
    errors: list[dict[str, str]] | None = None
    report_key: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status}
        for name in ("execution_name", "execution_arn", "errors", "report_key"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


def _slug(text: str) -> str:
    slug = re.sub(r"[^0-9A-Za-z_-]+", "-", text).strip("-_")
    return slug[:SLUG_MAX].rstrip("-_") or "run"


def execution_name(ref: ManifestRef, run_name: str | None = None) -> str:
    """`<readable slug>-<16 hex chars>`: ≤ 80 chars of [0-9A-Za-z_-], the same for the same object version.

    The hash covers bucket, key and version (ETag when the bucket is unversioned), so re-uploading a
    manifest (a new version, or new content) is a new run while a redelivered event is not."""
    identity = f"{ref.bucket}/{ref.key}@{ref.version_id or ref.etag or ''}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:HASH_CHARS]
    readable = run_name or ref.key.removeprefix(MANIFEST_PREFIX).removesuffix(".json")
    return f"{_slug(readable)}-{digest}"


def rejected_key(manifest_key: str) -> str:
    return f"{REJECTED_PREFIX}{manifest_key}.errors.json"


def _execution_arn(state_machine_arn: str, name: str) -> str:
    return state_machine_arn.replace(":stateMachine:", ":execution:", 1) + f":{name}"


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _problem(message: str) -> list[dict[str, str]]:
    return [{"field": "(document)", "message": message}]


class _Vanished(Exception):
    """The announced object is no longer there to read; carries the outcome to report."""

    def __init__(self, status: Status) -> None:
        super().__init__(status)
        self.status: Status = status


def _read_manifest(ref: ManifestRef) -> tuple[bytes, ManifestRef]:
    """The object's bytes and its identity completed from S3's answer.

    _Vanished when it was deleted or overwritten in the meantime (a later upload has its own event);
    InvalidRunDocument when it is far too large to be a run document."""
    s3 = aws.client("s3")
    kwargs: dict[str, Any] = {"Bucket": ref.bucket, "Key": ref.key}
    if ref.version_id:
        kwargs["VersionId"] = ref.version_id
    elif ref.etag:
        # Unversioned bucket: read exactly the object the event announced, not a later overwrite.
        kwargs["IfMatch"] = f'"{ref.etag}"'
    try:
        try:
            response = s3.get_object(**kwargs)
        except ClientError as exc:
            # S3 event notifications URL-encode the key ("my run.json" arrives as "my+run.json");
            # try the literal key first because "+" is also a legal character in a key. Without
            # s3:ListBucket a missing key answers AccessDenied, so that code tries the decoded key too.
            decoded = unquote_plus(ref.key)
            if _error_code(exc) not in ("NoSuchKey", "404", "AccessDenied", "403") or decoded == ref.key:
                raise
            response = s3.get_object(**{**kwargs, "Key": decoded})
            ref = ManifestRef(ref.bucket, decoded, ref.version_id, ref.etag)
    except ClientError as exc:
        code = _error_code(exc)
        if code in ("PreconditionFailed", "412"):
            log.warning("manifest %s was overwritten before it was read; its newer upload starts the run", ref.uri)
            raise _Vanished("superseded") from exc
        if code in ("NoSuchKey", "NoSuchVersion", "404"):
            log.warning("manifest %s was deleted before it was read; nothing to start", ref.uri)
            raise _Vanished("gone") from exc
        raise
    etag = ref.etag or str(response.get("ETag", "")).strip('"') or None
    version_id = ref.version_id or _real_version(response.get("VersionId"))
    completed = ManifestRef(ref.bucket, ref.key, version_id, etag)
    size = int(response.get("ContentLength") or 0)
    if size > MAX_MANIFEST_BYTES:
        response["Body"].close()
        message = f"is {size} bytes; a run document is at most {MAX_DOCUMENT_BYTES} (use `dataset.prefix`)"
        raise InvalidRunDocument(json.dumps(_problem(message)))
    return response["Body"].read(), completed


def _real_version(version_id: Any) -> str | None:
    # Unversioned objects report the literal version "null"; it identifies nothing.
    return version_id if version_id and version_id != "null" else None


def decode_manifest(body: bytes) -> Any:
    """JSON from the object's bytes; InvalidRunDocument (with a position) when it is not JSON."""
    if not body.strip():
        raise InvalidRunDocument(json.dumps(_problem("is empty; upload a JSON run document")))
    try:
        return json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InvalidRunDocument(
            json.dumps(_problem(f"is not UTF-8 text (byte {exc.start}); save the file as UTF-8 JSON"))
        ) from exc
    except json.JSONDecodeError as exc:
        raise InvalidRunDocument(
            json.dumps(
                _problem(
                    f"is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}; "
                    "fix the syntax (e.g. `python -m json.tool FILE`) and upload it again"
                )
            )
        ) from exc


def rejection_message(manifest_uri: str, errors: list[dict[str, str]], report_uri: str) -> tuple[str, str]:
    """(subject, body) of the notification a user reads when a manifest is refused."""
    name = manifest_uri.rsplit("/", 1)[-1]
    subject = f"[sdflow] Run manifest rejected: {name}"
    # SNS subjects: ≤ 100 printable ASCII characters, no line breaks.
    subject = re.sub(r"[^\x20-\x7e]", "?", subject)[:SNS_SUBJECT_MAX]
    lines = [
        f"The run manifest {manifest_uri} was rejected; no run was started.",
        "",
        f"{len(errors)} problem(s):",
    ]
    lines += [f"  - {error['field']}: {error['message']}" for error in errors]
    lines += [
        "",
        "How to fix: correct the fields above (docs/run-document.md lists every field, its default and",
        "its allowed range; schemas/run-document.schema.json validates a manifest in your editor), then",
        "upload the manifest again under manifests/. The upload starts the run.",
        "",
        f"This report is also stored at {report_uri}.",
    ]
    return subject, "\n".join(lines)


def _reject(ref: ManifestRef, errors: list[dict[str, str]], topic_arn: str) -> Outcome:
    report_key = rejected_key(ref.key)
    report_uri = f"s3://{ref.bucket}/{report_key}"
    report = {
        "manifest": ref.uri,
        "version_id": ref.version_id,
        "errors": errors,
        "rejected_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    aws.client("s3").put_object(
        Bucket=ref.bucket,
        Key=report_key,
        Body=json.dumps(report, indent=2).encode(),
        ContentType="application/json",
    )
    subject, message = rejection_message(ref.uri, errors, report_uri)
    aws.client("sns").publish(
        TopicArn=topic_arn,
        Subject=subject,
        Message=message,
        MessageAttributes={
            "outcome": {"DataType": "String", "StringValue": "rejected"},
            "manifest": {"DataType": "String", "StringValue": ref.uri},
        },
    )
    log.warning("rejected manifest %s: %s", ref.uri, json.dumps(errors))
    return Outcome("rejected", errors=errors, report_key=report_key)


def _already_started(execution_arn: str) -> bool:
    """Whether this name has run before (StartExecution's own idempotency hides a running duplicate)."""
    try:
        aws.client("stepfunctions").describe_execution(executionArn=execution_arn)
    except ClientError as exc:
        if _error_code(exc) == "ExecutionDoesNotExist":
            return False
        raise
    return True


def handle_manifest(ref: ManifestRef, *, state_machine_arn: str, topic_arn: str, max_shards: int) -> Outcome:
    """Start one execution for a valid manifest; write a report and notify for an invalid one.

    An invalid manifest is an outcome, not an exception: EventBridge retries a failed asynchronous
    invocation, and a retry would only reject the same bytes again and notify the user twice."""
    if not ref.key.startswith(MANIFEST_PREFIX) or not ref.key.endswith(".json"):
        log.info("ignoring %s: only manifests/*.json start runs", ref.uri)
        return Outcome("ignored")
    try:
        body, ref = _read_manifest(ref)
    except _Vanished as vanished:
        return Outcome(vanished.status)
    except InvalidRunDocument as exc:
        return _reject(ref, json.loads(str(exc)), topic_arn)
    try:
        raw = decode_manifest(body)
        document = parse_run_document(raw, max_shards=max_shards)
    except InvalidRunDocument as exc:
        return _reject(ref, json.loads(str(exc)), topic_arn)

    name = execution_name(ref, document.run_name)
    arn = _execution_arn(state_machine_arn, name)
    if _already_started(arn):
        log.info("manifest %s already started %s; duplicate event ignored", ref.uri, arn)
        return Outcome("duplicate", execution_name=name, execution_arn=arn)
    try:
        response = aws.client("stepfunctions").start_execution(
            stateMachineArn=state_machine_arn,
            name=name,
            # The document as uploaded, so a direct StartExecution and an upload run the same input.
            input=json.dumps(raw, separators=(",", ":")),
        )
    except ClientError as exc:
        if _error_code(exc) == "ExecutionAlreadyExists":
            # Two deliveries of the same event raced past the check above.
            log.info("manifest %s: execution %s already exists; duplicate event ignored", ref.uri, name)
            return Outcome("duplicate", execution_name=name, execution_arn=arn)
        raise
    log.info("manifest %s started %s", ref.uri, response["executionArn"])
    return Outcome("started", execution_name=name, execution_arn=response["executionArn"])
