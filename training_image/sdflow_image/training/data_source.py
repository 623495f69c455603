"""Where training data comes from: the dataset index and its tar shards, on S3 or in a folder.

A training job streams its shards straight from S3 (`dataset_dir` = `s3://<bucket>/runs/`, the
prefix every path in index.json is relative to): nothing is copied to the volume up front, so
neither the time to the first step nor the disk used grows with the dataset. A local folder with
the same layout serves tests and runs on a workstation.

Tar files are read as streams (`tarfile` mode `r|`, one forward pass, no seeking). Each sample
read reports the byte offset of the next sample's first header, so a reader can reopen the shard
exactly there (an S3 ranged GET, `Range: bytes=<offset>-`, or a seek): that is how a resumed run
and a retry after a dropped connection continue without re-reading a shard from its start.

This module imports neither torch nor the decoders: train.py's early checks use it."""

from __future__ import annotations

import json
import os
import re
import tarfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from sdflow_image import flags
from sdflow_image.s3_uri import S3Prefix

DEFAULT_INDEX = "index.json"  # at the dataset root: the layout of one run's dataset/ folder
# webdataset's key rule (webdataset.tariterators.base_plus_ext): the key is the path up to the
# first dot of the file name, the rest its extension; consecutive files with one key are a sample.
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
# Each training batch's samples as "<tar path>#<sample key>" (JSON list): what the latent cache keys on.
KEYS_KEY = "_keys"
# Reads that fail on a dropped connection reopen at the last whole sample, this many times in a row.
STREAM_RETRIES = 3


class DatasetIndexError(ValueError):
    """The dataset index or a shard it lists is missing, malformed or empty."""


class ShardReadError(RuntimeError):
    """A shard could not be read (after retries): names the shard and the offset."""


FLAGS = [
    flags.Flag(
        "dataset_dir",
        flags.text,
        None,
        "where index.json's paths are rooted: s3://<bucket>/runs/ (streamed) or a local folder; "
        "default: the dataset channel",
    ),
    flags.Flag(
        "dataset_index",
        flags.text,
        DEFAULT_INDEX,
        "index.json's path below dataset_dir (the pipeline passes <run>/dataset/index.json)",
    ),
    flags.Flag("dataloader_num_workers", flags.non_negative_int, 2, "DataLoader worker processes per training process"),
    flags.Flag(
        "interleave_shards",
        flags.number(int, 1, maximum=64),
        8,
        "shards each data reader keeps open and draws samples from at random (1: one shard after another)",
    ),
    flags.Flag("center_crop", flags.boolean, True, "center crop (true) or random crop (false) after resizing"),
    flags.Flag("random_flip", flags.boolean, False, "random horizontal flips"),
    flags.Flag(
        "aspect_buckets",
        flags.boolean,
        False,
        "train in aspect-ratio buckets (SDXL's, scaled to the resolution's area: training/buckets.py), each batch "
        "of one bucket; false: square crops of resolution",
    ),
]


@dataclass(frozen=True)
class DatasetIndex:
    shards: list[str]  # tar paths relative to the dataset root, in index order
    total_samples: int
    image_size: int | None
    # tar path -> its shard's dropped file (the dedup job's duplicates, index `dropped_file`), where it has one
    dropped_files: dict[str, str] = field(default_factory=dict)

    def identity(self) -> list[str]:
        """What a saved data position must match: the tars, and the dropped files when there are any."""
        return self.shards + sorted(set(self.dropped_files.values()))


class Source(Protocol):
    """A dataset root: reads small files whole and streams tars from a byte offset."""

    def describe(self, relative: str) -> str: ...

    def read_bytes(self, relative: str) -> bytes: ...

    def open_stream(self, relative: str, offset: int) -> BinaryIO: ...


def _check_relative(relative: str, what: str) -> str:
    path = Path(relative)
    if not relative or path.is_absolute() or ".." in path.parts:
        raise DatasetIndexError(f"{what} {relative!r} must be a path relative to dataset_dir, without '..'")
    return path.as_posix()


class LocalSource:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def describe(self, relative: str) -> str:
        return str(self.root / relative)

    def read_bytes(self, relative: str) -> bytes:
        return (self.root / relative).read_bytes()

    def open_stream(self, relative: str, offset: int) -> BinaryIO:
        handle = (self.root / relative).open("rb")
        handle.seek(offset)
        return handle

    def exists(self, relative: str) -> bool:
        return (self.root / relative).is_file()


class S3Source:
    """`s3://bucket/prefix/`: GetObject only (the job role needs s3:GetObject on the prefix, no listing).

    boto3 picks up AWS_ENDPOINT_URL and the role's credentials from the environment. A client is made
    per process, on first use: DataLoader workers are forked, and a client must not cross a fork."""

    def __init__(self, uri: str) -> None:
        try:
            location = S3Prefix.parse(uri)
        except ValueError:
            raise DatasetIndexError(f"dataset_dir {uri!r} names no bucket: use s3://<bucket>/runs/") from None
        self.bucket = location.bucket
        self.prefix = location.prefix
        self._client: Any = None
        self._pid = -1
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"bucket": self.bucket, "prefix": self.prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(f"s3://{state['bucket']}/{state['prefix']}")  # type: ignore[misc]

    def client(self) -> Any:
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                import boto3
                from botocore.config import Config

                config = Config(retries={"mode": "standard", "max_attempts": 8}, max_pool_connections=80)
                self._client = boto3.session.Session().client("s3", config=config)
                self._pid = os.getpid()
            return self._client

    def describe(self, relative: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}{relative}"

    def _get(self, relative: str, **extra: Any) -> Any:
        from botocore.exceptions import ClientError

        try:
            return self.client().get_object(Bucket=self.bucket, Key=f"{self.prefix}{relative}", **extra)["Body"]
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("NoSuchKey", "404"):
                raise FileNotFoundError(f"{self.describe(relative)} does not exist (NoSuchKey)") from None
            raise

    def read_bytes(self, relative: str) -> bytes:
        body = self._get(relative)
        try:
            return bytes(body.read())
        finally:
            body.close()

    def open_stream(self, relative: str, offset: int) -> BinaryIO:
        # A ranged GET streams from the offset; the body is read as the tar reader asks for bytes.
        extra = {"Range": f"bytes={offset}-"} if offset else {}
        body: BinaryIO = self._get(relative, **extra)
        return body


def source_for(dataset_dir: str | Path) -> LocalSource | S3Source:
    text = str(dataset_dir)
    if text.startswith("s3://"):
        return S3Source(text)
    return LocalSource(text)


def _parse_index(raw: bytes, where: str) -> tuple[list[str], dict[str, str], Any, Any]:
    try:
        index = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatasetIndexError(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(index, dict) or not isinstance(index.get("shards"), list):
        raise DatasetIndexError(f"{where} has no 'shards' list")
    tars: list[str] = []
    dropped: dict[str, str] = {}
    for shard in index["shards"]:
        files = shard.get("tar_files") if isinstance(shard, dict) else None
        if not isinstance(files, list):
            raise DatasetIndexError(f"{where}: shard entry {shard!r} has no 'tar_files' list")
        names = [_check_relative(str(name), f"{where}: tar file") for name in files]
        tars.extend(names)
        if shard.get("dropped_file") is not None:
            dropped_file = _check_relative(str(shard["dropped_file"]), f"{where}: dropped_file")
            dropped.update(dict.fromkeys(names, dropped_file))
    return tars, dropped, index.get("total_samples"), index.get("image_size")


def load_index(dataset_dir: str | Path, index_path: str = DEFAULT_INDEX) -> DatasetIndex:
    """Read and check index.json at `index_path` below `dataset_dir` (a folder or an s3:// prefix).

    In a folder every listed tar must exist. On S3 they are not checked one by one here (10,000
    shards would be 10,000 requests on every rank before step 0): build_index lists only tars whose
    download job finished, and a missing one fails the read with its URI."""
    source = source_for(dataset_dir)
    if isinstance(source, LocalSource) and not source.root.is_dir():
        raise DatasetIndexError(
            f"dataset_dir {source.root} does not exist: pass s3://<bucket>/runs/ or a folder holding index.json"
        )
    relative = _check_relative(index_path, "dataset_index")
    where = source.describe(relative)
    try:
        raw = source.read_bytes(relative)
    except (FileNotFoundError, IsADirectoryError):
        raise DatasetIndexError(
            f"{where} is missing: the hyperparameter dataset_index (now {index_path!r}) must be index.json's path "
            "below dataset_dir, e.g. '<run>/dataset/index.json' (build_index writes it)"
        ) from None
    tars, dropped, total, size = _parse_index(raw, where)
    if not tars:
        raise DatasetIndexError(f"{where} lists no tar files: every shard failed to download, nothing to train on")
    if isinstance(source, LocalSource):
        missing = [name for name in tars if not source.exists(name)]
        if missing:
            raise DatasetIndexError(
                f"{len(missing)} tar file(s) listed in {where} are missing, e.g. {source.describe(missing[0])}"
            )
    if isinstance(total, int) and total <= 0:
        raise DatasetIndexError(f"{where} says total_samples={total}: nothing to train on")
    return DatasetIndex(
        shards=tars,
        total_samples=int(total) if isinstance(total, int) else -1,
        image_size=int(size) if isinstance(size, int) else None,
        dropped_files=dropped,
    )


def load_dropped(source: Source, dropped_files: dict[str, str], tars: list[str]) -> dict[str, frozenset[str]]:
    """tar path -> the keys its reader skips: the dedup job's `dropped/<shard_id>.json` of each of
    `tars`' shards (a reader's own tars only: a rank never loads another rank's drops)."""
    keys: dict[str, frozenset[str]] = {}
    for relative in sorted({dropped_files[tar] for tar in tars if tar in dropped_files}):
        where = source.describe(relative)
        try:
            body = json.loads(source.read_bytes(relative))
        except FileNotFoundError:
            raise DatasetIndexError(
                f"{where} is the dropped_file of a shard in the dataset index but does not exist: rebuild the index "
                "after the dedup job (build_index names only files the job wrote)"
            ) from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DatasetIndexError(f"{where} is not valid JSON: {exc}") from exc
        listed = body.get("keys") if isinstance(body, dict) else None
        if not isinstance(listed, list) or not all(isinstance(k, str) for k in listed):
            raise DatasetIndexError(f"{where} has no 'keys' list of strings: it must be the dedup job's dropped file")
        keys[relative] = frozenset(listed)
    return {tar: keys[dropped_files[tar]] for tar in tars if tar in dropped_files}


# ---------------------------------------------------------------------------------------------
# Reading samples with their offsets
# ---------------------------------------------------------------------------------------------


@dataclass
class TarSample:
    key: str
    files: dict[str, bytes]  # extension (lower case) -> bytes
    next_offset: int | None  # where the next sample's first header starts; None: the shard is done


def iter_samples(stream: BinaryIO, base_offset: int, where: str) -> Iterator[TarSample]:
    """Samples of a tar stream that starts at `base_offset` of the shard, in file order.

    A sample is yielded once the next sample's first header has been read (its offset is the
    resume point), or at the end of the archive with next_offset None."""
    key: str | None = None
    files: dict[str, bytes] = {}
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            if not member.isfile():
                continue
            match = _KEY_EXT.match(member.name)
            if match is None:
                continue  # no extension: not part of any sample (webdataset skips these too)
            member_key, ext = match.group(1), match.group(2).lower()
            if key is not None and member_key != key:
                yield TarSample(key, files, base_offset + member.offset)
                files = {}
            key = member_key
            handle = tar.extractfile(member)
            if handle is None:
                raise ShardReadError(f"{where}: member {member.name} has no data")
            files[ext] = handle.read()
    if key is not None:
        yield TarSample(key, files, None)


def transient_errors() -> tuple[type[BaseException], ...]:
    """Errors of a dropped or stalled connection: worth reopening the stream at the last sample.

    botocore raises these while a streaming body is read (ResponseStreamingError wraps urllib3's
    ProtocolError, ReadTimeoutError a stalled socket); a truncated stream makes tarfile raise ReadError."""
    from botocore.exceptions import (
        ConnectionClosedError,
        EndpointConnectionError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )

    return (
        ConnectionError,
        TimeoutError,
        ConnectionClosedError,
        EndpointConnectionError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
        tarfile.ReadError,
    )


class ShardReader:
    """One open shard: hands out its samples from `offset` on and reopens the stream at the last
    whole sample when the connection drops (STREAM_RETRIES times in a row, then ShardReadError)."""

    def __init__(self, source: Source, relative: str, offset: int = 0) -> None:
        self.source, self.relative = source, relative
        self.offset: int | None = offset  # of the next sample to hand out; None when done
        self._samples: Iterator[TarSample] | None = None
        self._stream: BinaryIO | None = None

    def _open(self) -> Iterator[TarSample]:
        assert self.offset is not None
        try:
            self._stream = self.source.open_stream(self.relative, self.offset)
        except FileNotFoundError:
            raise DatasetIndexError(
                f"{self.source.describe(self.relative)} is listed in the dataset index but does not exist: "
                "rebuild the index (build_index lists only shards whose _SUCCESS exists) or restore the object"
            ) from None
        return iter_samples(self._stream, self.offset, self.source.describe(self.relative))

    def next_sample(self) -> TarSample | None:
        """The next sample, or None when the shard is exhausted (then the reader is closed)."""
        failures = 0
        while self.offset is not None:
            try:
                if self._samples is None:
                    self._samples = self._open()
                sample = next(self._samples, None)
            except transient_errors() as exc:
                self.close()
                failures += 1
                if failures > STREAM_RETRIES:
                    raise ShardReadError(
                        f"{self.source.describe(self.relative)}: reading at byte {self.offset} failed "
                        f"{failures} times in a row: {type(exc).__name__}: {exc}"
                    ) from exc
                continue
            if sample is None:  # an archive that ended on a header boundary with no more samples
                self.offset = None
                break
            self.offset = sample.next_offset
            if self.offset is None:
                self.close()
            return sample
        self.close()
        return None

    def close(self) -> None:
        self._samples = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None
