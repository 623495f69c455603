"""The download job's S3 side: each shard img2dataset finishes goes to the shard's S3 prefix at
once, and a retried job learns from that prefix which shards it can skip.

A shard is four files, `NNNNN.tar`, `NNNNN.parquet`, `NNNNN_hashes.parquet` (its samples' hashes,
sdflow_image.download.hashes) and `NNNNN_stats.json`. img2dataset closes
the tar and the parquet before it writes the stats file (`Downloader.download_shard`:
`sample_writer.close()`, then `write_stats`), so a stats file that parses is the sign that the
other two are complete. They are uploaded tar, parquet, hashes, stats: the stats object, uploaded last,
is the shard's own completion marker in S3, and a retry counts a shard as done only when all
four are listed. A single PutObject, and a multipart upload until CompleteMultipartUpload, make
no object visible before the whole body is there, so a killed job never leaves a partial tar at
its key (S3 User Guide, "Uploading and copying objects using multipart upload").

With a held-out rate (--holdout_rate > 0) each finished tar is split before its upload
(sdflow_image.download.holdout_split): the held-out samples go to `holdout/NNNNN.tar`, uploaded
after the tar and before the stats, and the stats file records their count (`holdout_samples`,
a key img2dataset does not write). The stats object stays the last one, and a retry counts the
shard as done only when its held-out tar is listed too (if it holds any).

The stats object carries `x-amz-meta-sdflow-options` (a hash of the options that decide what a
shard holds): a retry with other options does not take shards made with the old ones.

boto3 finds the endpoint (AWS_ENDPOINT_URL, which the local runtime sets) and the job role's
credentials as a container on SageMaker does; the role may s3:ListBucket, s3:GetObject and
s3:PutObject under runs/ (template.yaml, SageMakerExecutionRole) and nothing else, so nothing
here deletes.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdflow_image.download import hashes
from sdflow_image.download.holdout_split import split_tar
from sdflow_image.s3_uri import S3Prefix

SUCCESS_FILE = "_SUCCESS"
SHARD_FILE = re.compile(r"^(\d{5,})(\.tar|_stats\.json|\.parquet)$")
# upload order: the stats file last; the hashes (sdflow_image.download.hashes) before it
SHARD_SUFFIXES = (".tar", ".parquet", hashes.HASHES_SUFFIX, "_stats.json")
OPTIONS_METADATA = "sdflow-options"  # user metadata: S3 returns it as x-amz-meta-sdflow-options
STATS_KEYS = ("count", "successes", "failed_to_download", "failed_to_resize")
HOLDOUT_FOLDER = "holdout/"  # below the shard's prefix, and below img2dataset's folder locally
HOLDOUT_STATS_KEY = "holdout_samples"  # added to img2dataset's stats by the split


class OutputError(RuntimeError):
    """The shard's S3 prefix cannot be read or written; the message names --output_uri."""


def options_hash(options: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:32]


def read_stats(path: Path) -> dict[str, Any] | None:
    """The stats img2dataset wrote, or None while it is still being written (it is not written
    atomically; a prefix of a JSON object never parses, so a parse is a complete file)."""
    try:
        stats = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stats, dict) or not all(isinstance(stats.get(k), int) for k in STATS_KEYS):
        return None
    return stats


def holdout_samples(stats: dict[str, Any]) -> int:
    """The shard's held-out samples: 0 for a shard made without a split."""
    return int(stats.get(HOLDOUT_STATS_KEY, 0))


def holdout_name(stem: str) -> str:
    return f"{HOLDOUT_FOLDER}{stem}.tar"


def s3_client() -> Any:
    import boto3
    from botocore.config import Config

    # Standard retries ride out S3's 503 SlowDown (S3 User Guide, "Best practices design patterns").
    return boto3.client("s3", config=Config(retries={"max_attempts": 8, "mode": "standard"}))


def _describe(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "Error" in response:
        error = response["Error"]
        return f"{error.get('Code', '?')}: {error.get('Message', '')}".rstrip(": ")
    return f"{type(exc).__name__}: {exc}"


@dataclass
class ShardUploader:
    """Uploads finished shards from img2dataset's folder and deletes the local tar and parquet.
    The local stats files stay (a few hundred bytes each): img2dataset's incremental mode skips
    every shard whose stats file is in its folder, and `download` sums them for `_SUCCESS`.
    With `holdout_rate` > 0 each tar is split into its training and held-out parts first."""

    output: S3Prefix
    options: dict[str, Any]
    client: Any = None
    holdout_rate: float = 0.0
    uploaded: set[int] = field(default_factory=set)
    peak_local_tars: int = 0

    def __post_init__(self) -> None:
        if self.client is None:
            self.client = s3_client()
        self.digest = options_hash(self.options)

    def _call(self, action: str, operation: Callable[..., Any], **kwargs: Any) -> Any:
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return operation(**kwargs)
        except (ClientError, BotoCoreError, Boto3Error) as exc:  # upload_file raises S3UploadFailedError
            raise OutputError(
                f"could not {action} {self.output.uri} (--output_uri): {_describe(exc)}. The job's role "
                f"needs s3:ListBucket, s3:GetObject and s3:PutObject there, and the bucket must exist"
            ) from exc

    # --- what S3 already holds ----------------------------------------------------------------

    def _list(self) -> dict[str, int]:
        """Every object below the prefix (holdout/ ones as `holdout/NNNNN.tar`): name -> size."""
        paginator = self.client.get_paginator("list_objects_v2")
        names: dict[str, int] = {}

        def pages() -> list[dict[str, Any]]:
            return list(paginator.paginate(Bucket=self.output.bucket, Prefix=self.output.prefix))

        for page in self._call("list", pages):
            for item in page.get("Contents", []):
                names[item["Key"][len(self.output.prefix) :]] = int(item["Size"])
        return names

    def has_success(self) -> bool:
        return SUCCESS_FILE in self._list()

    def resume(self, shards_dir: Path) -> list[int]:
        """Write the stats of every shard already complete in S3 (made with the same options)
        into img2dataset's folder, so that img2dataset skips them; return their numbers."""
        listed = self._list()
        done = []
        for name in sorted(listed):
            match = SHARD_FILE.match(name)
            if match is None or match.group(2) != "_stats.json":
                continue
            stem = match.group(1)
            if not all(stem + suffix in listed for suffix in SHARD_SUFFIXES):
                continue  # an earlier attempt died between the tar and the stats: redo it
            response = self._call("read", self.client.get_object, Bucket=self.output.bucket, Key=self.output.key(name))
            if response.get("Metadata", {}).get(OPTIONS_METADATA) != self.digest:
                continue  # made with other options: redone and overwritten
            body = response["Body"].read()
            (shards_dir / name).write_bytes(body)
            stats = read_stats(shards_dir / name)
            if stats is None or (holdout_samples(stats) > 0 and holdout_name(stem) not in listed):
                (shards_dir / name).unlink()
                continue  # unreadable, or its held-out part never reached S3: redo it
            done.append(int(stem))
        self.uploaded.update(done)
        return done

    # --- finished shards ------------------------------------------------------------------------

    def sweep(self, shards_dir: Path) -> list[int]:
        """Upload every shard whose stats file is complete and that is not uploaded yet; return
        the numbers of those uploaded now."""
        self.peak_local_tars = max(self.peak_local_tars, sum(1 for _ in shards_dir.glob("*.tar")))
        now = []
        for stats_path in sorted(shards_dir.glob("*_stats.json")):
            match = SHARD_FILE.match(stats_path.name)
            if match is None or int(match.group(1)) in self.uploaded:
                continue
            stats = read_stats(stats_path)
            if stats is None:
                continue  # img2dataset is still writing it
            if self.holdout_rate > 0 and HOLDOUT_STATS_KEY not in stats:
                self._split_shard(shards_dir, match.group(1), stats_path, stats)
            self._hash_shard(shards_dir, match.group(1))
            self._upload_shard(shards_dir, match.group(1))
            self.uploaded.add(int(match.group(1)))
            now.append(int(match.group(1)))
        return now

    def _split_shard(self, shards_dir: Path, stem: str, stats_path: Path, stats: dict[str, Any]) -> None:
        """Split `NNNNN.tar` into itself (training) and `holdout/NNNNN.tar`; record the count in
        the stats file (kept only when it holds samples)."""
        tar = shards_dir / f"{stem}.tar"
        if not tar.exists():
            raise OutputError(f"img2dataset finished shard {stem} without {tar.name}; rerun the job")
        held_tar = shards_dir / holdout_name(stem)
        held_tar.parent.mkdir(exist_ok=True)
        train_tar = shards_dir / f"{stem}.tar.training"  # not *.tar: no reader or count takes it as a shard
        counts = split_tar(tar, train_tar, held_tar, self.holdout_rate)
        train_tar.replace(tar)
        if counts.held_out == 0:
            held_tar.unlink()
        # The stats file is img2dataset's, finished (it parsed); the count rides along to S3 and a
        # retry. Replaced whole: img2dataset's logger reads every *.json of the folder as it runs.
        partial = stats_path.with_name(stats_path.name + ".partial")
        partial.write_text(json.dumps({**stats, HOLDOUT_STATS_KEY: counts.held_out}))
        partial.replace(stats_path)

    def _hash_shard(self, shards_dir: Path, stem: str) -> None:
        out = shards_dir / (stem + hashes.HASHES_SUFFIX)
        held = shards_dir / holdout_name(stem)
        if not out.exists():  # else hashed already, by a sweep whose upload then failed
            hashes.write_shard_hashes(shards_dir / f"{stem}.tar", held if held.exists() else None, out)

    def put_hashes(self, stems: list[str]) -> dict[str, Any]:
        """Merge the shards' hash files (all in S3 by now, resumed ones included) into hashes.parquet;
        return the `_SUCCESS` fields that name it."""

        def read(name: str) -> bytes:
            response = self._call("read", self.client.get_object, Bucket=self.output.bucket, Key=self.output.key(name))
            return bytes(response["Body"].read())

        body, rows = hashes.merge(read, [stem + hashes.HASHES_SUFFIX for stem in stems])
        key = self.output.key(hashes.HASHES_FILE)
        self._call("write to", self.client.put_object, Bucket=self.output.bucket, Key=key, Body=body)
        return {"hashes_file": hashes.HASHES_FILE, "hashed_samples": rows}

    def _upload_shard(self, shards_dir: Path, stem: str) -> None:
        parts = [stem + suffix for suffix in SHARD_SUFFIXES]
        if (shards_dir / holdout_name(stem)).exists():
            parts.insert(1, holdout_name(stem))  # after the tar, before the stats: the stats stay last
        for name in parts:
            path = shards_dir / name
            if not path.exists():
                raise OutputError(f"img2dataset finished shard {stem} without {path.name}; rerun the job")
            key = self.output.key(name)
            if name.endswith("_stats.json"):
                self._call(
                    "write to",
                    self.client.put_object,
                    Bucket=self.output.bucket,
                    Key=key,
                    Body=path.read_bytes(),
                    ContentType="application/json",
                    Metadata={OPTIONS_METADATA: self.digest},
                )
            else:
                # upload_file: multipart above 8 MB, parts in parallel, completed only when whole
                self._call("write to", self.client.upload_file, Filename=str(path), Bucket=self.output.bucket, Key=key)
        # The disk holds only shards in progress: the uploaded tar and parquet go at once.
        for name in parts[:-1]:
            (shards_dir / name).unlink()

    def put_success(self, summary: dict[str, Any]) -> None:
        self._call(
            "write to",
            self.client.put_object,
            Bucket=self.output.bucket,
            Key=self.output.key(SUCCESS_FILE),
            Body=(json.dumps(summary, indent=2) + "\n").encode(),
            ContentType="application/json",
        )
