"""The SageMaker Python SDK's configuration file for the local cloud.

The SDK (v3) finds its default bucket with STS at the hard-coded regional endpoint
(https://sts.<region>.amazonaws.com, `sts_regional_endpoint`), which AWS_ENDPOINT_URL does not
redirect, and wants an execution role per job. Its documented configuration file answers both
(SageMaker developer guide, "Configuring and using defaults with the SageMaker Python SDK"):
the stack's bucket under the prefix the notebook role may write, and that role for training
jobs, processing jobs and models. `sdflow local up` exports SAGEMAKER_USER_CONFIG_OVERRIDE
pointing here, so a notebook needs nothing but the printed environment."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

CONFIG_ENV = "SAGEMAKER_USER_CONFIG_OVERRIDE"
FILE_NAME = "sagemaker-sdk-config.yaml"
# The NotebookExecutionRole may write only below this prefix (template.yaml).
OBJECT_KEY_PREFIX = "notebooks"


def sdk_config(outputs: Mapping[str, str]) -> dict[str, Any]:
    """The configuration document for a stack's outputs (DataBucketName, NotebookExecutionRoleArn)."""
    role = outputs["NotebookExecutionRoleArn"]
    return {
        "SchemaVersion": "1.0",
        "SageMaker": {
            "PythonSDK": {
                "Modules": {
                    # The SDK would send usage data to AWS; nothing leaves this machine.
                    "TelemetryOptOut": True,
                    "Session": {
                        "DefaultS3Bucket": outputs["DataBucketName"],
                        "DefaultS3ObjectKeyPrefix": OBJECT_KEY_PREFIX,
                    },
                }
            },
            "TrainingJob": {"RoleArn": role},
            "ProcessingJob": {"RoleArn": role},
            "Model": {"ExecutionRoleArn": role},
        },
    }


def write_sdk_config(folder: Path, outputs: Mapping[str, str]) -> Path:
    path = Path(folder) / FILE_NAME
    path.write_text(yaml.safe_dump(sdk_config(outputs), sort_keys=False))
    return path
