"""Resume: a new run (`resume_from` = an earlier execution of this pipeline) reuses what that run
finished and what is still valid, instead of downloading 10,000 shards again after a training failure.

- A shard is reused when its cache key equals the key of a shard the earlier run downloaded and whose
  `_SUCCESS` marker still exists. The key hashes the parquet object's identity (its S3 version, or its
  ETag where the object has none) with the download options that change what a shard holds, so an
  overwritten parquet file or a changed option downloads again.
- The trained model is reused when every shard is reused, the training inputs (base model, training
  options, the shard set) are unchanged, the earlier run's "Train model" (or "Reuse trained model")
  state ended with `$.training`, and that model artifact still exists.

Chains work: a resumed run's shards.json points its reused shards at the older run's folders, and a
resumed run that reused a model exits "Reuse trained model" with the same `$.training`."""

from __future__ import annotations

import hashlib
import json
import logging
import shlex
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from botocore.exceptions import ClientError
from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

from sdflow_common import aws, dataset_files, model_artifact, names
from sdflow_common.run_document import RunDocument, invalid, parse_s3_uri

log = logging.getLogger(__name__)

# Download options that decide what a shard holds (img2dataset's resize and tar layout). The others
# (instance type, processes, threads, URL timeout, runtime, concurrency, tolerance) decide how fast or
# whether a job finishes; a shard whose job wrote `_SUCCESS` holds the same samples whatever they were.
SHARD_CONTENT_OPTIONS = ("image_size", "resize_mode", "samples_per_shard")
SUCCESS_MARKER = "_SUCCESS"
# States whose exit carries `$.training`: the training task, and the Pass of a run that reused a model.
TRAINING_STATES = ("Train model", "Reuse trained model")
# Executions still going: RUNNING, or PENDING_REDRIVE (a redrive was accepted and is about to run)
# (ExecutionStatus, Step Functions API Reference).
UNFINISHED = ("RUNNING", "PENDING_REDRIVE")
LIST_PAGE_SIZE = 1000  # S3's maximum; tests lower it to exercise pagination
HISTORY_PAGE_SIZE = 1000  # GetExecutionHistory's maximum (its default is 100)
HEAD_WORKERS = 16


class ResumeInfo(BaseModel):
    """`$.config.resume`: where this run came from and what it reuses. `training` (the earlier run's
    `$.training`) is present only when the model is reused: the state machine's Choice tests IsPresent."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    from_execution_arn: str
    shards_reused: int
    shards_total: int
    training_reused: bool
    training: dict[str, Any] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent_training(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("training") is None:
            data.pop("training", None)
        return data


# ------------------------------------------------------------------------------ resume_from


def pipeline_of(execution_arn: str) -> str:
    """`arn:…:execution:<pipeline>:<name>` → `arn:…:stateMachine:<pipeline>`."""
    head, _, rest = execution_arn.partition(":execution:")
    machine = rest.rsplit(":", 1)[0]
    return f"{head}:stateMachine:{machine}"


def _resume_problem(message: str) -> Exception:
    return invalid([{"field": "resume_from", "message": message}])


def check_resume_from(resume_from: str, execution_arn: str) -> dict[str, Any]:
    """DescribeExecution of the earlier run, after checking it is an ended execution of this pipeline.

    The ARN is compared before any call: the function may describe only its own pipeline's executions."""
    pipeline = pipeline_of(execution_arn)
    if resume_from == execution_arn:
        raise _resume_problem("names this execution itself; give the ARN of an earlier execution of this pipeline")
    if pipeline_of(resume_from) != pipeline or ":execution:" not in resume_from:
        raise _resume_problem(
            f"'{resume_from}' is not an execution of this pipeline ({pipeline}); list its executions with "
            f"`aws stepfunctions list-executions --state-machine-arn {shlex.quote(pipeline)}` "
            "and give one of their ARNs"
        )
    try:
        described: dict[str, Any] = aws.client("stepfunctions").describe_execution(executionArn=resume_from)
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("ExecutionDoesNotExist", "InvalidArn"):
            # ExecutionDoesNotExist also answers for executions past Step Functions' 90-day retention.
            raise _resume_problem(
                f"no execution '{resume_from}' exists ({code}; Step Functions keeps a closed execution for "
                "90 days); check the ARN, or start the run without resume_from"
            ) from exc
        raise
    status = str(described.get("status", ""))
    if status in UNFINISHED:
        raise _resume_problem(
            f"execution '{names.execution_name(resume_from)}' is {status}; resume only from an execution that "
            f"has ended: wait for it, or stop it with `aws stepfunctions stop-execution --execution-arn "
            f"{shlex.quote(resume_from)}`"
        )
    return described


# ------------------------------------------------------------------------------ shard cache keys


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def shard_content_digest(document: RunDocument) -> str:
    """A stable hash of everything besides the parquet object that decides a shard's content."""
    options = {name: getattr(document.download, name) for name in SHARD_CONTENT_OPTIONS}
    columns: dict[str, Any] = {
        "url_column": document.dataset.url_column,
        "caption_column": document.dataset.caption_column,
    }
    # Filters decide which rows a shard holds; only when set, so that unfiltered shards keep their keys.
    if document.dataset.filters is not None:
        columns["filters"] = document.dataset.filters.job_arguments(document.dataset.caption_column)
    return _digest({"download": options, "dataset": columns})


def shard_cache_key(parquet_uri: str, identity: str, content_digest: str) -> str:
    """sha256 over the object's bucket and key, its identity (version or ETag) and the content digest."""
    bucket, key = parse_s3_uri(parquet_uri)
    return _digest({"bucket": bucket, "key": key, "object": identity, "content": content_digest})


def _identity(version_id: str | None, etag: str | None) -> str:
    # Objects written while the bucket was unversioned have the version "null": the ETag names them.
    if version_id and version_id != "null":
        return f"version:{version_id}"
    return f"etag:{(etag or '').strip(chr(34))}"


def _head_identity(uri: str) -> str:
    bucket, key = parse_s3_uri(uri)
    head = aws.client("s3").head_object(Bucket=bucket, Key=key)
    return _identity(head.get("VersionId"), head.get("ETag"))


def _listed_identities(prefix_uri: str) -> dict[str, str]:
    """The latest version of every object below the prefix, from ListObjectVersions pages (1,000
    objects a request, where HeadObject would cost one request per shard). On an unversioned bucket
    every version is "null" and the ETag identifies the object."""
    bucket, key = parse_s3_uri(prefix_uri)
    folder = key if key.endswith("/") else f"{key}/"
    paginator = aws.client("s3").get_paginator("list_object_versions")
    found: dict[str, str] = {}
    for page in paginator.paginate(Bucket=bucket, Prefix=folder, PaginationConfig={"PageSize": LIST_PAGE_SIZE}):
        for version in page.get("Versions", []):
            if version.get("IsLatest"):
                found[f"s3://{bucket}/{version['Key']}"] = _identity(version.get("VersionId"), version.get("ETag"))
    return found


def object_identities(parquet_uris: list[str], prefix_uri: str | None) -> dict[str, str]:
    """Each parquet object's identity: one listing for a prefix dataset, HeadObject for a listed one
    (a document lists at most a few thousand objects) and for any object the listing missed."""
    found = _listed_identities(prefix_uri) if prefix_uri is not None else {}
    missing = [uri for uri in parquet_uris if uri not in found]
    if missing:
        aws.client("s3")  # create the cached client before the threads share it
        with ThreadPoolExecutor(max_workers=HEAD_WORKERS) as pool:
            found.update(zip(missing, pool.map(_head_identity, missing), strict=True))
    return {uri: found[uri] for uri in parquet_uris}


def add_cache_keys(shards: list[dict[str, Any]], document: RunDocument) -> None:
    """Give every shard item its `cache_key` and `cached: false`."""
    identities = object_identities([s["parquet_uri"] for s in shards], document.dataset.prefix)
    content = shard_content_digest(document)
    for shard in shards:
        shard["cache_key"] = shard_cache_key(shard["parquet_uri"], identities[shard["parquet_uri"]], content)
        shard["cached"] = False


# ------------------------------------------------------------------------------ the earlier run


def _read_json(bucket: str, key: str) -> Any:
    try:
        body = aws.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        if dataset_files.missing_or_unreadable(exc):
            return None
        raise
    return json.loads(body)


def _folder(uri: str) -> str:
    return uri if uri.endswith("/") else f"{uri}/"


def finished_outputs(output_uris: Iterable[str]) -> set[str]:
    """The shard folders (as given, with a trailing "/") that hold a `_SUCCESS` marker.

    One paged ListObjectsV2 per parent folder (a run's `dataset/shards/`; a chain of resumes adds one
    per older run), not one HeadObject per shard."""
    wanted = {_folder(uri) for uri in output_uris}
    parents: dict[tuple[str, str], set[str]] = defaultdict(set)
    for uri in wanted:
        bucket, key = parse_s3_uri(uri)
        parent = key.rstrip("/").rsplit("/", 1)[0] + "/" if "/" in key.rstrip("/") else ""
        parents[(bucket, parent)].add(uri)
    paginator = aws.client("s3").get_paginator("list_objects_v2")
    done: set[str] = set()
    for (bucket, parent), folders in parents.items():
        pages = paginator.paginate(Bucket=bucket, Prefix=parent, PaginationConfig={"PageSize": LIST_PAGE_SIZE})
        for page in pages:
            for obj in page.get("Contents", []):
                if obj["Key"].endswith(f"/{SUCCESS_MARKER}"):
                    folder = f"s3://{bucket}/{obj['Key'].removesuffix(SUCCESS_MARKER)}"
                    if folder in folders:
                        done.add(folder)
    return done


def previous_shards(bucket: str, run_id: str) -> list[dict[str, Any]]:
    """The earlier run's shards.json (empty when it ended before Validate run wrote one)."""
    items = _read_json(bucket, f"runs/{run_id}/shards.json")
    return [item for item in items or [] if isinstance(item, dict)]


def previous_document(bucket: str, run_id: str) -> RunDocument | None:
    """The earlier run's normalized document from its run.json ({"execution_arn", "start_time", "run"};
    older runs stored the document itself). None when absent or no longer valid."""
    stored = _read_json(bucket, f"runs/{run_id}/run.json")
    if not isinstance(stored, dict):
        return None
    raw = stored.get("run") if "execution_arn" in stored else stored
    try:
        return RunDocument.model_validate(raw)
    except ValueError:
        log.info("run %s: its run.json no longer parses as a run document; its model is not reused", run_id)
        return None


def previous_training(execution_arn: str) -> dict[str, Any] | None:
    """`$.training` as the earlier execution's last training state exited with it, from its history
    read newest first (GetExecutionHistory reverseOrder), so the scan stops at the end of the run."""
    paginator = aws.client("stepfunctions").get_paginator("get_execution_history")
    pages = paginator.paginate(
        executionArn=execution_arn,
        reverseOrder=True,
        includeExecutionData=True,
        PaginationConfig={"PageSize": HISTORY_PAGE_SIZE},
    )
    for page in pages:
        for event in page.get("events", []):
            details = event.get("stateExitedEventDetails") or {}
            if details.get("name") not in TRAINING_STATES:
                continue
            if (details.get("outputDetails") or {}).get("truncated"):
                return None
            try:
                output = json.loads(details.get("output") or "null")
            except ValueError:
                return None
            training = output.get("training") if isinstance(output, dict) else None
            return training if isinstance(training, dict) and training.get("model_data_url") else None
    return None


def _exists(uri: str) -> bool:
    """The earlier model is still there: its model.tar.gz, or an object under its uncompressed prefix."""
    try:
        bucket, key = parse_s3_uri(uri)
        if model_artifact.is_prefix(uri):
            listed = aws.client("s3").list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)
            return bool(listed.get("KeyCount"))
        aws.client("s3").head_object(Bucket=bucket, Key=key)
    except ValueError:
        return False
    except ClientError as exc:
        if dataset_files.missing_or_unreadable(exc):
            return False
        raise
    return True


def training_digest(document: RunDocument, cache_keys: Iterable[str]) -> str:
    """What a trained model depends on: the base model, every training option, the exact shard set."""
    inputs = {
        "base_model_uri": document.base_model_uri,
        # cache_latents changes where the encodings come from, not what is trained (and leaving it
        # out keeps the digests of runs recorded before it existed).
        "training": document.training.model_dump(mode="json", exclude={"cache_latents"}),
        "shards": sorted(cache_keys),
    }
    return _digest(inputs)


# ------------------------------------------------------------------------------ the plan


def _reusable_training(
    bucket: str,
    document: RunDocument,
    shards: list[dict[str, Any]],
    old_shards: list[dict[str, Any]],
    old: dict[str, Any],
) -> dict[str, Any] | None:
    old_document = previous_document(bucket, str(old["name"]))
    if old_document is None:
        return None
    old_keys = [str(item.get("cache_key")) for item in old_shards]
    if training_digest(document, (s["cache_key"] for s in shards)) != training_digest(old_document, old_keys):
        return None
    training = previous_training(str(old["executionArn"]))
    if training is None or not _exists(str(training["model_data_url"])):
        return None
    return training


def apply_resume(
    document: RunDocument, shards: list[dict[str, Any]], *, bucket: str, execution_arn: str
) -> ResumeInfo | None:
    """Mark the shards the earlier run finished as cached (their output_uri = the earlier folder) and
    decide whether its model is reused. None when the document does not resume."""
    if document.resume_from is None:
        return None
    old = check_resume_from(document.resume_from, execution_arn)
    old_shards = [
        item for item in previous_shards(bucket, str(old["name"])) if item.get("cache_key") and item.get("output_uri")
    ]
    done = finished_outputs(str(item["output_uri"]) for item in old_shards)
    reusable = {
        str(item["cache_key"]): _folder(str(item["output_uri"]))
        for item in old_shards
        if _folder(str(item["output_uri"])) in done
    }
    for shard in shards:
        output = reusable.get(shard["cache_key"])
        if output is not None:
            shard["cached"], shard["output_uri"] = True, output
    reused = sum(1 for shard in shards if shard["cached"])
    training = _reusable_training(bucket, document, shards, old_shards, old) if reused == len(shards) else None
    log.info(
        "resume from %s: %d of %d shards reused, model reused: %s", old["name"], reused, len(shards), bool(training)
    )
    return ResumeInfo(
        from_execution_arn=document.resume_from,
        shards_reused=reused,
        shards_total=len(shards),
        training_reused=training is not None,
        training=training,
    )
