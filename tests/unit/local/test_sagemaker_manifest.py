"""S3DataType ManifestFile in the local SageMaker: the manifest's objects land in the channel under
their relative keys, with the job role's own S3 permissions, and a bad manifest or a missing or
unreadable object fails the job as a ClientError (SageMaker API Reference, S3DataSource)."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from sdflow.local import patching
from sdflow.local.runtime import Runtime
from sdflow.local.sagemaker import engine as sagemaker_module
from sdflow.local.sagemaker.engine import LocalSageMaker
from sdflow.local.sagemaker.host import JobSetupError, S3Transfer
from sdflow.local.services.iam import IamEnforcer
from tests.constants import ACCOUNT, REGION
from tests.unit.local.helpers import TRAINING_REQUEST, fake_training_image, wait_for
from tests.unit.local.recorders import Recorder

BUCKET = "data"
# moto's in-process mock answers AWS's own endpoint; the local cloud passes its server's URL instead.
S3_ENDPOINT = f"https://s3.{REGION}.amazonaws.com"
MANIFEST_KEY = "runs/new/dataset/manifest.json"
MANIFEST_URI = f"s3://{BUCKET}/{MANIFEST_KEY}"
FIELD = "InputDataConfig[0] (dataset).S3Uri"
# A resumed run's channel: its own index, one shard of its own and one reused from an earlier run.
OBJECTS = {
    "runs/new/dataset/index.json": b'{"shards": []}',
    "runs/old/dataset/shards/00000/00000.tar": b"tar-0",
    "runs/new/dataset/shards/00001/00000.tar": b"tar-1",
}
SUFFIXES = [key.removeprefix("runs/") for key in OBJECTS]

# The container: lists its dataset channel into the model, so the test reads what SageMaker gave it.
LIST_CHANNEL = """#!/usr/bin/env python3
import json, os, pathlib
root = pathlib.Path(os.environ["SDFLOW_OPT_ML"])
channel = root / "input" / "data" / "dataset"
files = {p.relative_to(channel).as_posix(): p.read_text() for p in channel.rglob("*") if p.is_file()}
(root / "model").mkdir(parents=True, exist_ok=True)
(root / "model" / "channel.json").write_text(json.dumps(files))
"""


@pytest.fixture
def s3(aws: None) -> Any:
    client = boto3.client("s3", region_name=REGION)
    client.create_bucket(Bucket=BUCKET)
    for key, body in OBJECTS.items():
        client.put_object(Bucket=BUCKET, Key=key, Body=body)
    return client


def _put_manifest(s3: Any, document: Any) -> None:
    body = document if isinstance(document, bytes) else json.dumps(document).encode()
    s3.put_object(Bucket=BUCKET, Key=MANIFEST_KEY, Body=body)


def _manifest(*suffixes: str) -> list[Any]:
    return [{"prefix": f"s3://{BUCKET}/runs/"}, *suffixes]


def test_download_manifest_copies_each_object_under_its_relative_key(s3: Any, tmp_path: Path) -> None:
    _put_manifest(s3, _manifest(*SUFFIXES, SUFFIXES[1]))  # listed twice: one object
    dest = tmp_path / "dataset"

    files = S3Transfer(S3_ENDPOINT, REGION).download_input("ManifestFile", MANIFEST_URI, dest, FIELD)

    assert files == SUFFIXES
    assert {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()} == {
        key.removeprefix("runs/"): body for key, body in OBJECTS.items()
    }


def test_download_manifest_prefix_is_joined_to_each_suffix_as_text(s3: Any, tmp_path: Path) -> None:
    """SageMaker appends the suffix to the prefix: a prefix without a trailing '/' is part of the name."""
    _put_manifest(s3, [{"prefix": f"s3://{BUCKET}/runs/new/dataset/shards/0000"}, "1/00000.tar"])
    files = S3Transfer(S3_ENDPOINT, REGION).download_manifest(MANIFEST_URI, tmp_path / "d", FIELD)
    assert files == ["1/00000.tar"]
    assert (tmp_path / "d" / "1" / "00000.tar").read_bytes() == b"tar-1"


def test_download_manifest_missing_object_raises_data_download_failed(s3: Any, tmp_path: Path) -> None:
    _put_manifest(s3, _manifest(SUFFIXES[0], "old/dataset/shards/00007/00000.tar"))
    with pytest.raises(JobSetupError) as caught:
        S3Transfer(S3_ENDPOINT, REGION).download_manifest(MANIFEST_URI, tmp_path / "d", FIELD)
    assert str(caught.value).startswith(
        f"Data download failed: s3://{BUCKET}/runs/old/dataset/shards/00007/00000.tar, listed in the manifest "
        f"{MANIFEST_URI} ({FIELD}), cannot be read: NoSuchKey"
    )


def test_download_manifest_missing_manifest_raises_naming_it(s3: Any, tmp_path: Path) -> None:
    with pytest.raises(JobSetupError) as caught:
        S3Transfer(S3_ENDPOINT, REGION).download_manifest(MANIFEST_URI, tmp_path / "d", FIELD)
    assert str(caught.value) == (
        f"{FIELD} {MANIFEST_URI}: the manifest cannot be read: NoSuchKey: The specified key does not exist."
    )


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (b"[{", "is not valid JSON"),
        ({"prefix": f"s3://{BUCKET}/runs/"}, "must be a JSON array"),
        ([], "must be a JSON array"),
        (["a/b"], 'first element must be {"prefix": "s3://bucket/prefix/"}'),
        ([{"prefix": "runs/"}, "a"], "prefix must be an s3://bucket/key URI"),
        ([{"prefix": f"s3://{BUCKET}/runs/"}], "lists no objects after its prefix"),
        ([{"prefix": f"s3://{BUCKET}/runs/"}, "a", 7], "element 2 must be a non-empty key"),
        ([{"prefix": f"s3://{BUCKET}/runs/"}, ""], "element 1 must be a non-empty key"),
        ([{"prefix": f"s3://{BUCKET}/runs/new/"}, "../../etc/passwd"], "would escape the channel folder"),
    ],
)
def test_download_manifest_malformed_raises_naming_the_problem(
    s3: Any, tmp_path: Path, document: Any, message: str
) -> None:
    _put_manifest(s3, document)
    with pytest.raises(JobSetupError) as caught:
        S3Transfer(S3_ENDPOINT, REGION).download_manifest(MANIFEST_URI, tmp_path / "d", FIELD)
    assert message in str(caught.value)
    assert not (tmp_path / "etc").exists()


def test_download_input_other_data_type_raises(s3: Any, tmp_path: Path) -> None:
    with pytest.raises(JobSetupError, match="S3DataType 'AugmentedManifestFile' is not supported locally"):
        S3Transfer(S3_ENDPOINT, REGION).download_input("AugmentedManifestFile", MANIFEST_URI, tmp_path, FIELD)


# ------------------------------------------------------------------ the job role's permissions


@pytest.fixture
def enforced(aws: None, tmp_path: Path) -> Iterator[Runtime]:
    runtime = Runtime(workdir=tmp_path, iam=IamEnforcer(REGION))
    with patching.patched(runtime):
        yield runtime


def _role_transfer(runtime: Runtime, get_object_resource: str) -> S3Transfer:
    """SageMaker's session for the job's role (LocalCloud wires `role_credentials` the same way)."""
    iam = boto3.client("iam", region_name=REGION)
    arn = iam.create_role(RoleName="sagemaker-job", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:GetObject",
                                                      "Resource": get_object_resource}]}  # fmt: skip
    iam.put_role_policy(RoleName="sagemaker-job", PolicyName="data", PolicyDocument=json.dumps(policy))
    assert runtime.iam is not None
    return S3Transfer(S3_ENDPOINT, REGION, runtime.iam.credentials_for_role(arn, "SageMaker"))


def test_download_manifest_role_needs_get_object_only(enforced: Runtime, s3: Any, tmp_path: Path) -> None:
    """A manifest lists its objects: unlike S3Prefix, no s3:ListBucket is needed."""
    _put_manifest(s3, _manifest(*SUFFIXES))
    transfer = _role_transfer(enforced, f"arn:aws:s3:::{BUCKET}/runs/*")
    assert transfer.download_manifest(MANIFEST_URI, tmp_path / "d", FIELD) == SUFFIXES
    assert enforced.api_calls[("s3", "GetObject")] >= 1 + len(SUFFIXES)
    assert enforced.api_calls[("s3", "ListBucket")] == 0


def test_download_manifest_object_outside_role_access_denied(enforced: Runtime, s3: Any, tmp_path: Path) -> None:
    _put_manifest(s3, _manifest(*SUFFIXES))
    transfer = _role_transfer(enforced, f"arn:aws:s3:::{BUCKET}/runs/new/*")
    with pytest.raises(JobSetupError) as caught:
        transfer.download_manifest(MANIFEST_URI, tmp_path / "d", FIELD)
    message = str(caught.value)
    assert message.startswith(f"Data download failed: s3://{BUCKET}/runs/old/dataset/shards/00000/00000.tar")
    assert (
        f"AccessDenied: User: arn:aws:sts::{ACCOUNT}:assumed-role/sagemaker-job/SageMaker is not authorized to "
        f"perform: s3:GetObject on resource: arn:aws:s3:::{BUCKET}/runs/old/dataset/shards/00000/00000.tar"
    ) in message


# ------------------------------------------------------------------ a training job's channel


@pytest.fixture
def local_sagemaker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LocalSageMaker, Recorder]]:
    monkeypatch.setattr(sagemaker_module, "free_port", lambda: 65000)  # no socket in unit tests
    image = fake_training_image(tmp_path, {"train": LIST_CHANNEL})
    recorder = Recorder()
    sm = LocalSageMaker(tmp_path / "sm", S3_ENDPOINT, recorder, training_image_dir=image, stop_grace_s=0.5)
    yield sm, recorder
    sm.shutdown()


def _training_request(name: str) -> dict[str, Any]:
    source = {"S3DataType": "ManifestFile", "S3Uri": MANIFEST_URI, "S3DataDistributionType": "FullyReplicated"}
    return {
        **TRAINING_REQUEST,
        "TrainingJobName": name,
        "ResourceConfig": {"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 50},
        "InputDataConfig": [{"ChannelName": "dataset", "DataSource": {"S3DataSource": source}, "InputMode": "File"}],
    }


def test_training_job_manifest_channel_holds_objects_under_relative_keys(
    s3: Any, local_sagemaker: tuple[LocalSageMaker, Recorder]
) -> None:
    sm, recorder = local_sagemaker
    _put_manifest(s3, _manifest(*SUFFIXES))

    sm.run_training_job(_training_request("t-manifest"))

    status, fields = wait_for(lambda: recorder.final("t-manifest"), what="the training job to end")
    assert status == "Completed", fields
    bucket, key = fields["ModelArtifacts"]["S3ModelArtifacts"].removeprefix("s3://").split("/", 1)
    archive = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        member = tar.extractfile("channel.json")
        assert member is not None
        seen = json.loads(member.read())
    assert seen == {key.removeprefix("runs/"): body.decode() for key, body in OBJECTS.items()}


def test_training_job_manifest_missing_object_fails_with_client_error(
    s3: Any, local_sagemaker: tuple[LocalSageMaker, Recorder]
) -> None:
    sm, recorder = local_sagemaker
    _put_manifest(s3, _manifest(SUFFIXES[0], "old/dataset/shards/00009/00000.tar"))

    sm.run_training_job(_training_request("t-missing"))

    status, fields = wait_for(lambda: recorder.final("t-missing"), what="the training job to fail")
    assert status == "Failed"
    assert fields["FailureReason"].startswith(
        f"ClientError: Data download failed: s3://{BUCKET}/runs/old/dataset/shards/00009/00000.tar, listed in "
        f"the manifest {MANIFEST_URI} (InputDataConfig[0] (dataset).S3Uri), cannot be read: NoSuchKey"
    )
