"""The run document's `training` block (the SageMaker training job) and its `lora` block, with the
constants and the strict base model every block of the run document shares (sdflow_common.run_document
assembles the document from them)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

INSTANCE_TYPE = r"^ml\.[a-z0-9]+(-[a-z0-9]+)*\.[a-z0-9]+$"
# A module name as peft matches it: a dotted path of Python identifiers and indices ("to_out.0").
LORA_TARGET_MODULE = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$"
# SageMaker's maximum for a training job's MaxRuntimeInSeconds is 28 days; a processing job's is
# 9 days (ProcessingMaxRuntimeInSeconds: 777,600, SageMaker's API model).
MAX_RUNTIME_LIMIT = 28 * 24 * 3600
PROCESSING_MAX_RUNTIME_LIMIT = 777_600
# CreateTrainingJob refuses a hyperparameter value over 2,500 characters (HyperParameterValue).
HYPERPARAMETER_VALUE_LIMIT = 2500


class StrictOptions(BaseModel):
    """Every block of the run document: unknown fields refused, values frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class FieldRefusal(ValueError):
    """A rule across fields, refused naming the field to change: `field` is a path below the block whose
    validator raises it (run_document.format_errors reports the problem there, not at the block)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# LoRA defaults: diffusers' LoRA training examples for each family use the same ones, `--rank`
# default 4 and `LoraConfig(r=rank, lora_alpha=rank, lora_dropout` unset (0.0), `target_modules=
# ["to_k", "to_q", "to_v", "to_out.0"])` on the denoiser: examples/text_to_image/train_text_to_image_lora.py
# (SD 1.x/2.x), train_text_to_image_lora_sdxl.py (SDXL) and examples/dreambooth/
# train_dreambooth_lora_sd3.py (SD 3, as of diffusers 0.29/0.30). Text-encoder LoRA, where those
# examples offer it (`--train_text_encoder`: SDXL's script and SD's DreamBooth LoRA script; not SD 3's
# in diffusers 0.29, whose LoRA loader takes the transformer only), targets ["q_proj", "k_proj", "v_proj",
# "out_proj"]. An empty target list in the
# hyperparameters means "the family's default": the image knows each family's module names.
LORA_DEFAULT_RANK = 4
# Which plugin trains LoRA: the image's rule (training_image/sdflow_image/families/base.py
# LORA_REFUSALS; tests/unit/test_training_method.py checks the two agree). Colossal-AI 0.5.0's
# GeminiPlugin has support_lora() False (its enable_lora raises NotImplementedError). LowLevelZero
# says True, but takes LoRA only as the PeftModel that Booster.enable_lora wraps, which renames every
# weight away from the diffusers LoRA format the image writes, and ZeRO's sharded optimizer state
# saves nothing on an adapter of a few MB. So torch_ddp only.
# The accelerate backend's LoRA plugin is ddp: fsdp2 shards weights, gradients and Adam state, and an
# adapter of a few MB gains nothing from that (diffusers' LoRA examples run plain DDP under accelerate).
LORA_PLUGINS = ("torch_ddp", "ddp")
LORA_DEFAULT_PLUGIN = "torch_ddp"
LORA_REFUSALS = {
    "gemini": "Colossal-AI 0.5.0's GeminiPlugin has support_lora() False (its enable_lora raises NotImplementedError)",
    "low_level_zero": (
        "Colossal-AI 0.5.0's LowLevelZero takes LoRA only as the PeftModel Booster.enable_lora makes, whose weight "
        "names are not the diffusers LoRA format the model is served in, and ZeRO saves nothing on a few-MB adapter"
    ),
}
LORA_REFUSALS_ACCELERATE = {
    "fsdp2": "FSDP2 shards weights, gradients and optimizer state across the GPUs, and a LoRA adapter of a few MB "
    "gains nothing from sharding",
}

# The two training backends (docs/run-document.md "Training backends"). The image holds the same rules in
# training_image/sdflow_image/backends/rules.py; the layer cannot import the image, so a test holds them equal:
# keep these plain constants.
BACKENDS = ("colossalai", "accelerate")
# Families whose pipelines diffusers 0.29 (Colossal-AI 0.5.0's pin) cannot load: only the accelerate image has
# their classes (StableDiffusion3Pipeline with qk_norm, Flux2KleinPipeline, QwenImagePipeline).
NEW_STACK_FAMILIES = ("sd35", "flux2", "qwenimage")
BACKEND_OF_FAMILY = {
    "sd": "colossalai",
    "sdxl": "colossalai",
    "sd3": "colossalai",
    "sd35": "accelerate",
    "flux2": "accelerate",
    "qwenimage": "accelerate",
}
PLUGINS_OF_BACKEND = {
    "colossalai": ("torch_ddp", "low_level_zero", "gemini"),
    "accelerate": ("ddp", "fsdp2"),
}
# backend -> method -> the plugin a run that names none trains with. colossalai's full default stays the run
# document's gemini (the image's own flag default, for a job started without a plugin, may differ).
DEFAULT_PLUGIN = {
    "colossalai": {"full": "gemini", "lora": LORA_DEFAULT_PLUGIN},
    "accelerate": {"full": "fsdp2", "lora": "ddp"},
}
# The precisions each backend trains in: FSDP2's mixed precision keeps no loss scaler, so fp16 gradients would
# underflow, and diffusers' examples train the new families in bf16 (the image refuses fp16 there too).
MIXED_PRECISIONS_OF_BACKEND = {"colossalai": ("no", "fp16", "bf16"), "accelerate": ("no", "bf16")}
# The precision a run that names none trains in: the new families' weights are published in bf16.
DEFAULT_MIXED_PRECISION = {"colossalai": "fp16", "accelerate": "bf16"}
AUTO: Final = "auto"

LORA_DEFAULT_DROPOUT = 0.0
LORA_MAX_RANK = 1024
LORA_MAX_TARGETS = 64


class LoraOptions(StrictOptions):
    """A LoRA adapter's shape (training.method lora); defaults as diffusers' LoRA examples."""

    rank: int = Field(default=LORA_DEFAULT_RANK, ge=1, le=LORA_MAX_RANK, description="LoRA rank r.")
    alpha: float | None = Field(
        default=None,
        gt=0,
        le=4096,
        description="LoRA alpha; the update is scaled by alpha / rank.",
    )
    dropout: float = Field(default=LORA_DEFAULT_DROPOUT, ge=0, lt=1, description="Dropout on the LoRA path.")
    target_modules: list[Annotated[str, Field(min_length=1, max_length=200, pattern=LORA_TARGET_MODULE)]] | None = (
        Field(
            default=None,
            max_length=LORA_MAX_TARGETS,
            description=(
                "The modules that get an adapter (peft's `target_modules`). Left out: the family's default, on the "
                "denoiser."
            ),
        )
    )
    text_encoder: bool = Field(
        default=False,
        description=(
            "Also train LoRA on the CLIP text encoder(s) (`q_proj`, `k_proj`, `v_proj`, `out_proj`), as the "
            "examples' `--train_text_encoder`. Refused for SD 3: diffusers 0.29 saves and loads an SD 3 LoRA for "
            "the transformer only."
        ),
    )

    @field_validator("target_modules")
    @classmethod
    def _targets_listed_once(cls, targets: list[str] | None) -> list[str] | None:
        if targets is None:
            return None
        if not targets:
            raise ValueError("is empty; list module names such as 'to_q', or leave it out for the family's default")
        if len(set(targets)) != len(targets):
            raise ValueError("lists a module twice; name each module once")
        size = len(",".join(targets))
        if size > HYPERPARAMETER_VALUE_LIMIT:
            raise ValueError(
                f"the module names take {size} characters as the lora_target_modules hyperparameter, and "
                f"SageMaker allows {HYPERPARAMETER_VALUE_LIMIT}: list fewer modules"
            )
        return targets

    @property
    def effective_alpha(self) -> float:
        return float(self.rank) if self.alpha is None else self.alpha

    def hyperparameters(self) -> dict[str, str]:
        """The contract's lora_* hyperparameters (strings; an empty target list: the family's default)."""
        return {
            "lora_rank": str(self.rank),
            "lora_alpha": f"{self.effective_alpha:g}",
            "lora_dropout": f"{self.dropout:g}",
            "lora_target_modules": ",".join(self.target_modules or []),
            "train_text_encoder_lora": str(self.text_encoder).lower(),
        }


def aspect_buckets_refusal(aspect_buckets: bool, resize_mode: str) -> FieldRefusal | None:
    """Buckets need the images' own aspect ratios: img2dataset's `keep_ratio` keeps them (its shorter side
    becomes download.image_size, which is at least training.resolution, so each image covers its bucket); the
    other modes store squares (center_crop, border) or leave sizes unbounded (no)."""
    if not aspect_buckets or resize_mode == "keep_ratio":
        return None
    return FieldRefusal(
        "training.aspect_buckets",
        f"training.aspect_buckets needs each image's own aspect ratio, and download.resize_mode '{resize_mode}' "
        + ("stores every image as a square" if resize_mode in ("center_crop", "border") else "keeps images at any size")
        + ": set download.resize_mode to 'keep_ratio' (its shorter side becomes download.image_size), or "
        "training.aspect_buckets to false",
    )


class TrainingOptions(StrictOptions):
    instance_type: str = Field(default="ml.g5.12xlarge", pattern=INSTANCE_TYPE, description="Training instance type.")
    instance_count: int = Field(
        default=1, ge=1, le=64, description="Instances; more than 1 trains distributed across nodes."
    )
    volume_size_gb: int = Field(default=200, ge=1, le=16384, description="EBS volume per instance.")
    max_runtime_seconds: int = Field(
        default=24 * 3600, ge=60, le=MAX_RUNTIME_LIMIT, description="Stopping condition of the job."
    )
    use_spot: bool = Field(default=False, description="Managed spot training; requires `max_wait_seconds`.")
    max_wait_seconds: int | None = Field(
        default=None,
        ge=60,
        le=MAX_RUNTIME_LIMIT,
        description="Spot only: runtime plus time waiting for capacity. Setting it without `use_spot` is an error.",
    )
    keep_alive_seconds: int = Field(
        default=0, ge=0, le=3600, description="Warm pool kept after the job (faster next run)."
    )
    max_retry_attempts: int = Field(
        default=2, ge=1, le=30, description="SageMaker RetryStrategy (internal/capacity errors)."
    )
    backend: Literal["auto", "colossalai", "accelerate"] = Field(
        default=AUTO,
        description=(
            "The training backend and the image its jobs run in (see [Training backends](#training-backends)). "
            "`auto`: by the base model's family, `colossalai` for `sd`, `sdxl`, `sd3` and `accelerate` for "
            "`sd35`, `flux2`, `qwenimage`; *Validate run* fills it in. The training job, the evaluation job and "
            "the model package all use the backend's image."
        ),
    )
    plugin: Literal["auto", "torch_ddp", "low_level_zero", "gemini", "ddp", "fsdp2"] = Field(
        default=AUTO,
        description=(
            "Parallelism. colossalai: its booster plugin (`low_level_zero` and `gemini` need GPUs). accelerate: "
            "`ddp` (everything replicated: LoRA, and full fine-tunes that fit one GPU) or `fsdp2` (torch's "
            "`fully_shard`: parameters, gradients and Adam state sharded across every GPU of every instance). "
            "`auto`: `gemini` / `fsdp2` for `method` `full`, `torch_ddp` / `ddp` for `method` `lora`."
        ),
    )
    mixed_precision: Literal["no", "fp16", "bf16"] = Field(
        default="fp16",
        description=(
            "Training precision; a run on the accelerate backend that names none trains in `bf16` (the weights of"
            " its families are published in bf16, and diffusers' examples train them in it); `fp16` there is "
            "refused (FSDP2's mixed precision keeps no loss scaler)."
        ),
    )
    resolution: int = Field(
        default=256,
        ge=32,
        le=2048,
        description=(
            "Training image size in pixels; at most `download.image_size` (unless `download.resize_mode` is "
            '`"no"`): a larger one would train on upsampled images, and the run is refused.'
        ),
    )
    train_batch_size: int = Field(default=8, ge=1, le=1024, description="Samples per step per GPU.")
    gradient_accumulation_steps: int = Field(default=1, ge=1, le=1024, description="Steps per optimizer update.")
    gradient_checkpointing: bool = Field(default=True, description="Trade compute for activation memory.")
    cache_latents: bool = Field(
        default=False,
        description=(
            "Encode each image and caption once (VAE latent distribution, text embeddings) and reuse them in "
            "later epochs; each step still draws its latent from the cached distribution. Removes about a third "
            "of a step's compute at 512² after the first epoch (`bench/bench_cached_latents.py`), for ~180 kB of "
            "host memory per sample (up to 16 GB per process). Needs the same pixels every epoch (the image's "
            "defaults: center crop, no flips). SD 1.x/2.x, SD 3.5, FLUX.2 and Qwen-Image (those on `accelerate`: "
            "`training/embedding_cache.py`)."
        ),
    )
    aspect_buckets: bool = Field(
        default=False,
        description=(
            "Train in aspect-ratio buckets instead of square crops: each image is resized to cover the bucket "
            "nearest its aspect ratio and cropped to it, and every batch holds one bucket. The buckets are SDXL's "
            "published 40 (SDXL paper, arXiv:2307.01952, appendix I: 512x2048 to 2048x512 around 1024² pixels), "
            "scaled to `resolution`² pixels and rounded to the model's size multiple: see [Aspect-ratio buckets]"
            "(#aspect-ratio-buckets). Needs `download.resize_mode` `keep_ratio`."
        ),
    )
    learning_rate: float = Field(default=1e-5, gt=0, le=1, description="AdamW learning rate.")
    max_train_steps: int = Field(default=1000, ge=1, le=10_000_000, description="Optimizer updates in total.")
    checkpointing_steps: int = Field(
        default=500, ge=1, description="Checkpoint every N steps (a spot interruption resumes from the last one)."
    )
    use_ema: bool = Field(default=False, description="Keep an exponential moving average of the UNet.")
    seed: int = Field(default=42, ge=0, description="Random seed.")
    dataloader_num_workers: int = Field(default=4, ge=0, le=64, description="Data loader worker processes.")
    interleave_shards: int = Field(
        default=8,
        ge=1,
        le=64,
        description=(
            "Shards each data reader keeps open and draws samples from at random (1: one shard after another). "
            "Unlike a shuffle buffer, the mix resumes exactly: after a restart training continues where it "
            "stopped, no sample repeated or skipped."
        ),
    )
    validation_prompts: list[Annotated[str, Field(min_length=1, max_length=300)]] = Field(
        default_factory=lambda: ["a photo of a cat"],
        max_length=16,
        description="Rendered into `samples.png` after training.",
    )
    noise_offset: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Noise offset (0 disables): helps the model learn very dark, bright or flat-coloured images.",
    )
    snr_gamma: float = Field(
        default=0.0,
        ge=0,
        le=100,
        description=(
            "Min-SNR loss weighting (Hang et al. 2023), e.g. `5`; 0 disables. Speeds up learning of what the "
            "prompt decides."
        ),
    )
    proportion_empty_prompts: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description=(
            "Share of captions trained as the empty prompt, so classifier-free guidance has an unconditional "
            "prediction to push away from."
        ),
    )
    eval_adherence: bool = Field(
        default=False,
        description=(
            "The training job also scores prompt adherence of the base and the trained model on the 48 held-out "
            "scene prompts at its end (`adherence.png` and the scores in `training_summary.json` in the model "
            "archive; SageMaker metrics `eval:prompt_adherence`, `eval:base_prompt_adherence`). The `Evaluate "
            "model` step scores every run either way."
        ),
    )
    method: Literal["full", "lora"] = Field(
        default="full",
        description=(
            "`full`: every weight of the UNet (SD 3: the transformer) trains; `lora`: a LoRA adapter trains on "
            "the frozen base, and the model's folder holds only the adapter (`pytorch_lora_weights.safetensors`, "
            "megabytes) and `sdflow_model.json` naming the base model."
        ),
    )
    lora: LoraOptions | None = Field(
        default=None,
        description="The adapter's shape: see [`training.lora`](#traininglora--the-lora-adapter-method-lora).",
    )

    @field_validator("validation_prompts")
    @classmethod
    def _prompts_fit_one_hyperparameter(cls, prompts: list[str]) -> list[str]:
        size = len(json.dumps(list(prompts)))
        if size > HYPERPARAMETER_VALUE_LIMIT:
            raise ValueError(
                f"the prompts take {size} characters as the training job's validation_prompts hyperparameter "
                f"(a JSON list), and SageMaker allows {HYPERPARAMETER_VALUE_LIMIT}: use fewer or shorter prompts"
            )
        return prompts

    @model_validator(mode="before")
    @classmethod
    def _backend_defaults(cls, data: Any) -> Any:
        # Once the backend is known (named, or filled in from the family by RunDocument), a run that names no
        # plugin gets the backend's for its method (gemini cannot train LoRA: torch_ddp), and an accelerate run
        # that names no precision trains in bf16.
        if not isinstance(data, dict) or data.get("backend") not in BACKENDS:
            return data
        backend, method = data["backend"], data.get("method", "full")
        filled = dict(data)
        if filled.get("plugin", AUTO) == AUTO and isinstance(method, str) and method in DEFAULT_PLUGIN[backend]:
            filled["plugin"] = DEFAULT_PLUGIN[backend][method]
        if "mixed_precision" not in filled:
            filled["mixed_precision"] = DEFAULT_MIXED_PRECISION[backend]
        return filled

    @field_validator("plugin")
    @classmethod
    def _plugin_fits_backend(cls, plugin: str, info: ValidationInfo) -> str:
        backend = info.data.get("backend", AUTO)  # validated before plugin (field order)
        if plugin == AUTO or backend == AUTO or plugin in PLUGINS_OF_BACKEND[backend]:
            return plugin
        other = next(name for name, plugins in PLUGINS_OF_BACKEND.items() if plugin in plugins)
        raise ValueError(
            f"'{plugin}' is a plugin of the {other} backend, and training.backend is '{backend}' (as given, or the "
            f"default for the base model's family): set training.backend to '{other}', or training.plugin to one of "
            f"{', '.join(PLUGINS_OF_BACKEND[backend])} (or leave it out)"
        )

    @model_validator(mode="after")
    def _method_fits_plugin(self) -> TrainingOptions:
        if self.lora is not None and self.method != "lora":
            raise FieldRefusal(
                "lora",
                "training.lora is set but training.method is 'full': set training.method to 'lora', or remove "
                "training.lora",
            )
        if self.method == "lora" and self.plugin in LORA_REFUSALS_ACCELERATE:
            raise FieldRefusal(
                "plugin",
                f"training.plugin '{self.plugin}' cannot train LoRA: {LORA_REFUSALS_ACCELERATE[self.plugin]}; set "
                "training.plugin to ddp (or leave it out), or train with training.method 'full'",
            )
        if self.method == "lora" and self.plugin in LORA_REFUSALS:
            raise FieldRefusal(
                "plugin",
                f"training.plugin '{self.plugin}' cannot train LoRA: {LORA_REFUSALS[self.plugin]}; set "
                "training.plugin to torch_ddp (or leave it out), or train with training.method 'full'",
            )
        if self.method == "lora" and self.use_ema:
            raise FieldRefusal(
                "use_ema",
                "training.use_ema is for training.method 'full': diffusers' LoRA examples keep no EMA of an "
                "adapter; set training.use_ema to false",
            )
        if self.backend in BACKENDS and self.mixed_precision not in MIXED_PRECISIONS_OF_BACKEND[self.backend]:
            raise FieldRefusal(
                "mixed_precision",
                f"training.mixed_precision '{self.mixed_precision}' cannot train on the {self.backend} backend: "
                "FSDP2's mixed precision keeps no loss scaler (fp16 gradients would underflow), and diffusers' "
                "examples train these models in bf16; set training.mixed_precision to 'bf16' (or leave it out)",
            )
        if self.plugin == "fsdp2" and self.use_ema:
            raise FieldRefusal(
                "use_ema",
                "training.use_ema is not supported with training.plugin 'fsdp2': each GPU holds a shard of every "
                "weight, and the image keeps the average whole; set training.plugin to 'ddp' where the model fits "
                "one GPU, or training.use_ema to false",
            )
        if self.plugin == "gemini" and self.mixed_precision == "no":
            raise FieldRefusal(
                "plugin",
                "training.plugin 'gemini' trains in fp16 or bf16 only (Colossal-AI's GeminiPlugin has no fp32): set "
                "training.mixed_precision to 'bf16' or 'fp16', or training.plugin to low_level_zero or torch_ddp",
            )
        return self

    @property
    def lora_options(self) -> LoraOptions:
        """The LoRA settings in force: the document's, or the defaults."""
        return self.lora if self.lora is not None else LoraOptions()

    @model_validator(mode="after")
    def _spot_needs_wait(self) -> TrainingOptions:
        if self.use_spot:
            if self.max_wait_seconds is None:
                raise FieldRefusal("max_wait_seconds", "use_spot is true: set max_wait_seconds (≥ max_runtime_seconds)")
            if self.max_wait_seconds < self.max_runtime_seconds:
                raise FieldRefusal("max_wait_seconds", "max_wait_seconds must be ≥ max_runtime_seconds")
            if self.keep_alive_seconds:
                # SageMaker refuses warm pools (KeepAlivePeriodInSeconds) for spot training jobs.
                raise FieldRefusal(
                    "keep_alive_seconds", "keep_alive_seconds (warm pool) cannot be used with use_spot; set one of them"
                )
        elif self.max_wait_seconds is not None:
            raise FieldRefusal(
                "max_wait_seconds", "max_wait_seconds is only for spot training; set use_spot: true or drop it"
            )
        return self

    def hyperparameters(self) -> dict[str, str]:
        """The training container's hyperparameters, as the strings SageMaker delivers."""
        values: dict[str, Any] = {
            "mixed_precision": self.mixed_precision,
            "resolution": self.resolution,
            "train_batch_size": self.train_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "gradient_checkpointing": self.gradient_checkpointing,
            "cache_latents": self.cache_latents,
            "aspect_buckets": self.aspect_buckets,
            "learning_rate": self.learning_rate,
            "max_train_steps": self.max_train_steps,
            "checkpointing_steps": self.checkpointing_steps,
            "use_ema": self.use_ema,
            "seed": self.seed,
            "dataloader_num_workers": self.dataloader_num_workers,
            "interleave_shards": self.interleave_shards,
            "validation_prompts": json.dumps(list(self.validation_prompts)),
            "noise_offset": self.noise_offset,
            "snr_gamma": self.snr_gamma,
            "proportion_empty_prompts": self.proportion_empty_prompts,
            "eval_adherence": self.eval_adherence,
            "training_method": self.method,
            **self.lora_options.hyperparameters(),
        }
        # An unresolved backend or plugin (a document that never went through Validate run) is left to the image's
        # own defaults, as model_family is (sagemaker_jobs.family_hyperparameters).
        values |= {name: value for name, value in (("backend", self.backend), ("plugin", self.plugin)) if value != AUTO}
        return {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in values.items()}
