"""The training job's `dataset` channel: a SageMaker manifest over every run's folder.

A resumed run reuses shards an earlier run downloaded, and those stay in the earlier run's folder
(`runs/<old execution>/dataset/shards/NNNNN/`). An S3Prefix channel over this run's own folder would
never see them, so the channel is a ManifestFile data source instead. SageMaker's S3DataSource
(SageMaker API Reference, "S3DataSource", S3Uri): a manifest is a JSON array whose first element is
`{"prefix": "s3://bucket/some/prefix/"}`, followed by one or more suffixes that SageMaker appends to the
prefix; the complete set of those URIs is the channel's input, each object must be readable by the
job's role, and the prefix fixes one bucket. In File mode each object lands in the channel directory
under its suffix, so the suffixes here are keys relative to `s3://<bucket>/runs/`:

    [{"prefix": "s3://<bucket>/runs/"},
     "<run>/dataset/index.json",
     "<old run>/dataset/shards/00003/00000.tar", ...]

and index.json names its tar files with the same relative keys (docs/contracts.md "The dataset index")."""

from __future__ import annotations

from typing import Any

RUNS_FOLDER = "runs/"
INDEX_NAME = "index.json"
MANIFEST_NAME = "manifest.json"
# Defaults of the training container's `dataset_index` hyperparameter: an index at the channel root
# (the layout of an S3Prefix channel over one run's dataset/ folder) still works.
DEFAULT_INDEX_IN_CHANNEL = INDEX_NAME


class OutsideRunsFolder(ValueError):
    """An object the dataset channel needs is not below `s3://<bucket>/runs/`."""


def runs_prefix_uri(bucket: str) -> str:
    """The manifest's prefix: every run's folder of the data bucket."""
    return f"s3://{bucket}/{RUNS_FOLDER}"


def manifest_uri(dataset_prefix_uri: str) -> str:
    """`s3://<bucket>/runs/<run>/dataset/manifest.json`: the dataset channel's S3Uri."""
    return f"{_folder(dataset_prefix_uri)}{MANIFEST_NAME}"


def index_uri(dataset_prefix_uri: str) -> str:
    return f"{_folder(dataset_prefix_uri)}{INDEX_NAME}"


def channel_key(uri: str, bucket: str) -> str:
    """The object's key relative to the manifest's prefix, which is also its path in the channel."""
    prefix = runs_prefix_uri(bucket)
    relative = uri.removeprefix(prefix)
    if relative == uri or not relative or relative.startswith("/"):
        raise OutsideRunsFolder(
            f"{uri} is not below {prefix}: the training job's dataset channel (a SageMaker manifest whose "
            f"prefix is {prefix}) can only hold objects of the data bucket's runs/ folder"
        )
    return relative


def index_in_channel(dataset_prefix_uri: str, bucket: str) -> str:
    """Where the training container finds index.json, relative to the channel root."""
    return channel_key(index_uri(dataset_prefix_uri), bucket)


def manifest_document(bucket: str, keys: list[str]) -> list[Any]:
    """The manifest itself: the prefix, then each relative key once, in the given order."""
    seen: dict[str, None] = dict.fromkeys(keys)
    return [{"prefix": runs_prefix_uri(bucket)}, *seen]


def _folder(uri: str) -> str:
    return uri if uri.endswith("/") else f"{uri}/"
