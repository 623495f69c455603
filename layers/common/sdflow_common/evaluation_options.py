"""The run document's `evaluation` block (Evaluate model and the quality gate), with the scene grammar of the
prompt-adherence score and the held-out split's sizing constants (run_document assembles the document)."""

from __future__ import annotations

import math
import re
from typing import Annotated

from pydantic import Field, ValidationInfo, field_validator, model_validator

from sdflow_common.document_values import parse_s3_uri, printable
from sdflow_common.quality_gate import QualityGate, with_min_prompt_adherence
from sdflow_common.training_options import INSTANCE_TYPE, PROCESSING_MAX_RUNTIME_LIMIT
from sdflow_common.training_options import StrictOptions as _Strict

# The scene grammar of the prompt-adherence score (training_image/sdflow_image/scenes.py, which the
# layer cannot import; tests/unit/test_run_document.py checks the two agree).
SCENE_COLOURS = ("red", "green", "blue", "yellow", "white", "black", "orange", "purple")
SCENE_SHAPES = ("square", "circle", "triangle")
SCENE_PROMPT = re.compile(r"^an? (?P<fg>[a-z]+) (?P<shape>[a-z]+) on an? (?P<bg>[a-z]+) background$")
SCENE_GRAMMAR = "a <colour> <shape> on a <colour> background"
MAX_EVALUATION_PROMPTS = 256

# The held-out split (docs/run-document.md "Evaluation"): Validate run picks the rate that holds out about
# HOLDOUT_OVERSAMPLE x holdout_samples of the parquet rows (downloads of web images fail for some URLs, so more
# candidates than needed are held out; the evaluation scores the holdout_samples of them with the smallest
# holdout fraction), and refuses a rate above MAX_HOLDOUT_RATE: more would take too much from training.
HOLDOUT_OVERSAMPLE = 1.5
MAX_HOLDOUT_RATE = 0.2
# Automatic size (holdout_samples null): AUTO_HOLDOUT_SAMPLES when the dataset holds them, no split under
# MIN_AUTO_HOLDOUT (KID over fewer images says little; such a dataset is a test, and a user may still ask).
AUTO_HOLDOUT_SAMPLES = 256
MIN_AUTO_HOLDOUT = 64
MAX_HOLDOUT_SAMPLES = 10_000


def scene_prompt_problem(prompt: str) -> str | None:
    """Why the adherence score cannot read `prompt`, or None when it follows the grammar."""
    match = SCENE_PROMPT.match(prompt)
    if match is None:
        return f"'{printable(prompt)}' does not follow '{SCENE_GRAMMAR}'"
    for word, allowed, what in (
        (match["fg"], SCENE_COLOURS, "colour"),
        (match["shape"], SCENE_SHAPES, "shape"),
        (match["bg"], SCENE_COLOURS, "colour"),
    ):
        if word not in allowed:
            return f"'{printable(prompt)}': unknown {what} '{printable(word)}'; use one of {', '.join(allowed)}"
    return None


def most_holdout_samples(rows: int) -> int:
    """The most held-out samples `rows` parquet rows can give without a rate above MAX_HOLDOUT_RATE."""
    return math.floor(rows * MAX_HOLDOUT_RATE / HOLDOUT_OVERSAMPLE + 1e-9)


def auto_holdout_samples(rows: int) -> int:
    """holdout_samples null: up to AUTO_HOLDOUT_SAMPLES, 0 (no split) when fewer than MIN_AUTO_HOLDOUT fit."""
    samples = min(AUTO_HOLDOUT_SAMPLES, most_holdout_samples(rows))
    return samples if samples >= MIN_AUTO_HOLDOUT else 0


def holdout_rate(samples: int, rows: int) -> float:
    """The share of rows held out for `samples` held-out samples (contract: min(1, 1.5 x samples / rows))."""
    if samples <= 0:
        return 0.0
    return min(1.0, HOLDOUT_OVERSAMPLE * samples / rows) if rows > 0 else 1.0


class EvaluationOptions(_Strict):
    """Evaluate model: a processing job of the training image renders the held-out captions (and, with scene
    adherence, the scene prompts) with the base and the trained model, scores both (CLIP score, KID, FID, scene
    adherence) and writes evaluation.json, holdout.png and adherence.png; Register model applies the gate."""

    min_prompt_adherence: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="The older form of `gate.prompt_adherence.min`.",
    )
    prompts: list[Annotated[str, Field(min_length=1, max_length=300)]] | None = Field(
        default=None,
        max_length=MAX_EVALUATION_PROMPTS,
        description="The scene prompts to score (held out of the demo's training captions).",
    )
    prompts_uri: str | None = Field(
        default=None,
        description="Or a file of scene prompts: a JSON list, or one prompt a line (`#` comments).",
    )
    num_inference_steps: int = Field(default=20, ge=1, le=200, description="Denoising steps per image.")
    guidance_scale: float = Field(default=5.0, ge=0, le=50, description="Classifier-free guidance.")
    instance_type: str | None = Field(
        default=None,
        pattern=INSTANCE_TYPE,
        description=(
            "The evaluation job's instance. `null`: the smallest GPU instance type whose GPU holds one pipeline "
            "of the family and the CLIP model (see [Memory before money](#memory-before-money)); written back "
            "into the run."
        ),
    )
    max_runtime_seconds: int = Field(
        default=3600,
        ge=60,
        le=PROCESSING_MAX_RUNTIME_LIMIT,
        description="The evaluation job's stopping condition.",
    )
    holdout_samples: int | None = Field(
        default=None,
        ge=0,
        le=MAX_HOLDOUT_SAMPLES,
        description="Held-out samples of the dataset (never trained on) the evaluation scores; 0: no held-out "
        f"split; null: Validate run picks min({AUTO_HOLDOUT_SAMPLES}, what the dataset holds), 0 under "
        f"{MIN_AUTO_HOLDOUT}, and writes the number back into the run.",
    )
    clip_model_uri: str | None = Field(
        default=None,
        description="The CLIP model of `clip_score`, `kid` and `fid`; without it they are reported missing.",
    )
    scene_adherence: bool | None = Field(
        default=None,
        description=(
            "Score the scene prompts. `null`: on when `prompts`, `prompts_uri`, `min_prompt_adherence` or "
            "`gate.prompt_adherence` is given, or when the run computes no held-out metric (no `clip_model_uri`, "
            "or `holdout_samples` 0), so that the job scores something. Written back into the run."
        ),
    )
    gate: QualityGate = Field(
        default_factory=QualityGate,
        description=(
            "The quality gate: any failed bound registers the model `Rejected` and fails the run with "
            "`QualityGateFailed`, naming every failed rule with its numbers; the endpoint keeps serving its "
            "current model."
        ),
    )

    @field_validator("prompts")
    @classmethod
    def _prompts_follow_grammar(cls, prompts: list[str] | None) -> list[str] | None:
        if prompts is None:
            return None
        if not prompts:
            raise ValueError("is empty; list at least one prompt, or leave it out for the 48 held-out prompts")
        problems = [problem for prompt in prompts if (problem := scene_prompt_problem(prompt))]
        if problems:
            raise ValueError(f"{problems[0]} (the adherence score reads only that grammar)")
        return prompts

    @field_validator("prompts_uri")
    @classmethod
    def _prompts_uri_is_s3(cls, uri: str | None) -> str | None:
        if uri is not None:
            _bucket, key = parse_s3_uri(uri)
            if not key or key.endswith("/"):
                raise ValueError(f"'{uri}' names a folder; give the object that lists the prompts")
        return uri

    @field_validator("clip_model_uri")
    @classmethod
    def _clip_model_is_s3(cls, uri: str | None) -> str | None:
        if uri is not None:
            parse_s3_uri(uri)
        return uri

    @field_validator("scene_adherence")
    @classmethod
    def _prompts_mean_scene_adherence(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        given = [name for name in ("prompts", "prompts_uri") if info.data.get(name) is not None]
        if value is False and given:
            raise ValueError(
                f"is false, and evaluation.{given[0]} lists scene prompts, which only the scene adherence scores: "
                f"set scene_adherence to true (or leave it out), or remove {given[0]}"
            )
        return value

    @field_validator("gate")
    @classmethod
    def _one_prompt_adherence_bound(cls, gate: QualityGate, info: ValidationInfo) -> QualityGate:
        if gate.prompt_adherence is not None and info.data.get("min_prompt_adherence") is not None:
            raise ValueError(
                "sets prompt_adherence, and evaluation.min_prompt_adherence (its older form, "
                "gate.prompt_adherence.min) is given too: put the bound in gate.prompt_adherence only and remove "
                "min_prompt_adherence"
            )
        return gate

    @model_validator(mode="after")
    def _one_prompt_source(self) -> EvaluationOptions:
        if self.prompts is not None and self.prompts_uri is not None:
            raise ValueError("give `prompts` or `prompts_uri`, not both")
        return self

    @property
    def scene_adherence_on(self) -> bool:
        """scene_adherence as the job gets it: as given; null → on when scene prompts or a scene gate ask for it, or
        when the run computes no held-out metric (no CLIP model, or holdout_samples 0), so the job scores something."""
        if self.scene_adherence is not None:
            return self.scene_adherence
        asked = (self.prompts, self.prompts_uri, self.min_prompt_adherence, self.gate.prompt_adherence)
        return any(value is not None for value in asked) or self.clip_model_uri is None or self.holdout_samples == 0

    @property
    def effective_gate(self) -> QualityGate:
        """The gate Register model applies: `gate` with min_prompt_adherence as prompt_adherence.min."""
        return with_min_prompt_adherence(self.gate, self.min_prompt_adherence)
