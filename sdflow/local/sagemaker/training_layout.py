"""A local training job's files, as SageMaker lays them out (docs/contracts.md): the request's
checks that fail it before any container starts; each channel and earlier checkpoints
downloaded once into the job folder; one `/opt/ml` tree per host (`input/config/*.json`, the
host's share of each channel under `input/data/<channel>/`, its checkpoint folder, `model/` and
`output/data/`); and what goes back to S3 after the job (checkpoints; model.tar.gz and
output.tar.gz, or with OutputDataConfig.CompressionType NONE the model's and output data's files).
The training half of LocalSageMaker (sdflow/local/sagemaker/training.py) runs the containers on
these trees."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdflow.local.sagemaker.host import (
    JobSetupError,
    S3Transfer,
    container_path,
    link_or_copy,
    parse_s3_uri,
    tar_folder,
)

# Per channel name: the job's cache of it, the files in it (relative paths), and whether hosts
# split them (ShardedByS3Key) rather than each getting all of them.
ChannelFiles = dict[str, tuple[Path, list[str], bool]]


@dataclass(frozen=True)
class HostLayout:
    host: str
    opt_ml: Path
    checkpoints: Path


def training_hosts(request: dict[str, Any]) -> list[str]:
    resources = request.get("ResourceConfig") or {}
    count = int(resources.get("InstanceCount", 1) or 1)
    if count < 1:
        raise JobSetupError(f"ResourceConfig.InstanceCount must be >= 1, got {count}")
    return [f"algo-{i}" for i in range(1, count + 1)]


def check_training_input_mode(request: dict[str, Any]) -> None:
    algorithm = request.get("AlgorithmSpecification") or {}
    if algorithm.get("TrainingInputMode", "File") == "Pipe":
        raise JobSetupError("AlgorithmSpecification.TrainingInputMode Pipe is not supported locally; use File")


def s3_output_path(request: dict[str, Any]) -> str:
    path = str((request.get("OutputDataConfig") or {}).get("S3OutputPath") or "")
    parse_s3_uri(path, "OutputDataConfig.S3OutputPath")
    return path


def download_channels(job_s3: Callable[[], S3Transfer], folder: Path, channels: list[dict[str, Any]]) -> ChannelFiles:
    """Each channel once into the job's cache; hosts get links to it."""
    result = {}
    for i, channel in enumerate(channels):
        name = channel.get("ChannelName")
        where = f"InputDataConfig[{i}] ({name})"
        if not name:
            raise JobSetupError(f"InputDataConfig[{i}].ChannelName is required")
        if channel.get("InputMode") == "Pipe":
            raise JobSetupError(f"{where}.InputMode Pipe is not supported locally; use File")
        source = (channel.get("DataSource") or {}).get("S3DataSource")
        if source is None:
            raise JobSetupError(f"{where}.DataSource: only S3DataSource is supported locally")
        cache = folder / "_channels" / name
        data_type = source.get("S3DataType", "S3Prefix")
        # Asked for only once a channel checks out: a job's role credentials come with its S3.
        files = job_s3().download_input(data_type, source["S3Uri"], cache, f"{where}.S3Uri")
        sharded = source.get("S3DataDistributionType", "FullyReplicated") == "ShardedByS3Key"
        result[name] = (cache, files, sharded)
    return result


def download_checkpoints(s3: S3Transfer, uri: str, cache: Path) -> None:
    _, _, keys = s3.list_keys(uri, "CheckpointConfig.S3Uri")
    if keys:  # a restart resumes from the checkpoints an earlier attempt left
        s3.download_prefix(uri, cache, "CheckpointConfig.S3Uri")


def input_data_config(request: dict[str, Any]) -> dict[str, dict[str, Any]]:
    algorithm = request.get("AlgorithmSpecification") or {}
    return {
        channel["ChannelName"]: {
            "TrainingInputMode": channel.get("InputMode", algorithm.get("TrainingInputMode", "File")),
            "S3DistributionType": channel["DataSource"]["S3DataSource"].get(
                "S3DataDistributionType", "FullyReplicated"
            ),
            "RecordWrapperType": channel.get("RecordWrapperType", "None"),
            **({"ContentType": channel["ContentType"]} if "ContentType" in channel else {}),
        }
        for channel in request.get("InputDataConfig") or []
    }


def resource_config(host: str, hosts: list[str], resources: dict[str, Any]) -> dict[str, Any]:
    return {
        "current_host": host,
        "current_instance_type": resources.get("InstanceType", "local"),
        "current_group_name": "homogeneousCluster",
        "hosts": hosts,
        "network_interface_name": "lo",
    }


def lay_out_hosts(
    folder: Path, request: dict[str, Any], hosts: list[str], channel_files: ChannelFiles, checkpoint_cache: Path
) -> list[HostLayout]:
    """`folder/<host>/`, each host's /opt/ml, in host order."""
    resources = request.get("ResourceConfig") or {}
    checkpoint = request.get("CheckpointConfig") or None
    hyperparameters = {str(k): str(v) for k, v in (request.get("HyperParameters") or {}).items()}
    channels_config = input_data_config(request)
    layouts = []
    for index, host in enumerate(hosts):
        opt_ml = folder / host
        write_config(
            opt_ml / "input" / "config",
            {
                "hyperparameters.json": hyperparameters,
                "resourceconfig.json": resource_config(host, hosts, resources),
                "inputdataconfig.json": channels_config,
            },
        )
        link_channels(opt_ml / "input" / "data", channel_files, index, len(hosts))
        checkpoints = seed_checkpoints(opt_ml, checkpoint, checkpoint_cache)
        for created in (checkpoints, opt_ml / "model", opt_ml / "output" / "data"):
            created.mkdir(parents=True, exist_ok=True)
        layouts.append(HostLayout(host, opt_ml, checkpoints))
    return layouts


def write_config(config: Path, files: dict[str, Any]) -> None:
    config.mkdir(parents=True)
    for name, content in files.items():
        (config / name).write_text(json.dumps(content))


def link_channels(data: Path, channel_files: ChannelFiles, index: int, count: int) -> None:
    for channel, (cache, files, sharded) in channel_files.items():
        mine = files[index::count] if sharded else files
        for rel in mine:
            link_or_copy(cache / rel, data / channel / rel)
        (data / channel).mkdir(parents=True, exist_ok=True)


def seed_checkpoints(opt_ml: Path, checkpoint: dict[str, Any] | None, cache: Path) -> Path:
    """The host's checkpoint folder, holding what `cache` holds."""
    local_checkpoints = opt_ml / "checkpoints"
    if checkpoint and checkpoint.get("LocalPath"):
        local_checkpoints = container_path(checkpoint["LocalPath"], opt_ml, "CheckpointConfig.LocalPath")
    if cache.is_dir():
        # Copies, not links: the trainer rewrites checkpoint files, and hosts must not share them.
        shutil.copytree(cache, local_checkpoints, dirs_exist_ok=True)
    return local_checkpoints


def upload_checkpoints(s3: S3Transfer, layouts: list[HostLayout], uri: str) -> None:
    # algo-1 last, so that its files win where hosts wrote the same names.
    for layout in reversed(layouts):
        s3.upload_dir(layout.checkpoints, uri, "CheckpointConfig.S3Uri")


def output_compression(request: dict[str, Any]) -> str:
    """OutputDataConfig.CompressionType: GZIP when absent ("Defaults to gzip", SageMaker API Reference,
    OutputDataConfig); the service model's enum (GZIP | NONE) is enforced at CreateTrainingJob (limits)."""
    return str((request.get("OutputDataConfig") or {}).get("CompressionType") or "GZIP")


def upload_artifacts(
    s3: S3Transfer, folder: Path, opt_ml: Path, output_path: str, name: str, compression: str = "GZIP"
) -> str:
    """`opt_ml/model` and `opt_ml/output/data` (unless empty) to `<S3OutputPath>/<job name>/output/`;
    returns the model's URI, as DescribeTrainingJob's ModelArtifacts.S3ModelArtifacts reports it.

    GZIP: model.tar.gz and output.tar.gz. NONE ("Uncompressed model output", SageMaker developer guide):
    each file as an object of its own, the model under the `output/model/` prefix (the URI returned) and
    the output data under `output/data/`, so that a ModelDataSource S3Prefix of that URI gives the
    container the same /opt/ml/model tree back (S3ModelDataSource: key minus prefix = path)."""
    output = f"{output_path.rstrip('/')}/{name}/output"
    data = opt_ml / "output" / "data"
    if compression == "NONE":
        model_uri = f"{output}/model/"
        s3.upload_dir(opt_ml / "model", model_uri, "OutputDataConfig.S3OutputPath")
        s3.upload_dir(data, f"{output}/data/", "OutputDataConfig.S3OutputPath")
        return model_uri
    model_uri = f"{output}/model.tar.gz"
    archive = folder / "model.tar.gz"
    tar_folder(opt_ml / "model", archive)
    s3.upload_file(archive, model_uri, "OutputDataConfig.S3OutputPath")
    if any(data.iterdir()):
        output_archive = folder / "output.tar.gz"
        tar_folder(data, output_archive)
        s3.upload_file(output_archive, f"{output}/output.tar.gz", "OutputDataConfig.S3OutputPath")
    return model_uri
