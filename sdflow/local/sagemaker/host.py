"""The host side of the local SageMaker: what a job's container sees and how it is moved.

- the errors a job or endpoint can end with;
- /opt/ml paths inside the container mapped to a host's work folder;
- S3 transfers in and out (File mode inputs, EndOfJob outputs, model.tar.gz).

Container processes (their log, their end, stopping them) are in sdflow/local/sagemaker/container.py;
sdflow.local.sagemaker.engine runs jobs and endpoints with these pieces."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import tarfile
import threading
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from botocore.config import Config
from botocore.exceptions import ClientError

from sdflow.local import sessions

LOG = logging.getLogger("sdflow.local.sagemaker")

CONTAINER_OPT_ML = "/opt/ml"
REASON_LIMIT = 1024  # SageMaker keeps the first 1,024 characters of FailureReason / ExitMessage
# A container path argument: /opt/ml as a whole path component, not part of a longer name.
CONTAINER_PATH = re.compile(r"(?<![\w.-])/opt/ml(?![\w.-])")


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------


class LocalSageMakerError(RuntimeError):
    """The local SageMaker cannot do what was asked."""


class JobSetupError(LocalSageMakerError):
    """A request field cannot be honoured (bad S3 URI, unsupported option, no input objects);
    the message becomes the job's FailureReason after "ClientError: ", as on SageMaker."""


class JobAlreadyRunning(LocalSageMakerError):
    """A job with this name is still running."""


class EndpointNotFound(LocalSageMakerError, LookupError):
    """No serve process answers for this endpoint (never deployed, failed, or deleted)."""


class EndpointUnreachable(LocalSageMakerError):
    """The endpoint's serve process did not answer (it died or hung)."""


class ContainerError(LocalSageMakerError):
    """The serve container answered POST /invocations with an error status; the caller turns
    it into SageMaker Runtime's ModelError (OriginalStatusCode, OriginalMessage)."""

    def __init__(self, endpoint_name: str, status: int, body: bytes, content_type: str | None) -> None:
        self.endpoint_name = endpoint_name
        self.status = status
        self.body = body
        self.content_type = content_type
        super().__init__(f"endpoint {endpoint_name} answered {status}: {body[:500].decode('utf-8', errors='replace')}")


class DeploymentFailed(LocalSageMakerError):
    """A new serve process did not become healthy."""


# ---------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------


class LocalSageMakerHalf:
    """What LocalSageMaker (sagemaker/engine.py) gives both of its halves, the training jobs
    (sagemaker/training.py) and the endpoints (sagemaker/endpoints.py): declared once, for the
    type checker; LocalSageMaker defines them."""

    python: str
    stop_grace_s: float
    _lock: threading.RLock

    def python_for(self, image_uri: str | None) -> str:
        raise NotImplementedError

    def _report(self, kind: Any, name: str, status: str, fields: dict[str, Any]) -> None:
        raise NotImplementedError

    def _environment(
        self,
        opt_ml: Path,
        request_env: Mapping[str, str] | None,
        fixed: Mapping[str, str],
        role_arn: str | None = None,
        python: str | None = None,
    ) -> dict[str, str]:
        raise NotImplementedError

    def _entrypoint(self, name: str, field_name: str) -> Path:
        raise NotImplementedError


def utc_now() -> datetime:
    """SageMaker's timestamps (job start and end, events) on the local cloud's clock."""
    from sdflow.local.runtime import current_clock  # the runtime imports the local SageMaker's modules

    return current_clock().now()


def clip_reason(text: str, limit: int = REASON_LIMIT) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def parse_s3_uri(uri: str, field_name: str) -> tuple[str, str]:
    if not isinstance(uri, str) or not uri.startswith("s3://") or len(uri) <= 5:
        raise JobSetupError(f"{field_name} must be an s3://bucket/key URI, got {uri!r}")
    bucket, _, key = uri[5:].partition("/")
    if not bucket:
        raise JobSetupError(f"{field_name} has no bucket name: {uri!r}")
    return bucket, key


def container_path(path: str, opt_ml: Path, field_name: str) -> Path:
    """Where a container path under /opt/ml lives in this job's folder."""
    clean = os.path.normpath(path)
    if clean != CONTAINER_OPT_ML and not clean.startswith(CONTAINER_OPT_ML + "/"):
        raise JobSetupError(f"{field_name} must be a path under {CONTAINER_OPT_ML}, got {path!r}")
    return opt_ml / os.path.relpath(clean, CONTAINER_OPT_ML)


def rewrite_container_paths(argument: str, opt_ml: Path) -> str:
    """`--output /opt/ml/processing/output` → the job's own folder (also inside `--x=/opt/ml/…`)."""
    return CONTAINER_PATH.sub(lambda _m: str(opt_ml), argument)


def relative_key(key: str, prefix: str) -> str:
    """The object's path below the channel: what follows the prefix, or (a prefix that is
    part of a name, e.g. a single object) what follows the prefix's last '/'."""
    if key == prefix:
        return key.rsplit("/", 1)[-1]
    if prefix == "" or prefix.endswith("/"):
        return key[len(prefix) :]
    if key.startswith(prefix + "/"):
        return key[len(prefix) + 1 :]
    return key[prefix.rfind("/") + 1 :]


def link_or_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def read_text_or_none(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None
    return text or None


# ---------------------------------------------------------------------------------------
# The local S3, through boto3
# ---------------------------------------------------------------------------------------


class S3Transfer:
    def __init__(self, endpoint_url: str, region: str, credentials: Mapping[str, str] | None = None) -> None:
        keys = credentials or {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        session = sessions.session(
            aws_access_key_id=keys["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"],
            aws_session_token=keys.get("AWS_SESSION_TOKEN"),
            region_name=region,
        )
        self.client = session.client(
            "s3",
            endpoint_url=endpoint_url,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 3, "mode": "standard"}),
        )

    def list_keys(self, uri: str, field_name: str) -> tuple[str, str, list[str]]:
        bucket, prefix = parse_s3_uri(uri, field_name)
        keys: list[str] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                keys.extend(o["Key"] for o in page.get("Contents", []) if not o["Key"].endswith("/"))
        except self.client.exceptions.NoSuchBucket:
            raise JobSetupError(f"{field_name} {uri}: bucket {bucket!r} does not exist") from None
        return bucket, prefix, sorted(keys)

    def download_prefix(self, uri: str, dest: Path, field_name: str) -> list[str]:
        """Every object under the prefix into `dest`, keeping the paths below the prefix;
        returns the relative paths (none found → JobSetupError, as SageMaker refuses too)."""
        bucket, prefix, keys = self.list_keys(uri, field_name)
        if not keys:
            raise JobSetupError(f"no S3 objects found under {field_name} {uri}")
        dest.mkdir(parents=True, exist_ok=True)
        names = []
        for key in keys:
            rel = relative_key(key, prefix)
            target = (dest / rel).resolve()
            if not target.is_relative_to(dest.resolve()):
                raise JobSetupError(f"S3 key {key!r} under {field_name} would escape the channel folder")
            target.parent.mkdir(parents=True, exist_ok=True)
            self.client.download_file(bucket, key, str(target))
            names.append(rel)
        return names

    def download_input(self, data_type: str, uri: str, dest: Path, field_name: str) -> list[str]:
        """A File-mode S3 input of either S3DataType a training channel or a processing input takes."""
        if data_type == "S3Prefix":
            return self.download_prefix(uri, dest, field_name)
        if data_type == "ManifestFile":
            return self.download_manifest(uri, dest, field_name)
        raise JobSetupError(
            f"{field_name}: S3DataType {data_type!r} is not supported locally; use S3Prefix or ManifestFile"
        )

    def download_manifest(self, uri: str, dest: Path, field_name: str) -> list[str]:
        """S3DataType ManifestFile (SageMaker API Reference, S3DataSource): `uri` is a JSON array
        `[{"prefix": "s3://bucket/some/prefix/"}, "relative/key", ...]`; SageMaker appends each suffix to
        the prefix, and the complete set of those objects is the input, each copied into `dest` under its
        suffix. Every object must be readable by the job's role: this client holds the role's
        credentials, so the local IAM checks s3:GetObject on the manifest and on each object, and a
        missing or unreadable object fails the job (a ClientError FailureReason), as SageMaker's does."""
        bucket, key = parse_s3_uri(uri, field_name)
        try:
            body = self.client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as exc:
            raise JobSetupError(f"{field_name} {uri}: the manifest cannot be read: {_s3_error(exc)}") from None
        prefix_bucket, prefix_key, suffixes = parse_manifest(body, uri, field_name)
        dest.mkdir(parents=True, exist_ok=True)
        root = dest.resolve()
        for suffix in suffixes:
            target = (dest / suffix).resolve()
            if not target.is_relative_to(root) or target == root:
                raise JobSetupError(
                    f"manifest {uri} entry {suffix!r} (in {field_name}) would escape the channel folder"
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            source = f"s3://{prefix_bucket}/{prefix_key}{suffix}"
            try:
                stream = self.client.get_object(Bucket=prefix_bucket, Key=prefix_key + suffix)["Body"]
                with stream, target.open("wb") as out:
                    shutil.copyfileobj(stream, out, 1 << 20)
            except ClientError as exc:
                raise JobSetupError(
                    f"Data download failed: {source}, listed in the manifest {uri} ({field_name}), cannot be read: "
                    f"{_s3_error(exc)}"
                ) from None
        return suffixes

    def upload_dir(self, source: Path, uri: str, field_name: str) -> int:
        bucket, prefix = parse_s3_uri(uri, field_name)
        base = prefix if prefix == "" or prefix.endswith("/") else prefix + "/"
        count = 0
        if not source.is_dir():
            return 0
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            self.client.upload_file(str(path), bucket, base + path.relative_to(source).as_posix())
            count += 1
        return count

    def download_file(self, uri: str, dest: Path, field_name: str) -> None:
        bucket, key = parse_s3_uri(uri, field_name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.client.download_file(bucket, key, str(dest))
        except self.client.exceptions.ClientError as exc:
            raise JobSetupError(f"{field_name} {uri} cannot be read: {exc}") from None

    def upload_file(self, source: Path, uri: str, field_name: str) -> None:
        bucket, key = parse_s3_uri(uri, field_name)
        self.client.upload_file(str(source), bucket, key)


def _s3_error(exc: ClientError) -> str:
    error = exc.response.get("Error", {})
    return f"{error.get('Code', '?')}: {error.get('Message', '')}".rstrip(": ")


def parse_manifest(body: bytes, uri: str, field_name: str) -> tuple[str, str, list[str]]:
    """(bucket, key prefix, suffixes) of a ManifestFile, checked as the S3DataSource reference
    describes it: a JSON array, its first element `{"prefix": <a valid non-empty S3 URI>}` (one bucket
    for every object), followed by one or more suffixes. A suffix listed twice is one object."""
    where = f"{field_name} manifest {uri}"
    try:
        document = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise JobSetupError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(document, list) or not document:
        raise JobSetupError(f'{where} must be a JSON array: [{{"prefix": "s3://bucket/prefix/"}}, "key", ...]')
    head = document[0]
    if not isinstance(head, dict) or not isinstance(head.get("prefix"), str):
        raise JobSetupError(f'{where}: its first element must be {{"prefix": "s3://bucket/prefix/"}}, got {head!r}')
    bucket, prefix_key = parse_s3_uri(head["prefix"], f"{where} prefix")
    suffixes = document[1:]
    if not suffixes:
        raise JobSetupError(f"{where} lists no objects after its prefix: at least one relative key is required")
    for position, suffix in enumerate(suffixes, start=1):
        if not isinstance(suffix, str) or not suffix:
            raise JobSetupError(
                f"{where}: element {position} must be a non-empty key relative to the prefix, got {suffix!r}"
            )
    return bucket, prefix_key, list(dict.fromkeys(suffixes))


def tar_folder(folder: Path, archive: Path) -> None:
    """SageMaker's model.tar.gz: the folder's contents at the archive's root."""
    with tarfile.open(archive, "w:gz", compresslevel=6) as tar:
        for child in sorted(folder.iterdir()) if folder.is_dir() else []:
            tar.add(child, arcname=child.name)
