"""Where a training job's model lands in S3, and how a model, a model package and the evaluation
job read it.

The training job asks for `OutputDataConfig.CompressionType = NONE` ("Uncompressed model output",
SageMaker developer guide): SageMaker uploads /opt/ml/model file by file instead of gzipping it into
one model.tar.gz on one core at the end of the paid job; a full fine-tune's pipeline is tens of GB,
which the endpoint and the evaluation job would also have to download and untar again. The same path
serves both methods (a LoRA's adapter is megabytes, but one layout means one reader everywhere).

The model's location is what SageMaker reports (DescribeTrainingJob and the "SageMaker Training Job
State Change" event's `ModelArtifacts.S3ModelArtifacts`); for an uncompressed output that is a key
name prefix, which the SageMaker Python SDK (`EstimatorBase.model_data`) also reads from there and
ends with "/" before handing it to hosting, as S3ModelDataSource requires of an S3Prefix ("A valid
key name prefix identified by S3Uri always ends with a forward slash", SageMaker API Reference).

A model recorded before this change (a run resumed from an older one reuses its model) is a
model.tar.gz object: `model_data_source` reads it as the gzip-compressed TAR archive it is.
"""

from __future__ import annotations

from typing import Any, Final, Literal

# OutputDataConfig.CompressionType's values (botocore's service model, OutputCompressionType: GZIP | NONE;
# absent means GZIP: "Defaults to gzip", SageMaker API Reference, OutputDataConfig).
UNCOMPRESSED: Final[Literal["NONE"]] = "NONE"
GZIP: Final[Literal["GZIP"]] = "GZIP"
ARCHIVE_NAME = "model.tar.gz"


def is_prefix(uri: str) -> bool:
    """True for an uncompressed model (a key name prefix), False for a model.tar.gz object."""
    return uri.endswith("/")


def reported_location(s3_model_artifacts: str, compression: str | None) -> str:
    """The model's location as SageMaker reports it, a prefix ending with "/" when the job's output is
    uncompressed (SageMaker may report it without the slash; the SDK adds it too)."""
    archive = s3_model_artifacts.endswith(".tar.gz")  # an object whatever was asked: read it as one
    if (compression or GZIP).upper() == UNCOMPRESSED and not archive and not is_prefix(s3_model_artifacts):
        return f"{s3_model_artifacts}/"
    return s3_model_artifacts


def expected_location(output_path: str, job_name: str, compression: str | None) -> str:
    """Where SageMaker puts a job's model under OutputDataConfig.S3OutputPath, for when no report of it
    is at hand: `<S3OutputPath>/<job>/output/model.tar.gz`, or the `output/model/` prefix uncompressed."""
    output = f"{output_path.rstrip('/')}/{job_name}/output"
    if (compression or GZIP).upper() == UNCOMPRESSED:
        return f"{output}/model/"
    return f"{output}/{ARCHIVE_NAME}"


def model_data_source(uri: str) -> dict[str, Any]:
    """ModelDataSource of CreateModel's ContainerDefinition and of CreateModelPackage's
    ModelPackageContainerDefinition (both take it, botocore's service model): an S3Prefix with
    CompressionType None, each object under the prefix becoming the file /opt/ml/model/<key minus prefix>
    (S3ModelDataSource); an older model.tar.gz as an S3Object SageMaker untars (CompressionType Gzip)."""
    if is_prefix(uri):
        return {"S3DataSource": {"S3Uri": uri, "S3DataType": "S3Prefix", "CompressionType": "None"}}
    return {"S3DataSource": {"S3Uri": uri, "S3DataType": "S3Object", "CompressionType": "Gzip"}}
