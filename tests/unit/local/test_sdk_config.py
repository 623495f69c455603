"""The SageMaker Python SDK's configuration file that `sdflow local up` writes and exports."""

from __future__ import annotations

from pathlib import Path

import yaml

from sdflow.local.sdk_config import CONFIG_ENV, FILE_NAME, OBJECT_KEY_PREFIX, sdk_config, write_sdk_config

OUTPUTS = {
    "DataBucketName": "sdflow-local-databucket-abc",
    "NotebookExecutionRoleArn": "arn:aws:iam::123456789012:role/sdflow-local-NotebookExecutionRole-X",
    "SageMakerExecutionRoleArn": "arn:aws:iam::123456789012:role/sdflow-local-SageMakerExecutionRole-Y",
}


def test_sdk_config_stack_outputs_give_bucket_prefix_notebook_role_and_no_telemetry() -> None:
    sagemaker = sdk_config(OUTPUTS)["SageMaker"]
    modules = sagemaker["PythonSDK"]["Modules"]
    assert modules["Session"] == {"DefaultS3Bucket": OUTPUTS["DataBucketName"], "DefaultS3ObjectKeyPrefix": "notebooks"}
    assert modules["TelemetryOptOut"] is True
    role = OUTPUTS["NotebookExecutionRoleArn"]  # never the pipeline's own job role
    assert sagemaker["TrainingJob"]["RoleArn"] == sagemaker["ProcessingJob"]["RoleArn"] == role
    assert sagemaker["Model"]["ExecutionRoleArn"] == role
    assert OBJECT_KEY_PREFIX == "notebooks"  # the only prefix template.yaml lets that role write


def test_write_sdk_config_writes_yaml_the_sdk_schema_version_reads(tmp_path: Path) -> None:
    path = write_sdk_config(tmp_path, OUTPUTS)
    assert path == tmp_path / FILE_NAME
    document = yaml.safe_load(path.read_text())
    assert document["SchemaVersion"] == "1.0"
    assert document == sdk_config(OUTPUTS)
    assert CONFIG_ENV == "SAGEMAKER_USER_CONFIG_OVERRIDE"
