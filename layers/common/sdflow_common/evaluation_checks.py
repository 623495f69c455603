"""Validate run's checks of the `evaluation` block, and what it resolves there and writes back into the run:

- the CLIP model (`clip_model_uri`): its config.json is a CLIP config (its projection_dim, the features KID and FID
  are computed on), and its weights' size, for the evaluation instance's memory check (read_clip_model);
- the evaluation instance: null → the smallest GPU instance type that holds the family's pipeline and the CLIP
  model (model_family.evaluation_instance);
- the held-out split: `holdout_samples` (null → automatic) and the rate the download job holds out
  (evaluation_options.holdout_rate), refused when the dataset cannot hold it;
- `scene_adherence` (null → on when scene prompts or a scene gate ask for it);
- the gate: every metric it names must be one the run computes.

Refusals name the field (`evaluation.gate.<metric>` for the gate) and the fix (InvalidRunDocument; a missing or
unreadable CLIP model is DatasetNotFound, as a missing base model is)."""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from sdflow_common import aws, dataset_files, instance_types, model_family
from sdflow_common.errors import DatasetNotFound
from sdflow_common.evaluation_options import (
    HOLDOUT_OVERSAMPLE,
    MAX_HOLDOUT_RATE,
    MIN_AUTO_HOLDOUT,
    auto_holdout_samples,
    holdout_rate,
    most_holdout_samples,
)
from sdflow_common.inference_memory import CLIP_BYTES
from sdflow_common.quality_gate import HOLDOUT_METRICS
from sdflow_common.run_document import RunDocument, invalid, parse_run_document, parse_s3_uri

CLIP_CONFIG = "config.json"
# transformers' CLIPConfig default (projection_dim=512) when config.json leaves it out.
DEFAULT_PROJECTION_DIM = 512
# The files transformers' from_pretrained loads a CLIPModel from, safetensors first (its own order).
SAFETENSORS_WEIGHTS = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
PICKLE_WEIGHTS = re.compile(r"^pytorch_model(-\d{5}-of-\d{5})?\.bin$")
# A safetensors file starts with the header's length (u64, little-endian) and the header, a JSON object of
# {tensor name: {"dtype", "shape", "data_offsets"}}; the format caps the header at 100 MB. One ranged GET of
# HEADER_PEEK bytes holds a CLIP model's header (about 400 tensors, ~40 kB); a larger one takes a second GET.
HEADER_PEEK = 256 * 1024
MAX_HEADER_BYTES = 100_000_000
CONFIG_BYTES = 65_535


def _not_found(field: str, message: str) -> DatasetNotFound:
    return DatasetNotFound(json.dumps([{"field": field, "message": message}]))


def _problem(field: str, message: str) -> Exception:
    return invalid([{"field": field, "message": message}])


@dataclass(frozen=True)
class ClipModel:
    """What Validate run reads of the CLIP model: its feature dimension and its weights' float32 bytes."""

    uri: str
    projection_dim: int
    weight_bytes: int  # in float32, as the evaluation loads it
    weights_from: str  # "safetensors headers" (parameters x 4 bytes) or "weight file sizes"


def _folder(uri: str) -> tuple[str, str]:
    bucket, key = parse_s3_uri(uri)
    return bucket, key if not key or key.endswith("/") else f"{key}/"


def _json_object(raw: bytes) -> dict[str, Any] | None:
    """The JSON object `raw` holds, or None (not JSON, or JSON but no object)."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _clip_config(bucket: str, folder: str) -> dict[str, Any]:
    uri = f"s3://{bucket}/{folder}{CLIP_CONFIG}"
    try:
        body = aws.read_range(bucket, f"{folder}{CLIP_CONFIG}", 0, CONFIG_BYTES)
    except ClientError as exc:
        if not dataset_files.missing_or_unreadable(exc):
            raise
        raise _not_found(
            "evaluation.clip_model_uri",
            f"{uri} does not exist or is not readable; clip_model_uri must be the folder of a transformers "
            "CLIPModel with its processor (config.json, model.safetensors, preprocessor_config.json and the "
            "tokenizer's files), e.g. saved with CLIPModel.save_pretrained() and CLIPProcessor.save_pretrained() "
            "and copied with `aws s3 sync`",
        ) from None
    config = _json_object(body)
    if config is None:
        raise _problem("evaluation.clip_model_uri", f"{uri} is not a JSON object; give a CLIPModel's folder")
    is_clip = config.get("model_type") == "clip" or (
        isinstance(config.get("text_config"), dict) and isinstance(config.get("vision_config"), dict)
    )
    if not is_clip:
        shown = repr(config.get("model_type"))[:40]
        raise _problem(
            "evaluation.clip_model_uri",
            f"{uri} has model_type {shown} and no text_config and vision_config: not a CLIP model; give the "
            "folder of a transformers CLIPModel (openai/clip-vit-large-patch14, a LAION CLIP, PickScore, …)",
        )
    return config


def _projection_dim(config: dict[str, Any], uri: str) -> int:
    value = config.get("projection_dim", DEFAULT_PROJECTION_DIM)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _problem("evaluation.clip_model_uri", f"{uri}: projection_dim is {value!r}, not a positive integer")
    return value


def _safetensors_parameters(bucket: str, key: str) -> int:
    """The parameter count a safetensors file's header lists (its tensors' shapes), from one or two ranged GETs."""
    uri = f"s3://{bucket}/{key}"
    head = aws.read_range(bucket, key, 0, HEADER_PEEK - 1)
    size = struct.unpack("<Q", head[:8])[0] if len(head) >= 8 else -1
    if not 0 < size <= MAX_HEADER_BYTES:
        raise _problem(
            "evaluation.clip_model_uri", f"{uri} is not a safetensors file (its header length is unreadable)"
        )
    text = head[8 : 8 + size] if len(head) >= 8 + size else aws.read_range(bucket, key, 8, 8 + size - 1)
    header = _json_object(text)
    if header is None:
        raise _problem("evaluation.clip_model_uri", f"{uri} is not a safetensors file (its header is no JSON object)")
    count = 0
    for name, tensor in header.items():
        shape = tensor.get("shape") if isinstance(tensor, dict) else None
        if name == "__metadata__":
            continue
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise _problem("evaluation.clip_model_uri", f"{uri}: tensor {name[:60]!r} has no shape")
        count += math.prod(shape)
    return count


def _weights(bucket: str, folder: str) -> tuple[int, str]:
    """The CLIP model's float32 bytes, and how they were counted."""
    paginator = aws.client("s3").get_paginator("list_objects_v2")
    sizes: dict[str, int] = {}
    for page in paginator.paginate(Bucket=bucket, Prefix=folder, Delimiter="/"):
        for obj in page.get("Contents", []):
            sizes[obj["Key"][len(folder) :]] = int(obj["Size"])
    safetensors = sorted(name for name in sizes if SAFETENSORS_WEIGHTS.match(name))
    if safetensors:
        parameters = sum(_safetensors_parameters(bucket, f"{folder}{name}") for name in safetensors)
        return parameters * CLIP_BYTES, "safetensors headers"
    pickles = sorted(name for name in sizes if PICKLE_WEIGHTS.match(name))
    if pickles:
        # torch.save writes each tensor's bytes as stored: a float32 checkpoint's size is its float32 weights.
        return sum(sizes[name] for name in pickles), "weight file sizes"
    raise _problem(
        "evaluation.clip_model_uri",
        f"s3://{bucket}/{folder} holds no model.safetensors (or model-00001-of-0000N.safetensors shards, or "
        "pytorch_model.bin): the CLIP model has no weights the evaluation can load; save it with "
        "CLIPModel.save_pretrained() and copy the whole folder",
    )


def read_clip_model(uri: str) -> ClipModel:
    """The CLIP model's config (a CLIP config; its projection_dim) and its weights' size, from S3."""
    bucket, folder = _folder(uri)
    config = _clip_config(bucket, folder)
    projection_dim = _projection_dim(config, f"s3://{bucket}/{folder}{CLIP_CONFIG}")
    weight_bytes, weights_from = _weights(bucket, folder)
    return ClipModel(uri=uri, projection_dim=projection_dim, weight_bytes=weight_bytes, weights_from=weights_from)


def _resolved(document: RunDocument, **evaluation: Any) -> RunDocument:
    """The document with evaluation fields set, validated again (what Validate run writes back into the run)."""
    raw = document.model_dump(mode="json", exclude_unset=True)
    raw["evaluation"] = {**raw.get("evaluation", {}), **evaluation}
    return parse_run_document(raw)


def resolve_instance(document: RunDocument, index: model_family.BaseModelIndex, clip: ClipModel | None) -> RunDocument:
    """evaluation.instance_type null → the smallest GPU instance type that holds the evaluation."""
    if document.evaluation.instance_type is not None:
        return document
    clip_bytes = clip.weight_bytes if clip else 0
    found, need = model_family.evaluation_instance(
        document, index.family, with_t5=index.with_t5, variant=index.variant, clip_bytes=clip_bytes
    )
    if found is None:
        raise _problem(
            "evaluation.instance_type",
            f"no GPU instance type {instance_types.image_of(document.training.backend).label} starts on holds "
            f"this evaluation on one GPU (about {need:.1f} GiB): set evaluation.instance_type to one you know fits",
        )
    return _resolved(document, instance_type=found)


@dataclass(frozen=True)
class Holdout:
    samples: int
    rate: float
    warnings: list[dict[str, str]]


def _too_many(samples: int, rows: int) -> Exception:
    most = most_holdout_samples(rows)
    fix = f"set evaluation.holdout_samples to at most {most}" if most else "add data"
    return _problem(
        "evaluation.holdout_samples",
        f"asks for {samples} held-out samples, and the dataset cannot hold it: its {rows} parquet rows hold at "
        f"most {most} ({MAX_HOLDOUT_RATE:.0%} of the rows, holding out {HOLDOUT_OVERSAMPLE:g}x the samples asked "
        f"for because some downloads fail): {fix} (0: no held-out split), or add rows to the dataset",
    )


def resolve_holdout(document: RunDocument, rows: int) -> Holdout:
    """holdout_samples as asked, or automatic; the rate the download job holds out (evaluation_options)."""
    evaluation = document.evaluation
    warnings: list[dict[str, str]] = []
    if evaluation.holdout_samples is not None:
        samples = evaluation.holdout_samples
        rate = holdout_rate(samples, rows)
        if rate > MAX_HOLDOUT_RATE:
            raise _too_many(samples, rows)
        return Holdout(samples=samples, rate=rate, warnings=warnings)
    samples = auto_holdout_samples(rows)
    if samples == 0 and evaluation.clip_model_uri is not None:
        # Only where the held-out split was wanted: the CLIP score, KID and FID are its only readers.
        most = most_holdout_samples(rows)
        ask = f"set evaluation.holdout_samples (at most {most}) to ask for one" if most else "add data"
        need = math.ceil(MIN_AUTO_HOLDOUT * HOLDOUT_OVERSAMPLE / MAX_HOLDOUT_RATE)
        warnings.append(
            {
                "field": "evaluation.holdout_samples",
                "message": f"the dataset's {rows} parquet rows are too few for an automatic held-out split "
                f"({MIN_AUTO_HOLDOUT} samples need {need} rows), so the evaluation computes no CLIP score, KID or "
                f"FID: {ask}",
            }
        )
    return Holdout(samples=samples, rate=holdout_rate(samples, rows), warnings=warnings)


def _holdout_gate_problem(metric: str, document: RunDocument, samples: int, clip: ClipModel | None) -> str | None:
    if clip is None:
        return (
            f"gates on {metric}, which needs a CLIP model: set evaluation.clip_model_uri to the S3 folder of a "
            f"transformers CLIPModel, or remove evaluation.gate.{metric}"
        )
    if samples == 0:
        how = "is 0" if document.evaluation.holdout_samples == 0 else "resolved to 0 (the dataset is small)"
        return (
            f"gates on {metric}, which needs held-out samples, and evaluation.holdout_samples {how}: set "
            f"evaluation.holdout_samples to at least 1, or remove evaluation.gate.{metric}"
        )
    if metric == "fid" and samples < clip.projection_dim:
        return (
            f"gates on fid, which needs at least as many held-out samples as the CLIP model's feature dimension "
            f"(projection_dim {clip.projection_dim} in {clip.uri}): holdout_samples is {samples}; set "
            f"evaluation.holdout_samples to at least {clip.projection_dim}, or gate on kid instead"
        )
    return None


def check_gate(document: RunDocument, samples: int, clip: ClipModel | None) -> None:
    """Refuse a gate on a metric this run cannot compute (field evaluation.gate.<metric>)."""
    evaluation = document.evaluation
    gate = evaluation.effective_gate
    problems: list[dict[str, str]] = []
    for metric in gate.metrics():
        field, reason = f"evaluation.gate.{metric}", None
        if metric in HOLDOUT_METRICS:
            reason = _holdout_gate_problem(metric, document, samples, clip)
        elif not evaluation.scene_adherence_on:
            if evaluation.min_prompt_adherence is not None:  # the older form of gate.prompt_adherence.min
                field = "evaluation.min_prompt_adherence"
            reason = (
                f"gates on prompt_adherence, the scene adherence, and evaluation.scene_adherence is false: set "
                f"scene_adherence to true (or leave it out), or remove {field}"
            )
        if reason:
            problems.append({"field": field, "message": reason})
    if problems:
        raise invalid(problems)


def _nothing_to_score(document: RunDocument, samples: int) -> dict[str, str] | None:
    """The job fails when it has neither held-out samples with a CLIP model nor scene prompts to score."""
    evaluation = document.evaluation
    if evaluation.scene_adherence_on or (evaluation.clip_model_uri is not None and samples > 0):
        return None
    lacking = "no clip_model_uri" if evaluation.clip_model_uri is None else "holdout_samples 0"
    return {
        "field": "evaluation.scene_adherence",
        "message": f"is false, and with {lacking} the evaluation computes no held-out metric either, so it would "
        "score nothing: set scene_adherence to true (or leave it out), or give evaluation.clip_model_uri and "
        "held-out samples",
    }


def resolve_evaluation(document: RunDocument, rows: int, clip: ClipModel | None) -> tuple[RunDocument, Holdout]:
    """holdout_samples, then scene_adherence (which depends on it) resolved and written into the document; the gate
    and the evaluation's having something to score checked."""
    holdout = resolve_holdout(document, rows)
    evaluation = document.evaluation
    if evaluation.holdout_samples != holdout.samples:
        document = _resolved(document, holdout_samples=holdout.samples)
    if (problem := _nothing_to_score(document, holdout.samples)) is not None:
        raise invalid([problem])
    check_gate(document, holdout.samples, clip)
    if document.evaluation.scene_adherence is None:
        document = _resolved(document, scene_adherence=document.evaluation.scene_adherence_on)
    return document, holdout
