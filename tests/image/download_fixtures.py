"""Helpers of the download tests: moto's S3 and a local image server on 127.0.0.1 (their fixtures
are registered in conftest.py), the job's small arguments, and readers of what it wrote."""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest
from data_fixtures import local_s3

from sdflow.samples import ImageServer
from sdflow_image.s3_uri import S3Prefix

BUCKET = "sdflow-data"
SLOW_SECONDS = 3.0  # the image server's slow URLs: longer than job_args' --url_timeout


def job_args(input_path: Path, output_uri: str, work: Path, *extra: str) -> list[str]:
    # Small settings keep a run to a few seconds on a shared 2-core machine; 20 rows per
    # shard over 36 rows gives two shards, so the totals are summed across shards.
    return [
        "--input", str(input_path), "--output_uri", output_uri, "--work_dir", str(work),
        "--image_size", "64", "--samples_per_shard", "20",
        "--processes", "1", "--threads", "8", "--url_timeout", "1",
        *extra,
    ]  # fmt: skip


@dataclass
class S3:
    client: Any

    def uri(self, name: str) -> str:
        return f"s3://{BUCKET}/runs/{name}/dataset/shards/00000/"

    def names(self, uri: str) -> dict[str, dict[str, Any]]:
        """name below the prefix -> the listing's entry."""
        output = S3Prefix.parse(uri)
        listing = self.client.list_objects_v2(Bucket=BUCKET, Prefix=output.prefix)
        return {item["Key"][len(output.prefix) :]: item for item in listing.get("Contents", [])}

    def read(self, uri: str, name: str) -> bytes:
        key = S3Prefix.parse(uri).key(name)
        return bytes(self.client.get_object(Bucket=BUCKET, Key=key)["Body"].read())


@pytest.fixture(scope="module")
def download_s3() -> Iterator[S3]:
    """moto's S3 server, reached as the local runtime lets a job container reach it: boto3 with
    AWS_ENDPOINT_URL and keys in the environment."""
    with local_s3() as client:
        client.create_bucket(Bucket=BUCKET)
        yield S3(client)


@pytest.fixture
def opt_ml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """SDFLOW_OPT_ML in the test's folder: where a job writes its failure and exit message files."""
    path = tmp_path / "opt_ml"
    monkeypatch.setenv("SDFLOW_OPT_ML", str(path))
    return path


@pytest.fixture(scope="module")
def image_server() -> Iterator[ImageServer]:
    with ImageServer(slow_seconds=SLOW_SECONDS) as server:
        yield server


def read_tar(data: bytes) -> dict[str, dict[str, bytes]]:
    """key -> {extension: bytes} of a webdataset tar."""
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        for member in tar.getmembers():
            key, _, ext = member.name.partition(".")
            extracted = tar.extractfile(member)
            assert extracted is not None, member.name
            samples.setdefault(key, {})[ext] = extracted.read()
    return samples


def captions_in_s3(s3: S3, uri: str, folder: str = "") -> dict[str, str]:
    """url -> caption over every tar directly in the prefix's `folder`; each sample complete and a
    real JPEG, and no URL twice."""
    seen: dict[str, str] = {}
    names = sorted(n for n in s3.names(uri) if n.endswith(".tar") and n.rpartition("/")[0] == folder.rstrip("/"))
    for name in names:
        for key, members in read_tar(s3.read(uri, name)).items():
            assert set(members) == {"jpg", "txt", "json"}, key
            assert members["jpg"][:3] == b"\xff\xd8\xff", f"{key}.jpg is not a JPEG"
            meta = json.loads(members["json"])
            assert meta["status"] == "success"
            assert members["txt"].decode() == meta["caption"]
            assert meta["url"] not in seen, f"{meta['url']} is in two samples"
            seen[meta["url"]] = members["txt"].decode()
    return seen
