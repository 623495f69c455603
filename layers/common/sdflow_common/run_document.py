"""The run document: what a user asks sdflow to do, as one pydantic model.

The same document is a manifest uploaded to `manifests/` and the input of a direct
StartExecution. `schemas/run-document.schema.json` is generated from this model:
`PYTHONPATH=layers/common python -m sdflow_common.run_document --write schemas/run-document.schema.json`
(`--check PATH` exits non-zero when the committed file is stale)."""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from sdflow_common.dataset_filters import DatasetFilters
from sdflow_common.dedup_options import DeduplicationOptions
from sdflow_common.document_values import QUOTE_LIMIT as QUOTE_LIMIT
from sdflow_common.document_values import S3_URI as S3_URI
from sdflow_common.document_values import parse_s3_uri as parse_s3_uri
from sdflow_common.document_values import printable as printable
from sdflow_common.errors import InvalidRunDocument
from sdflow_common.evaluation_options import MAX_EVALUATION_PROMPTS as MAX_EVALUATION_PROMPTS
from sdflow_common.evaluation_options import SCENE_COLOURS as SCENE_COLOURS
from sdflow_common.evaluation_options import SCENE_GRAMMAR as SCENE_GRAMMAR
from sdflow_common.evaluation_options import SCENE_PROMPT as SCENE_PROMPT
from sdflow_common.evaluation_options import SCENE_SHAPES as SCENE_SHAPES
from sdflow_common.evaluation_options import EvaluationOptions as EvaluationOptions
from sdflow_common.evaluation_options import scene_prompt_problem as scene_prompt_problem
from sdflow_common.training_options import (
    AUTO,
    BACKEND_OF_FAMILY,
    INSTANCE_TYPE,
    LORA_TARGET_MODULE,
    NEW_STACK_FAMILIES,
    PROCESSING_MAX_RUNTIME_LIMIT,
    FieldRefusal,
    TrainingOptions,
    aspect_buckets_refusal,
)
from sdflow_common.training_options import HYPERPARAMETER_VALUE_LIMIT as HYPERPARAMETER_VALUE_LIMIT
from sdflow_common.training_options import LoraOptions as LoraOptions
from sdflow_common.training_options import StrictOptions as _Strict

ENDPOINT_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
RUN_NAME = r"^[a-zA-Z0-9\-_]{1,40}$"
# A Standard execution's ARN: arn:<partition>:states:<region>:<account>:execution:<state machine>:<name>.
# No "/" in the state machine part: Distributed Map children (<machine>/<label>) are not runs.
EXECUTION_ARN = r"^arn:aws[a-z-]*:states:[a-z0-9-]+:[0-9]{12}:execution:[^:/\s]{1,80}:[^:/\s]{1,80}$"
# What each pattern means, in words: pydantic's own message would show the user the raw regex.
PATTERN_HELP = {
    ENDPOINT_NAME.pattern: "use letters, digits and hyphens, starting and ending with a letter or digit "
    "(a SageMaker endpoint name), e.g. 'sdflow-cats'",
    INSTANCE_TYPE: "use a SageMaker instance type of the form ml.<family>.<size>, e.g. 'ml.g5.xlarge'",
    RUN_NAME: "use 1-40 letters, digits, '-' or '_', e.g. 'cats-v1'",
    LORA_TARGET_MODULE: "use a module name as peft's target_modules takes it: a dotted path such as 'to_q' or "
    "'to_out.0'",
    EXECUTION_ARN: "give the ARN of an earlier execution of this pipeline, as `aws stepfunctions "
    "list-executions` prints it: arn:aws:states:<region>:<account>:execution:<pipeline>:<name>",
}
# A report lists at most this many problems: its text travels as a Step Functions error cause
# (kept in 256 KB state) and an SNS message (256 KB), and a few are enough to start fixing.
MAX_PROBLEMS = 20
# Step Functions state data is capped at 256 KB, and the run document travels twice in it (the
# execution input and `$.config.run`), so a document must stay well under half of that. Large
# datasets use `dataset.prefix`, which costs a few bytes whatever the number of shards.
MAX_DOCUMENT_BYTES = 96 * 1024
# HYPERPARAMETER_VALUE_LIMIT, LoraOptions, the S3 and text helpers (document_values) and the evaluation block
# (evaluation_options) are imported `X as X` above: re-exported, as they were defined here.


class Dataset(_Strict):
    """Exactly one of `parquet_uris` or `prefix`."""

    parquet_uris: list[str] | None = Field(default=None, description="One download job (one shard) per parquet object.")
    prefix: str | None = Field(
        default=None,
        description=(
            "Every `*.parquet` object below the folder (sub-folders included) is one shard. A trailing `/` is "
            "implied, so `…/laion` does not pick up `…/laion-2/`."
        ),
    )
    url_column: str = Field(default="URL", min_length=1, description="Column holding the image URL.")
    caption_column: str = Field(default="TEXT", min_length=1, description="Column holding the caption.")
    filters: DatasetFilters | None = Field(
        default=None,
        description=(
            "Bounds on the parquet's own columns (size, aspect ratio, LAION's safety and watermark probabilities, "
            "aesthetic score, CLIP similarity, caption length), applied by each download job before any image is "
            "fetched. See [Filters](#filters)."
        ),
    )

    @field_validator("parquet_uris")
    @classmethod
    def _uris_are_parquet_objects(cls, uris: list[str] | None) -> list[str] | None:
        if uris is None:
            return None
        if not uris:
            raise ValueError("is empty; list at least one s3://…/*.parquet object, or give `prefix`")
        for uri in uris:
            _bucket, key = parse_s3_uri(uri)
            if not key or key.endswith("/"):
                raise ValueError(f"'{uri}' names a folder; list objects here or use `prefix`")
        if len(set(uris)) != len(uris):
            raise ValueError("lists the same object twice; each parquet file is one shard")
        return uris

    @field_validator("prefix")
    @classmethod
    def _prefix_is_s3(cls, prefix: str | None) -> str | None:
        if prefix is not None:
            parse_s3_uri(prefix)
        return prefix

    @model_validator(mode="after")
    def _exactly_one_source(self) -> Dataset:
        if (self.parquet_uris is None) == (self.prefix is None):
            raise ValueError("give exactly one of `parquet_uris` (a list) or `prefix` (an s3:// prefix)")
        return self


class DownloadOptions(_Strict):
    image_size: int = Field(default=256, ge=32, le=2048, description="Images are resized to this size.")
    resize_mode: Literal["center_crop", "border", "keep_ratio", "no"] = Field(
        default="center_crop", description="img2dataset resize mode."
    )
    samples_per_shard: int = Field(default=1000, ge=10, le=100_000, description="Samples per webdataset tar.")
    instance_type: str = Field(
        default="ml.c5.xlarge", pattern=INSTANCE_TYPE, description="Processing instance per shard."
    )
    processes: int = Field(default=4, ge=1, le=96, description="img2dataset processes (≈ vCPUs).")
    threads: int = Field(default=16, ge=1, le=256, description="Download threads per process.")
    url_timeout_seconds: int = Field(default=10, ge=1, le=300, description="Per-URL timeout.")
    max_runtime_seconds: int = Field(
        default=3600,
        ge=60,
        le=PROCESSING_MAX_RUNTIME_LIMIT,
        description="Hard limit of one download job (protects against URLs that hang).",
    )
    max_concurrency: int = Field(
        default=10,
        ge=1,
        le=1000,
        description=(
            "Download jobs running at once. *Validate run* lowers it to the account's quota \"`<instance_type>` "
            'for processing job usage" when Service Quotas can be read; jobs that still meet a full quota wait '
            "for it (retried for hours)."
        ),
    )
    tolerated_failure_percent: float = Field(
        default=10.0,
        ge=0,
        le=100,
        description=(
            "Share of shards that may fail before the run fails. A shard failed when its job wrote no `_SUCCESS`."
            " All shards failing, or zero samples in total, always fails the run."
        ),
    )


class EndpointOptions(_Strict):
    name: str = Field(
        default="sdflow",
        pattern=ENDPOINT_NAME.pattern,
        max_length=48,
        description="Endpoint to create, or to update when it exists.",
    )
    instance_type: str = Field(default="ml.g5.xlarge", pattern=INSTANCE_TYPE, description="Serving instance type.")
    initial_instance_count: int = Field(default=1, ge=1, le=100, description="Serving instances.")
    max_wait_seconds: int = Field(
        default=3600, ge=300, le=4 * 3600, description="How long the create/update may take before the run fails."
    )


class ApprovalOptions(_Strict):
    """Who approves the registered model package before it is deployed."""

    mode: Literal["auto", "manual"] = Field(
        default="auto",
        description=(
            "`auto`: the package is `Approved` when the gate passes. `manual`: it is `PendingManualApproval` and "
            "the run waits (a task token, no polling) until a person decides: `aws sagemaker update-model-package"
            " --model-package-arn ARN --model-approval-status Approved` deploys it, `Rejected` fails the run with"
            " `ModelRejected` (its ApprovalDescription in the notification)."
        ),
    )
    timeout_seconds: int = Field(
        default=7 * 24 * 3600,
        ge=60,
        le=365 * 24 * 3600,
        description=(
            "How long a manual approval may take; then the run fails with `States.Timeout` and the notification "
            "says how to approve and redrive (the redrive deploys at once)."
        ),
    )


class RunDocument(_Strict):
    """A training run: dataset and base model are required, everything else has defaults."""

    schema_version: Literal[1] = Field(default=1, description="Version of this document format.")
    run_name: str | None = Field(
        default=None,
        pattern=RUN_NAME,
        description="Readable name; the first part of the execution name of a manifest-started run.",
    )
    dataset: Dataset = Field(description="Where the parquet files are.")
    base_model_uri: str = Field(
        description=(
            "Folder of a diffusers-format Stable Diffusion model (the folder holding `model_index.json`, `unet/`,"
            " `vae/`, `text_encoder/`, `tokenizer/`, `scheduler/`). A trailing `/` is optional."
        )
    )
    base_model_family: Literal["auto", "sd", "sdxl", "sd3", "sd35", "flux2", "qwenimage"] = Field(
        default="auto",
        description=(
            "The base model's family: `sd` (SD 1.x/2.x, `StableDiffusionPipeline`), `sdxl` "
            "(`StableDiffusionXLPipeline`), `sd3` (`StableDiffusion3Pipeline`), `sd35` (SD 3.5: a "
            "`StableDiffusion3Pipeline` whose `transformer/config.json` sets `qk_norm`), `flux2` (FLUX.2 [klein] "
            "4B or 9B, `Flux2KleinPipeline`), `qwenimage` (`QwenImagePipeline`). `auto`: *Validate run* reads it "
            "from the model's `model_index.json` (`_class_name`) and the run carries what it found "
            "(`$.config.run`, the training job's `model_family` hyperparameter); a family given here must match "
            "the model. Any other pipeline class is refused. See [Model families and "
            "LoRA](#model-families-and-lora)."
        ),
    )
    download: DownloadOptions = Field(default_factory=DownloadOptions, description="The download jobs.")
    deduplication: DeduplicationOptions = Field(default_factory=DeduplicationOptions, description="The dedup job.")
    training: TrainingOptions = Field(default_factory=TrainingOptions, description="The training job.")
    endpoint: EndpointOptions = Field(default_factory=EndpointOptions, description="The endpoint.")
    evaluation: EvaluationOptions = Field(
        default_factory=EvaluationOptions,
        description=(
            "The evaluation against the base (held-out split, CLIP score, KID/FID, scene adherence) and the "
            "quality gate."
        ),
    )
    approval: ApprovalOptions = Field(
        default_factory=ApprovalOptions, description="Who approves the registered model package before it is deployed."
    )
    notify_email_subject_prefix: str = Field(
        default="[sdflow]", max_length=40, description="Prefix of the notification subjects."
    )
    resume_from: str | None = Field(
        default=None,
        pattern=EXECUTION_ARN,
        max_length=256,
        description=(
            "Reuse what that run finished: its downloaded shards and, when nothing that shapes the model changed,"
            " its trained model. See [Resume and redrive](#resume-and-redrive)."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _backend_of_family(cls, data: Any) -> Any:
        # A known family (stated, or found by Validate run) decides the backend a run that names none trains on;
        # the training block then fills in that backend's plugin and precision (TrainingOptions._backend_defaults).
        if not isinstance(data, dict):
            return data
        family, training = data.get("base_model_family", AUTO), data.get("training", {})
        # Any JSON may arrive here (a list where a family belongs): only a known family decides anything.
        if not isinstance(family, str) or family not in BACKEND_OF_FAMILY or not isinstance(training, dict):
            return data
        if training.get("backend", AUTO) != AUTO:
            return data
        return {**data, "training": {**training, "backend": BACKEND_OF_FAMILY[family]}}

    @field_validator("base_model_uri")
    @classmethod
    def _base_model_is_s3(cls, uri: str) -> str:
        parse_s3_uri(uri)
        return uri

    @model_validator(mode="after")
    def _trains_no_larger_than_downloaded(self) -> RunDocument:
        # img2dataset resizes every image to download.image_size (but with resize_mode "no"); a
        # larger training resolution would train on upsampled images, without a word.
        size, resolution = self.download.image_size, self.training.resolution
        if self.download.resize_mode != "no" and resolution > size:
            raise FieldRefusal(
                "training.resolution",
                f"training.resolution={resolution} is larger than download.image_size={size}: every image would be "
                f"upsampled to train. Set download.image_size to at least {resolution}, or training.resolution "
                f"to at most {size}",
            )
        refusal = aspect_buckets_refusal(self.training.aspect_buckets, self.download.resize_mode)
        if refusal is not None:
            raise refusal
        return self


def _model_at(path: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class that holds the field at `path` (None when the path leaves the models)."""
    model: type[BaseModel] = RunDocument
    for part in path:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        annotation = field.annotation if field is not None else None
        # `X | None` (an optional block such as training.lora): the model is X.
        models = [arg for arg in get_args(annotation) if isinstance(arg, type) and issubclass(arg, BaseModel)]
        annotation = models[0] if len(models) == 1 else annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _unknown_field_message(loc: tuple[Any, ...]) -> str:
    model = _model_at(loc[:-1])
    known = list(model.model_fields) if model is not None else []
    close = difflib.get_close_matches(str(loc[-1]).lower(), known, n=1, cutoff=0.6)
    if close:
        return f"unknown field; did you mean `{close[0]}`? (docs/run-document.md lists every field)"
    if known and len(known) <= 10:
        return f"unknown field; remove it (fields allowed here: {', '.join(known)})"
    return "unknown field; remove it or check its spelling (docs/run-document.md lists every field)"


def _pattern_message(item: Any) -> str:
    pattern = str(item.get("ctx", {}).get("pattern", ""))
    value = item.get("input")
    shown = printable(value) if isinstance(value, str) else repr(value)
    advice = PATTERN_HELP.get(pattern, "see docs/run-document.md for the allowed form")
    return f"'{shown}' is not allowed here; {advice}"


def _field_part(part: Any) -> str:
    shown = printable(str(part))
    # A blank key (`{" ": 1}`) would name no field at all: quote it so the user sees what to remove.
    return shown if shown.strip() else json.dumps(str(part))


def field_path(loc: tuple[Any, ...]) -> str:
    return ".".join(_field_part(part) for part in loc) or "(document)"


def format_errors(error: ValidationError) -> list[dict[str, str]]:
    """pydantic's errors as `{"field": "training.instance_count", "message": …}`, one per problem."""
    out = []
    for item in error.errors():
        loc = tuple(item["loc"])
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = _unknown_field_message(loc)
        elif item["type"] == "missing":
            message = "is required"
        elif item["type"] == "string_pattern_mismatch":
            message = _pattern_message(item)
        elif item["type"] == "string_unicode":
            # A lone surrogate ("\ud800" in the JSON): valid JSON, but no text a field can hold.
            shown = printable(str(item.get("input")))
            message = f"'{shown}' is not valid Unicode text (it holds a lone surrogate); write it as plain UTF-8"
        elif item["type"] == "value_error":
            # pydantic prefixes our own validators' messages with "Value error, "; users need only ours.
            message = message.removeprefix("Value error, ")
            refusal = item.get("ctx", {}).get("error")
            if isinstance(refusal, FieldRefusal):
                loc = (*loc, *refusal.field.split("."))
        out.append({"field": field_path(loc), "message": printable(message, limit=1000)})
    return out


def bounded(problems: list[dict[str, str]]) -> list[dict[str, str]]:
    """At most MAX_PROBLEMS entries; the last one says how many more there are."""
    if len(problems) <= MAX_PROBLEMS:
        return problems
    rest = len(problems) - (MAX_PROBLEMS - 1)
    more = {"field": "(document)", "message": f"and {rest} more problems; fix the ones above and check again"}
    return [*problems[: MAX_PROBLEMS - 1], more]


def invalid(problems: list[dict[str, str]]) -> InvalidRunDocument:
    """InvalidRunDocument whose message is the JSON list of problems (what notifications render)."""
    return InvalidRunDocument(json.dumps(bounded(problems)))


def problems_of(error: Exception) -> list[dict[str, str]]:
    """The problem list an InvalidRunDocument or DatasetNotFound carries (its message is JSON)."""
    try:
        decoded = json.loads(str(error))
    except ValueError:
        decoded = None
    if isinstance(decoded, list) and decoded and all(isinstance(item, dict) for item in decoded):
        return [
            {"field": str(item.get("field", "(document)")), "message": str(item.get("message"))} for item in decoded
        ]
    return [{"field": "(document)", "message": str(error)}]


def backend_problems(document: RunDocument) -> list[dict[str, str]]:
    """A family that only the accelerate backend can load, on colossalai (once the family is known)."""
    family, backend = document.base_model_family, document.training.backend
    if family not in NEW_STACK_FAMILIES or backend != "colossalai":
        return []
    return [
        {
            "field": "training.backend",
            "message": f"is 'colossalai', and a {family} model cannot train there: Colossal-AI 0.5.0 pins diffusers "
            f"0.29, which cannot load it; set training.backend to 'accelerate' (or leave it out: {family} trains on "
            "accelerate by default)",
        }
    ]


def parse_run_document(raw: Any, *, max_shards: int | None = None) -> RunDocument:
    """Validate a decoded document; InvalidRunDocument carries a readable list of problems."""
    if not isinstance(raw, dict):
        raise invalid([{"field": "(document)", "message": f"must be a JSON object, not {_json_type(raw)}"}])
    try:
        document = RunDocument.model_validate(raw)
        size = len(json.dumps(raw, separators=(",", ":")).encode())
    except ValidationError as exc:
        raise invalid(format_errors(exc)) from exc
    except RecursionError as exc:
        raise invalid(
            [{"field": "(document)", "message": "nests too deeply; a run document is a few levels deep"}]
        ) from exc
    if problems := backend_problems(document):
        raise invalid(problems)
    uris = document.dataset.parquet_uris
    if max_shards is not None and uris is not None and len(uris) > max_shards:
        problem = {
            "field": "dataset.parquet_uris",
            "message": f"lists {len(uris)} files; this stack allows at most {max_shards} "
            "(the stack's MaxShards parameter); split the dataset into several runs",
        }
        raise invalid([problem])
    if size > MAX_DOCUMENT_BYTES:
        field = "dataset.parquet_uris" if uris is not None else "(document)"
        problem = {
            "field": field,
            "message": f"the document is {size} bytes; at most {MAX_DOCUMENT_BYTES} fit in the pipeline's "
            "state; put the parquet files under one S3 folder and give `dataset.prefix` instead",
        }
        raise invalid([problem])
    return document


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return type(value).__name__


def json_schema() -> dict[str, Any]:
    schema = RunDocument.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://github.com/sdflow/sdflow/schemas/run-document.schema.json"
    return schema


def schema_text() -> str:
    """The committed file's exact content (stable key order, trailing newline)."""
    return json.dumps(json_schema(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print, write or check the run document's JSON Schema.")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", type=Path, metavar="PATH", help="write the schema to PATH")
    group.add_argument("--check", type=Path, metavar="PATH", help="exit 1 when PATH differs from the model")
    args = parser.parse_args(argv)
    text = schema_text()
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(text, encoding="utf-8")
    elif args.check:
        current = args.check.read_text(encoding="utf-8") if args.check.exists() else ""
        if current != text:
            print(f"{args.check} is stale; regenerate it with --write {args.check}", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
