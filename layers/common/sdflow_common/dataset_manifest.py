"""Where the training job finds the dataset: every path is relative to `s3://<bucket>/runs/`.

A resumed run reuses shards an earlier run downloaded, and those stay in the earlier run's folder
(`runs/<old execution>/dataset/shards/NNNNN/`), so index.json names each tar file by its key relative
to `s3://<bucket>/runs/` (docs/contracts.md "The dataset index"). The training container streams them
from there (hyperparameters `dataset_dir` = that prefix, `dataset_index` = index.json's relative key):
no input channel copies the dataset to the instances (sagemaker_jobs.training_job_request).

build_index also writes `dataset/manifest.json`, in SageMaker's manifest format (SageMaker API Reference,
"S3DataSource", S3Uri: a JSON array whose first element is `{"prefix": "s3://bucket/some/prefix/"}`,
followed by suffixes appended to it): the list of every object the run's training reads,

    [{"prefix": "s3://<bucket>/runs/"},
     "<run>/dataset/index.json",
     "<old run>/dataset/shards/00003/00000.tar", ...]

kept as the `$.dataset.manifest_uri` record (and ready as a ManifestFile channel, should File or
FastFile input ever be wanted again).

`dataset/holdout.json`, in the same format, lists the held-out tars (`<shard folder>holdout/NNNNN.tar`),
when the run holds samples out: the evaluation job's ManifestFile input (`$.dataset.holdout_manifest_uri`)."""

from __future__ import annotations

from typing import Any

RUNS_FOLDER = "runs/"
INDEX_NAME = "index.json"
MANIFEST_NAME = "manifest.json"
HOLDOUT_MANIFEST_NAME = "holdout.json"
# Default of the training container's `dataset_index` hyperparameter: an index at the dataset root.
DEFAULT_INDEX_IN_CHANNEL = INDEX_NAME


class OutsideRunsFolder(ValueError):
    """An object the training job's dataset needs is not below `s3://<bucket>/runs/`."""


def runs_prefix_uri(bucket: str) -> str:
    """The dataset root (`dataset_dir`) and the manifest's prefix: every run's folder of the data bucket."""
    return f"s3://{bucket}/{RUNS_FOLDER}"


def manifest_uri(dataset_prefix_uri: str) -> str:
    """`s3://<bucket>/runs/<run>/dataset/manifest.json`: every object the run's training reads."""
    return f"{_folder(dataset_prefix_uri)}{MANIFEST_NAME}"


def holdout_manifest_uri(dataset_prefix_uri: str) -> str:
    """`s3://<bucket>/runs/<run>/dataset/holdout.json`: every held-out tar of the run's shards."""
    return f"{_folder(dataset_prefix_uri)}{HOLDOUT_MANIFEST_NAME}"


def index_uri(dataset_prefix_uri: str) -> str:
    return f"{_folder(dataset_prefix_uri)}{INDEX_NAME}"


def channel_key(uri: str, bucket: str) -> str:
    """The object's key relative to `s3://<bucket>/runs/`: its path in the index and the manifest."""
    prefix = runs_prefix_uri(bucket)
    relative = uri.removeprefix(prefix)
    if relative == uri or not relative or relative.startswith("/"):
        raise OutsideRunsFolder(
            f"{uri} is not below {prefix}: the training job reads its dataset relative to {prefix} (every "
            "path in index.json is), so it can only use objects of the data bucket's runs/ folder"
        )
    return relative


def index_in_channel(dataset_prefix_uri: str, bucket: str) -> str:
    """Where the training container finds index.json, relative to its `dataset_dir` (`s3://<bucket>/runs/`)."""
    return channel_key(index_uri(dataset_prefix_uri), bucket)


def manifest_document(bucket: str, keys: list[str]) -> list[Any]:
    """The manifest itself: the prefix, then each relative key once, in the given order."""
    seen: dict[str, None] = dict.fromkeys(keys)
    return [{"prefix": runs_prefix_uri(bucket)}, *seen]


def _folder(uri: str) -> str:
    return uri if uri.endswith("/") else f"{uri}/"
