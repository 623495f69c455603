"""SageMaker jobs for the e2e tests: the bucket they read and write, a download job's request."""

from __future__ import annotations

from typing import Any

BUCKET = "sdflow-e2e"
DOWNLOAD_ARGS = (
    "--input /opt/ml/processing/input/parquet --work_dir /opt/ml/processing/work --url_col URL --caption_col TEXT "
    "--image_size 32 --resize_mode center_crop --samples_per_shard 100 --processes 1 --threads 4 --url_timeout 5"
)


def download_request(
    name: str, parquet_key: str, output_prefix: str, *, max_runtime: int = 300, deadline: int = 120
) -> dict[str, Any]:
    """CreateProcessingJob as the start_download function builds it (docs/contracts.md)."""
    return {
        "ProcessingJobName": name,
        "ProcessingResources": {
            "ClusterConfig": {"InstanceCount": 1, "InstanceType": "ml.m5.xlarge", "VolumeSizeInGB": 30}
        },
        "AppSpecification": {
            "ImageUri": "000000000000.dkr.ecr.us-east-1.amazonaws.com/sdflow:latest",
            "ContainerEntrypoint": ["download"],
            "ContainerArguments": [
                *DOWNLOAD_ARGS.split(),
                "--output_uri",
                f"s3://{BUCKET}/{output_prefix}",
                "--deadline_seconds",
                str(deadline),
            ],
        },
        "ProcessingInputs": [
            {
                "InputName": "parquet",
                "S3Input": {
                    "S3Uri": f"s3://{BUCKET}/{parquet_key}",
                    "LocalPath": "/opt/ml/processing/input/parquet",
                    "S3DataType": "S3Prefix",
                    "S3InputMode": "File",
                },
            }
        ],
        "StoppingCondition": {"MaxRuntimeInSeconds": max_runtime},
        "RoleArn": "arn:aws:iam::000000000000:role/sdflow",
    }
