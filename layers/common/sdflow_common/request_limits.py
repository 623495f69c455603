"""SageMaker's server-side request limits, read from botocore's service model: one walker for Validate run
(sdflow_common.request_plan, before a run spends anything) and the local cloud (sdflow.local.sagemaker.limits,
which answers a Create call as AWS would).

botocore validates a request's types, required members and minimums on the client, never a
maximum or a pattern; moto checks neither. AWS refuses the rest with a ValidationException
before creating anything, e.g. a hyperparameter value over 2,500 characters
(`HyperParameterValue`), a processing job's MaxRuntimeInSeconds over 777,600
(`ProcessingMaxRuntimeInSeconds`), or a tag value holding `(` (`TagValue`'s pattern). So a request is
walked through the operation's input shape and what the model's `max` (length, value, item count),
`pattern` and `enum` refuse is reported (e.g. OutputDataConfig's CompressionType, GZIP | NONE, where
S3ModelDataSource's is None | Gzip), in AWS's words: "Value '…' at 'hyperParameters.max_train_steps' failed
to satisfy constraint: Member must have length less than or equal to 2500".

Patterns are Java regular expressions matched whole; the `regex` module reads their `\\p{L}`
classes. A pattern it cannot compile is skipped (none of those the pipeline reaches).
What the model does not carry (cross-field rules, the instance types a Region offers, the account's quotas)
is not here: S3ModelDataSource's documented prefix rules are the one exception, added by hand."""

from __future__ import annotations

import functools
from typing import Any

import botocore.session
import regex

QUOTE_LIMIT = 80  # characters of an offending value quoted in the message


@functools.cache
def service_model(service: str = "sagemaker") -> Any:
    """botocore's model of `service`, read once per process."""
    return botocore.session.get_session().get_service_model(service)


@functools.cache
def enum_values(shape: str, service: str = "sagemaker") -> frozenset[str]:
    """The values an enum shape of the model takes, e.g. ProcessingInstanceType: the instance types a processing
    job may ask for (no ml.p4d.24xlarge, no ml.p5.48xlarge; SageMaker API Reference, ProcessingClusterConfig)."""
    return frozenset(service_model(service).shape_for(shape).enum)


@functools.cache
def _pattern(text: str) -> Any:
    try:
        return regex.compile(text)
    except regex.error:
        return None


def _member_path(parent: str, name: str) -> str:
    member = name[:1].lower() + name[1:]
    return f"{parent}.{member}" if parent else member


def _quoted(value: Any) -> str:
    text = str(value)
    return text if len(text) <= QUOTE_LIMIT else text[: QUOTE_LIMIT - 1] + "…"


def _scalar(shape: Any, value: Any, path: str) -> list[str]:
    meta = shape.metadata
    where = f"Value '{_quoted(value)}' at '{path}' failed to satisfy constraint: Member must"
    if shape.type_name == "string" and isinstance(value, str):
        if "max" in meta and len(value) > meta["max"]:
            return [f"{where} have length less than or equal to {meta['max']}"]
        compiled = _pattern(meta["pattern"]) if "pattern" in meta else None
        if compiled is not None and compiled.fullmatch(value) is None:
            return [f"{where} satisfy regular expression pattern: {meta['pattern']}"]
        if shape.enum and value not in shape.enum:
            return [f"{where} satisfy enum value set: [{', '.join(shape.enum)}]"]
    elif shape.type_name in ("integer", "long") and isinstance(value, int) and "max" in meta and value > meta["max"]:
        return [f"{where} have value less than or equal to {meta['max']}"]
    return []


def _s3_model_data_source(value: dict[str, Any], path: str) -> list[str]:
    """The rules S3ModelDataSource's documentation states beyond its shape (SageMaker API Reference,
    S3ModelDataSource): "A valid key name prefix identified by S3Uri always ends with a forward slash (/)"
    for S3DataType S3Prefix, and Gzip (a gzip-compressed TAR archive) only with S3Object."""
    data_type, uri = value.get("S3DataType"), value.get("S3Uri")
    found = []
    if data_type == "S3Prefix" and isinstance(uri, str) and not uri.endswith("/"):
        found.append(
            f"Value '{_quoted(uri)}' at '{path}.s3Uri' failed to satisfy constraint: a key name prefix (S3DataType "
            "S3Prefix) must end with a forward slash (/)"
        )
    if data_type == "S3Prefix" and value.get("CompressionType") == "Gzip":
        found.append(
            f"Value 'Gzip' at '{path}.compressionType' failed to satisfy constraint: Gzip names a gzip-compressed "
            "TAR archive, an S3Object; use CompressionType None with S3DataType S3Prefix"
        )
    return found


def _too_many(meta: dict[str, Any], value: Any, path: str) -> list[str]:
    if "max" in meta and len(value) > meta["max"]:
        return [f"Value at '{path}' failed to satisfy constraint: Member must have length less than or equal to "
                f"{meta['max']}"]  # fmt: skip
    return []


def problems(shape: Any, value: Any, path: str = "") -> list[str]:
    """Every maximum and pattern `value` breaks under `shape`, as AWS words them."""
    found = []
    if shape.name == "S3ModelDataSource" and isinstance(value, dict):
        found += _s3_model_data_source(value, path)
    if shape.type_name == "structure" and isinstance(value, dict):
        for name, member in shape.members.items():
            if name in value:
                found += problems(member, value[name], _member_path(path, name))
    elif shape.type_name == "list" and isinstance(value, list):
        found += _too_many(shape.metadata, value, path)
        for index, item in enumerate(value, start=1):
            found += problems(shape.member, item, f"{path}.{index}.member")
    elif shape.type_name == "map" and isinstance(value, dict):
        found += _too_many(shape.metadata, value, path)
        for key, item in value.items():
            found += _scalar(shape.key, key, f"{path}.{key}.key")
            found += problems(shape.value, item, f"{path}.{key}")
    else:
        found += _scalar(shape, value, path)
    return found


def operation_problems(operation: str, request: dict[str, Any], service: str = "sagemaker") -> list[str]:
    """Every maximum, pattern and enum `request` breaks under `operation`'s input shape."""
    return problems(service_model(service).operation_model(operation).input_shape, request)
