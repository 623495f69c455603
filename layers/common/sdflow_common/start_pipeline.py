"""Turn an uploaded run manifest into a Step Functions execution, or into a rejection report.

Triggered by S3's EventBridge "Object Created" event for `manifests/*.json`. The execution name
is derived from the object's identity (bucket, key, version or ETag), so a redelivered event
maps to the same name and Step Functions refuses to start the run twice.

A manifest starts a run only after the checks Validate run makes (validate_run.prepare_run: the bucket, the
model, every parquet object, every SageMaker request the run will make): whatever fails them is rejected
here, with a report and a notification, and starts nothing. Any problem with the bytes themselves (not UTF-8,
not JSON, nested too deeply, numbers too long to convert) is a rejection too, never an exception: an
exception would send the event to the dead-letter queue and leave the user without an answer."""

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
from sdflow_common.errors import DatasetNotFound, InvalidRunDocument
from sdflow_common.notify import sns_subject
from sdflow_common.run_document import MAX_DOCUMENT_BYTES, bounded, parse_run_document, printable, problems_of
from sdflow_common.validate_run import ValidateRunRequest, prepare_run, run_prefix

log = logging.getLogger(__name__)

MANIFEST_PREFIX = "manifests/"
REJECTED_PREFIX = "rejected/"
EXECUTION_NAME_MAX = 80
HASH_CHARS = 16
# Beside the run's other files: runs/<execution name>/started_by.json (sdflow/console/runs.py reads it).
SOURCE_MARKER = "started_by.json"
# Room for the slug: the name is `<slug>-<hash>`.
SLUG_MAX = EXECUTION_NAME_MAX - HASH_CHARS - 1
# Lines of a rejection notification: SNS messages are limited to 256 KB.
MESSAGE_LINE_MAX = 1000
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


def source_key(execution_name: str) -> str:
    return f"{run_prefix(execution_name)}{SOURCE_MARKER}"


def _record_source(ref: ManifestRef, name: str) -> None:
    """Say that an upload started this run, before it starts: Step Functions keeps no caller, and
    the run console shows "upload" (with the manifest) or "API" from this marker's presence."""
    source = {"source": "upload", "manifest": ref.uri, "version_id": ref.version_id, "etag": ref.etag}
    aws.client("s3").put_object(
        Bucket=ref.bucket, Key=source_key(name), Body=json.dumps(source).encode(), ContentType="application/json"
    )


def rejected_key(manifest_key: str) -> str:
    return f"{REJECTED_PREFIX}{manifest_key}.errors.json"


def _execution_arn(state_machine_arn: str, name: str) -> str:
    return state_machine_arn.replace(":stateMachine:", ":execution:", 1) + f":{name}"


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _problem(message: str) -> list[dict[str, str]]:
    return [{"field": "(document)", "message": message}]


class _TooLarge(Exception):
    """The object is far larger than any run document; it is not read."""

    def __init__(self, ref: ManifestRef, size: int) -> None:
        super().__init__(size)
        self.ref = ref
        self.size = size


class _Vanished(Exception):
    """The announced object is no longer there to read; carries the outcome to report."""

    def __init__(self, status: Status) -> None:
        super().__init__(status)
        self.status: Status = status


def event_keys(key: str) -> list[str]:
    """The object keys an event's key may stand for, the likeliest first.

    S3 URL-encodes the key in the events it sends, EventBridge's "Object Created" included
    ("my run.json" arrives as "my+run.json", "é" as "%C3%A9"); Powertools' S3EventBridgeNotificationObject
    decodes it with unquote_plus for that reason. The literal key comes second, for an emitter that
    sends keys unencoded (a "+" in such a key would otherwise read as a space)."""
    decoded = unquote_plus(key)
    return [decoded] if decoded == key else [decoded, key]


# Answers meaning "no such object (version) under this key".
_MISSING_CODES = ("NoSuchKey", "NoSuchVersion", "404")
# Worth trying the next candidate key: without s3:ListBucket, S3 answers a missing key with 403.
_TRY_NEXT_CODES = (*_MISSING_CODES, "AccessDenied", "403")


def _get_manifest(ref: ManifestRef) -> tuple[dict[str, Any], str]:
    """GetObject of the first candidate key that exists; (response, the key that answered)."""
    s3 = aws.client("s3")
    kwargs: dict[str, Any] = {"Bucket": ref.bucket}
    if ref.version_id:
        kwargs["VersionId"] = ref.version_id
    elif ref.etag:
        # Unversioned bucket: read exactly the object the event announced, not a later overwrite.
        kwargs["IfMatch"] = f'"{ref.etag}"'
    candidates = event_keys(ref.key)
    for position, key in enumerate(candidates):
        try:
            return s3.get_object(Key=key, **kwargs), key
        except ClientError as exc:
            if _error_code(exc) not in _TRY_NEXT_CODES or position == len(candidates) - 1:
                raise
    raise AssertionError("unreachable: the last candidate returns or raises")


def _read_manifest(ref: ManifestRef) -> tuple[bytes, ManifestRef]:
    """The object's bytes and its identity completed from S3's answer (its decoded key included).

    _Vanished when it was deleted or overwritten in the meantime (a later upload has its own event);
    _TooLarge when it is far too large to be a run document."""
    try:
        response, key = _get_manifest(ref)
    except ClientError as exc:
        code = _error_code(exc)
        tried = " or ".join(repr(key) for key in event_keys(ref.key))
        if code in ("PreconditionFailed", "412"):
            log.warning(
                "manifest s3://%s/%s was overwritten before it was read; its newer upload starts the run",
                ref.bucket,
                tried,
            )
            raise _Vanished("superseded") from exc
        if code in _MISSING_CODES:
            log.warning(
                "manifest s3://%s/%s (version %s) is not there (%s): deleted before it was read; nothing to start",
                ref.bucket,
                tried,
                ref.version_id or "-",
                code,
            )
            raise _Vanished("gone") from exc
        raise
    etag = ref.etag or str(response.get("ETag", "")).strip('"') or None
    version_id = ref.version_id or _real_version(response.get("VersionId"))
    completed = ManifestRef(ref.bucket, key, version_id, etag)
    size = int(response.get("ContentLength") or 0)
    if size > MAX_MANIFEST_BYTES:
        response["Body"].close()
        raise _TooLarge(completed, size)
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
    except RecursionError as exc:
        message = "nests arrays or objects too deeply to read; a run document is a few levels deep"
        raise InvalidRunDocument(json.dumps(_problem(message))) from exc
    except ValueError as exc:
        # json.loads refuses integers of more than 4300 digits (CPython's int conversion limit).
        message = f"holds a value that cannot be read ({printable(str(exc), 200)}); fix that value"
        raise InvalidRunDocument(json.dumps(_problem(message))) from exc


def rejection_message(manifest_uri: str, errors: list[dict[str, str]], report_uri: str) -> tuple[str, str]:
    """(subject, body) of the notification a user reads when a manifest is refused."""
    name = manifest_uri.rsplit("/", 1)[-1]
    subject = sns_subject(f"[sdflow] Run manifest rejected: {name}")
    lines = [
        f"The run manifest {manifest_uri} was rejected; no run was started.",
        "",
        f"{len(errors)} problem(s):",
    ]
    lines += [f"  - {error['field']}: {error['message']}"[:MESSAGE_LINE_MAX] for error in bounded(errors)]
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


def handle_manifest(
    ref: ManifestRef, *, state_machine_arn: str, topic_arn: str, max_shards: int, data_bucket: str
) -> Outcome:
    """Start one execution for a valid manifest; write a report and notify for an invalid one.

    An invalid manifest is an outcome, not an exception: EventBridge retries a failed asynchronous
    invocation, and a retry would only reject the same bytes again and notify the user twice."""
    decoded_key = event_keys(ref.key)[0]
    if not decoded_key.startswith(MANIFEST_PREFIX) or not decoded_key.endswith(".json"):
        log.info("ignoring s3://%s/%s: only manifests/*.json start runs", ref.bucket, decoded_key)
        return Outcome("ignored")
    try:
        body, ref = _read_manifest(ref)
    except _Vanished as vanished:
        return Outcome(vanished.status)
    except _TooLarge as large:
        message = f"is {large.size} bytes; a run document is at most {MAX_DOCUMENT_BYTES} (use `dataset.prefix`)"
        return _reject(large.ref, _problem(message), topic_arn)
    try:
        raw = decode_manifest(body)
        name = execution_name(ref, parse_run_document(raw, max_shards=max_shards).run_name)
        arn = _execution_arn(state_machine_arn, name)
        # Validate run's own checks, every request the run will make included, under the name it will run as.
        start = datetime.now(UTC).isoformat(timespec="milliseconds")
        request = ValidateRunRequest(run=raw, execution_name=name, execution_arn=arn, start_time=start)
        prepared = prepare_run(request, data_bucket=data_bucket, max_shards=max_shards)
    except (InvalidRunDocument, DatasetNotFound) as exc:
        return _reject(ref, problems_of(exc), topic_arn)
    for warning in prepared.config["warnings"]:
        log.warning("manifest %s: tolerated: %s: %s", ref.uri, warning["field"], warning["message"])

    if _already_started(arn):
        log.info("manifest %s already started %s; duplicate event ignored", ref.uri, arn)
        return Outcome("duplicate", execution_name=name, execution_arn=arn)
    _record_source(ref, name)
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
