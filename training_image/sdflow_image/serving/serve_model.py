"""The served model: its settings, loading it, what training said about it, and how fast it is.

`<model_dir>/sdflow_model.json`, written by the training job, gives the size the model was
trained at (the default serving size: a Stable Diffusion model asked for another size draws
worse) and the dtype its weights were saved in (used on a GPU; a CPU computes in float32).

A LoRA model (`"method": "lora"` there) is an adapter only: the base pipeline is loaded from
`base_model_dir` (env SDFLOW_BASE_MODEL_DIR; on SageMaker the model's AdditionalModelDataSources
channel "base_model"), the adapter on it, fused where that is exact (`load_pipeline`). The
family (SD, SDXL, SD3) comes from the pipeline's model_index.json.

A generation's time is estimated from a timing taken once at load: denoising steps dominate,
and each costs about the same at a given size, so a request costs
`images * (width * height / size**2) * (overhead + steps * step)`, scaled linearly in pixels.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdflow_image import contract
from sdflow_image.families.base import FAMILIES
from sdflow_image.serving.serve_request import SIZE_MULTIPLE, SizeLimits

MODEL_INFO_FILE = "sdflow_model.json"
# Where SageMaker puts a model's AdditionalModelDataSources channel named "base_model".
DEFAULT_BASE_MODEL_DIR = "/opt/ml/additional-model-data-sources/base_model"
DTYPES = ("float16", "bfloat16", "float32")
FALLBACK_IMAGE_SIZE = 512  # when neither training nor the pipeline says what size it was trained at
# InvokeEndpoint: "A customer's model containers must respond to requests within 60 seconds."
# (https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_runtime_InvokeEndpoint.html)
INVOCATION_LIMIT_S = 60.0
CALIBRATION_STEPS = 3
CALIBRATION_GUIDANCE = 7.5  # > 1: classifier-free guidance doubles the UNet batch, as most requests do


class ServeError(Exception):
    """Base class of the serve job's own errors."""


class ModelNotFoundError(ServeError):
    """The model folder holds no diffusers pipeline."""


class ModelInfoError(ServeError):
    """sdflow_model.json is there but unreadable or holds a value the server cannot use."""


@dataclass(frozen=True)
class ServeSettings:
    model_dir: Path = field(default_factory=contract.model_dir)
    base_model_dir: Path = field(
        default_factory=lambda: Path(os.environ.get("SDFLOW_BASE_MODEL_DIR") or DEFAULT_BASE_MODEL_DIR)
    )
    host: str = "0.0.0.0"
    port: int = 8080
    max_queue: int = 1000  # a guard on memory: load is shed by time first (serve_admission)
    limits: SizeLimits = field(default_factory=SizeLimits)
    max_body_bytes: int = 64 * 1024
    device: str = "auto"
    dtype: str = "auto"
    graceful_timeout: int = 60
    log_level: str = "info"
    invocation_limit_s: float = INVOCATION_LIMIT_S


@dataclass(frozen=True)
class ModelInfo:
    """What the training job recorded in sdflow_model.json (the fields the server uses)."""

    resolution: int
    dtype: str
    family: str | None = None  # None: an older model's file; the family is the pipeline's
    method: str = "full"
    left_out: tuple[str, ...] = ()  # components trained without (SD3's T5): loaded without too


def read_model_info(model_dir: Path) -> ModelInfo | None:
    """sdflow_model.json's resolution and dtype; None when training wrote no such file."""
    path = model_dir / MODEL_INFO_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelInfoError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelInfoError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    resolution = raw.get("resolution")
    if type(resolution) is not int or resolution <= 0 or resolution % SIZE_MULTIPLE:
        raise ModelInfoError(
            f"{path}: resolution must be a positive multiple of {SIZE_MULTIPLE} (the training size), got {resolution!r}"
        )
    dtype = raw.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ModelInfoError(f"{path}: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    method = raw.get("method", "full")
    if method not in ("full", "lora"):
        raise ModelInfoError(f"{path}: method must be full or lora, got {method!r}")
    family = raw.get("family")
    if family is not None and family not in FAMILIES:
        raise ModelInfoError(f"{path}: family must be one of {', '.join(FAMILIES)}, got {family!r}")
    left_out = raw.get("left_out", [])
    if not isinstance(left_out, list) or not set(left_out) <= {"text_encoder_3", "tokenizer_3"}:
        raise ModelInfoError(f"{path}: left_out may name text_encoder_3 and tokenizer_3 only, got {left_out!r}")
    return ModelInfo(resolution=resolution, dtype=dtype, family=family, method=method, left_out=tuple(left_out))


BF16_MIN_CAPABILITY = (8, 0)  # Ampere: the first GPUs with bf16 tensor cores (T4 and V100 have none)
# The families a GPU serves in bfloat16 whatever their weights were saved in: released, trained and
# documented in bf16 (their pipelines' examples load torch_dtype=torch.bfloat16), and their
# activations overflow float16: FLUX gave NaN (black) images in fp16 (huggingface/diffusers#9096),
# and diffusers 0.42's FLUX.2 and Qwen-Image transformers clip fp16 activations at +-65504 to hide
# it (transformer_flux2.py, transformer_qwenimage.py), which saturates instead. A GPU without bf16
# tensor cores runs them slowly, not wrongly.
BF16_FAMILIES = ("sd35", "flux2", "qwenimage")


def serving_dtype(family: str | None, saved: str | None, capability: tuple[int, int]) -> str:
    """The dtype a GPU of `capability` serves (and evaluates) a model of `family` in, whose weights
    were saved in `saved` (sdflow_model.json's dtype; None: not recorded): the one rule of the
    endpoint and the evaluate job. bf16 for BF16_FAMILIES; for SD 1.x/2.x, SDXL and SD 3, half
    precision whatever the training precision was: bf16 where the model was saved in bf16 and the
    GPU has bf16 tensor cores (compute capability 8.0 on), else float16 (a bf16 model on a T4 or
    V100 ran in emulation; a float32 one used twice the memory and time for nothing)."""
    if family in BF16_FAMILIES:
        return "bfloat16"
    return "bfloat16" if saved == "bfloat16" and capability >= BF16_MIN_CAPABILITY else "float16"


def torch_placement(
    settings: ServeSettings,
    info: ModelInfo | None,
    capability: tuple[int, int] | None = None,
    family: str | None = None,
) -> tuple[str, Any]:
    """(device, torch dtype). A CPU computes in float32 (it lacks fast half kernels); a GPU in
    `serving_dtype` of the model's family (`family`, else sdflow_model.json's); an explicit
    `settings.dtype` wins."""
    import torch

    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype_name = settings.dtype
    if dtype_name == "auto":
        if not device.startswith("cuda"):
            dtype_name = "float32"
        else:
            capability = capability or torch.cuda.get_device_capability(device)
            family = family or (info.family if info is not None else None)
            dtype_name = serving_dtype(family, info.dtype if info is not None else None, capability)
    return device, getattr(torch, dtype_name)


def serving_devices(settings: ServeSettings, gpus: int | None = None) -> list[str]:
    """Where the server keeps a copy of the model, one per device: every GPU of the instance
    ("auto" or "cuda": a g5.12xlarge's four serve four requests at once), the one named
    ("cuda:1", "cpu"), or the CPU where there is no GPU."""
    if settings.device not in ("auto", "cuda"):
        return [settings.device]
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        return ["cpu" if settings.device == "auto" else "cuda"]
    return [f"cuda:{index}" for index in range(gpus)]


def pipeline_dir(settings: ServeSettings, info: ModelInfo | None) -> Path:
    """The folder the pipeline loads from: the model's, or for a LoRA adapter its base model's."""
    model_dir = settings.model_dir
    lora = info is not None and info.method == "lora"
    folder = settings.base_model_dir if lora else model_dir
    if not (folder / "model_index.json").is_file():
        if lora:
            raise ModelNotFoundError(
                f"{model_dir} holds a LoRA adapter, and its base model is not in {folder} (model_index.json "
                "missing): give the model its base as the AdditionalModelDataSources channel 'base_model', "
                "or set SDFLOW_BASE_MODEL_DIR"
            )
        raise ModelNotFoundError(
            f"no diffusers pipeline in {model_dir} (model_index.json missing); "
            "the training job writes one to $SDFLOW_OPT_ML/model"
        )
    return folder


def load_pipeline(settings: ServeSettings) -> Any:
    """Load the diffusers pipeline from the model folder (a LoRA: the base and the adapter);
    nothing is fetched from a hub."""
    from sdflow_image import families

    info = read_model_info(settings.model_dir)
    folder = pipeline_dir(settings, info)
    try:
        family = families.get(families.detect_family(folder))
    except families.FamilyError as exc:
        raise ModelNotFoundError(str(exc)) from None
    if info is not None and info.family not in (None, family.name):
        raise ModelInfoError(f"{settings.model_dir} was trained as {info.family}, but {folder} is a {family.name}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from diffusers.utils import logging as diffusers_logging

    # Progress bars are noise in a server's log (CloudWatch keeps every redraw).
    diffusers_logging.disable_progress_bar()
    device, dtype = torch_placement(settings, info, family=family.name)
    pipe = family.pipeline_class().from_pretrained(
        str(folder),
        local_files_only=True,
        torch_dtype=dtype,  # diffusers 0.29 names it torch_dtype (`dtype` came in later releases)
        **family.pipeline_kwargs,  # SD: no safety checker
        **dict.fromkeys(info.left_out if info is not None else ()),
    )
    if info is not None and info.method == "lora":
        attach_adapter(pipe, settings.model_dir, info, dtype)
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    # Decode the images of a request one at a time: four 1024² images in one VAE batch ran a
    # 24 GB A10G out of memory, and the latents are small next to the decoder's activations.
    # On the VAE itself: 0.29's SD3 pipeline has no enable_vae_slicing (it only forwards to this).
    pipe.vae.enable_slicing()
    return pipe


def attach_adapter(pipe: Any, model_dir: Path, info: ModelInfo, dtype: Any) -> None:
    """Load the LoRA adapter onto the base pipeline, and fuse it when that is exact.

    Fusing (W += scale * B @ A) saves the adapter's extra matmuls on every step, but it rounds
    the sum to the weights' dtype: a bf16 base fused with a delta trained against fp32 weights
    loses the small updates the adapter learned (they are below bf16's resolution at W's scale),
    and the adapter would then serve another model than the one evaluated. So it is fused only
    when the serving dtype is the one it was trained against (sdflow_model.json's dtype); else
    the adapter runs beside the weights, computing B @ A @ x unrounded into W."""
    import torch

    from sdflow_image.training import lora

    lora.load_adapter(pipe, model_dir)
    if getattr(torch, info.dtype) == dtype:
        lora.fuse(pipe)


def default_size(info: ModelInfo | None, pipe: Any) -> int:
    """The trained size: sdflow_model.json's, else the denoiser's latent size times the VAE's scale
    (FLUX.2 and Qwen-Image transformers have none: their pipeline's default_sample_size)."""
    if info is not None:
        return info.resolution
    try:
        denoiser = getattr(pipe, "unet", None) or pipe.transformer
        sample_size = getattr(denoiser.config, "sample_size", None) or pipe.default_sample_size
        return int(sample_size) * int(pipe.vae_scale_factor)
    except (AttributeError, TypeError, ValueError):
        return FALLBACK_IMAGE_SIZE


@dataclass(frozen=True)
class StepTiming:
    """One image at `size`²: seconds per denoising step, and the rest (text encoder, VAE, PNG)."""

    size: int
    step_s: float
    overhead_s: float

    def estimate_s(self, *, steps: int, images: int, width: int, height: int) -> float:
        pixels = (width * height) / (self.size * self.size)
        return images * pixels * (self.overhead_s + steps * self.step_s)

    def max_steps(self, *, images: int, width: int, height: int, limit_s: float) -> int:
        """The most steps that fit in `limit_s` at this size and count (0 when none do)."""
        per_image = limit_s / (images * (width * height) / (self.size * self.size))
        return max(0, int((per_image - self.overhead_s) / self.step_s)) if self.step_s > 0 else 10**6


def calibrate(pipe: Any, size: int) -> StepTiming:
    """Time the pipeline at `size`: a warm-up call (lazy initialisation, kernel choice), then
    a timed one whose step-end callbacks give the per-step time; the slowest step is kept."""
    import torch

    from sdflow_image import families

    marks: list[float] = []

    def mark(pipeline: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        marks.append(time.monotonic())
        return {}

    def run(steps: int) -> None:
        result = pipe(
            **families.call_kwargs(pipe, "calibration", None, CALIBRATION_GUIDANCE),
            num_inference_steps=steps,
            width=size,
            height=size,
            num_images_per_prompt=1,
            generator=torch.Generator("cpu").manual_seed(0),
            output_type="pil",
            callback_on_step_end=mark,
        )
        for image in result.images:
            to_png(image)

    run(1)
    marks.clear()
    started = time.monotonic()
    run(CALIBRATION_STEPS)
    total = time.monotonic() - started
    gaps = [b - a for a, b in itertools.pairwise(marks)]
    step_s = max(gaps) if gaps else total / CALIBRATION_STEPS
    overhead_s = max(0.0, total - CALIBRATION_STEPS * statistics.fmean(gaps or [step_s]))
    return StepTiming(size=size, step_s=step_s, overhead_s=overhead_s)


def to_png(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
