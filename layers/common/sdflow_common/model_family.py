"""The base model's family, read from its model_index.json, and the memory check that depends on it.

diffusers' `save_pretrained` writes the pipeline's class as `_class_name` in model_index.json; its
class decides how a run trains, samples and serves (docs/run-document.md "Model families"):

    StableDiffusionPipeline    sd    SD 1.x / 2.x (UNet, one CLIP text encoder; epsilon or v-prediction)
    StableDiffusionXLPipeline  sdxl  SDXL (UNet, two CLIP text encoders, pooled embeddings, time ids)
    StableDiffusion3Pipeline   sd3   SD 3 (MMDiT transformer, CLIP-L, CLIP-G, optional T5; flow matching)
    StableDiffusion3Pipeline   sd35  SD 3.5 Large / Large Turbo / Medium: its transformer/config.json sets qk_norm
    Flux2KleinPipeline         flux2 FLUX.2 [klein] 4B / 9B (Flux2Transformer2DModel, Qwen3 text encoder; flow matching)
    QwenImagePipeline          qwenimage  Qwen-Image (20 B MMDiT, Qwen2.5-VL text encoder; flow matching)

SD 3 and SD 3.5 share a pipeline class: Validate run reads transformer/config.json of an SD 3 pipeline to
tell them apart (and SD 3.5 Large from Medium), and of a FLUX.2 one to tell 4B from 9B, for the memory
estimate. The last three train only on the accelerate backend (training_options.NEW_STACK_FAMILIES).
Any other class (an inpainting or img2img pipeline, PixArt, FLUX.1, …) is refused, naming it."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from sdflow_common import inference_memory, instance_types, memory_estimate, request_limits
from sdflow_common.errors import InvalidRunDocument
from sdflow_common.run_document import RunDocument, invalid, parse_run_document

FAMILY_OF_CLASS = {
    "StableDiffusionPipeline": "sd",
    "StableDiffusionXLPipeline": "sdxl",
    "StableDiffusion3Pipeline": "sd3",
    "Flux2KleinPipeline": "flux2",
    "QwenImagePipeline": "qwenimage",
}
# Families whose transformer/config.json Validate run reads too (transformer_config).
TRANSFORMER_CONFIG_FAMILIES = ("sd3", "flux2")
TRANSFORMER_CONFIG = "transformer/config.json"
# FLUX.2 [klein] 9B has 32 attention heads of 128 (width 4096), the 4B 24 (width 3072).
FLUX2_9B_HEADS = 32
# Families trained on a flow-matching objective: the DDPM loss weightings mean nothing to them.
FLOW_MATCHING_FAMILIES = {
    "sd3": "an SD 3",
    "sd35": "an SD 3.5",
    "flux2": "a FLUX.2 [klein]",
    "qwenimage": "a Qwen-Image",
}
# Families whose LoRA sdflow trains on the denoiser only: diffusers 0.29 saves an SD 3 LoRA for the transformer
# only, and diffusers' SD 3.5, FLUX.2 [klein] and Qwen-Image LoRA scripts train the transformer only (their text
# encoders are a T5 or a chat model's decoder, not CLIP).
TRANSFORMER_ONLY_LORA = {
    "sd3": "diffusers 0.29 saves and loads an SD 3 LoRA for the transformer only",
    "sd35": "the accelerate backend trains an SD 3.5 LoRA on the transformer only, as diffusers' "
    "train_dreambooth_lora_sd3.py does",
    "flux2": "the accelerate backend trains a FLUX.2 LoRA on the transformer only (its text encoder is Qwen3), as "
    "diffusers' FLUX.2 LoRA scripts do",
    "qwenimage": "the accelerate backend trains a Qwen-Image LoRA on the transformer only (its text encoder is "
    "Qwen2.5-VL), as diffusers' train_dreambooth_lora_qwen_image.py does",
}
# Families whose text encoders' embeddings training.cache_latents caches with the VAE's latents (the image's
# train.CACHE_FAMILIES holds the same): SD 1.x/2.x's CLIP, and the accelerate backend's FLUX.2 [klein], Qwen-Image
# and SD 3.5 encoders.
CACHE_FAMILIES = ("sd", "flux2", "qwenimage", "sd35")
SUPPORTED = ", ".join(f"{name} ({family})" for name, family in FAMILY_OF_CLASS.items())


def _problem(field: str, message: str) -> InvalidRunDocument:
    return invalid([{"field": field, "message": message}])


@dataclass(frozen=True)
class BaseModelIndex:
    """What Validate run learns from model_index.json."""

    family: str
    # SD 3 may be saved without its T5 encoder (`"text_encoder_3": [null, null]`): 4.8 B parameters the job
    # then never loads (the image conditions on zeros in its place, as diffusers' SD 3 pipeline does).
    with_t5: bool = True
    # Which model of the family (memory_estimate.reference): "" its largest, "medium" (SD 3.5), "4b" (FLUX.2).
    variant: str = ""
    # The components model_index.json lists (name, class), in its order; those it lists as null left out
    # (model_checks.check_components looks for each one's files).
    components: tuple[tuple[str, str], ...] = ()


def listed_components(index: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """model_index.json's components: every key not starting with "_" whose value is [library, class] (diffusers'
    `save_pretrained` writes [null, null] for one saved without, e.g. SD 3's T5, and plain values for settings
    such as `force_zeros_for_empty_prompt`)."""
    return tuple(
        (name, str(value[1]))
        for name, value in index.items()
        if not name.startswith("_")
        and isinstance(value, list)
        and len(value) == 2
        and all(isinstance(part, str) for part in value)
    )


def family_of_index(body: bytes, index_uri: str) -> BaseModelIndex:
    """The family a model_index.json names; InvalidRunDocument (field base_model_uri) otherwise."""
    try:
        index: Any = json.loads(body)
    except ValueError:
        index = None
    if not isinstance(index, dict):
        raise _problem(
            "base_model_uri",
            f"{index_uri} is not a JSON object; give the folder of a diffusers-format model saved with "
            "pipeline.save_pretrained()",
        )
    name = index.get("_class_name")
    family = FAMILY_OF_CLASS.get(name) if isinstance(name, str) else None
    if family is None:
        shown = repr(name)[:80] if name is not None else "no _class_name"
        raise _problem(
            "base_model_uri",
            f"{index_uri} names {shown}: sdflow fine-tunes {SUPPORTED}; give the folder of one of those "
            "(the text-to-image pipeline, not an inpainting or img2img one)",
        )
    t5 = index.get("text_encoder_3")
    with_t5 = family == "sd3" and isinstance(t5, list) and bool(t5) and t5[0] is not None
    return BaseModelIndex(family=family, with_t5=with_t5, components=listed_components(index))


def _config_value(config: dict[str, Any], key: str) -> Any:
    value = config.get(key)
    return value if value not in (None, False, [], "") else None


def family_of_transformer(found: BaseModelIndex, body: bytes, config_uri: str) -> BaseModelIndex:
    """An SD 3 pipeline whose transformer sets `qk_norm` is SD 3.5 (diffusers 0.29's SD3Transformer2DModel has no
    such argument, so only the accelerate backend loads it); SD 3.5 Medium also has `dual_attention_layers`. A
    FLUX.2 [klein] transformer of 32 attention heads is the 9B, of fewer the 4B."""
    try:
        config: Any = json.loads(body)
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise _problem(
            "base_model_uri",
            f"{config_uri} is not a JSON object; give the folder of a diffusers-format model saved with "
            "pipeline.save_pretrained()",
        )
    if found.family == "sd3" and _config_value(config, "qk_norm") is not None:
        variant = "medium" if _config_value(config, "dual_attention_layers") is not None else ""
        return replace(found, family="sd35", variant=variant)
    if found.family == "flux2":
        heads = config.get("num_attention_heads")
        small = isinstance(heads, int) and not isinstance(heads, bool) and heads < FLUX2_9B_HEADS
        return replace(found, with_t5=False, variant="4b" if small else "")
    return found


def resolve_family(document: RunDocument, found: str) -> RunDocument:
    """The document with `base_model_family` set to what the model is (a stated family must agree), and with it
    the training backend, plugin and precision a run that names none gets (training_options BACKEND_OF_FAMILY,
    DEFAULT_PLUGIN, DEFAULT_MIXED_PRECISION). The document is validated again with the family: the pairs only
    the family decides (a new family on colossalai, a plugin of the other backend) are refused here, by field."""
    stated = document.base_model_family
    if stated not in ("auto", found):
        raise _problem(
            "base_model_family",
            f"is '{stated}', but {document.base_model_uri} is a '{found}' model (its model_index.json"
            f"{' and transformer/config.json' if found == 'sd35' or stated == 'sd35' else ''}): set "
            f"base_model_family to '{found}' or 'auto', or point base_model_uri at a {stated} model",
        )
    # What the user gave, without the defaults filled in, so that they are filled in again for this family.
    raw = document.model_dump(mode="json", exclude_unset=True) | {"base_model_family": found}
    return parse_run_document(raw)


def check_family_settings(document: RunDocument, family: str) -> None:
    """Training settings only some families train with (the image refuses them too, at the job's start:
    sdflow_image.training.train.check_family); refused here, before any job starts, naming the field."""
    training = document.training
    problems: list[dict[str, str]] = []
    if training.cache_latents and family not in CACHE_FAMILIES:
        problems.append(
            {
                "field": "training.cache_latents",
                "message": f"caches the text encoders' embeddings of the {', '.join(CACHE_FAMILIES)} families; a "
                f"{family} model's text encoders are not cached: set training.cache_latents to false",
            }
        )
    if family in FLOW_MATCHING_FAMILIES:
        for name, value in (("snr_gamma", training.snr_gamma), ("noise_offset", training.noise_offset)):
            if value:
                problems.append(
                    {
                        "field": f"training.{name}",
                        "message": f"weights the DDPM noise-prediction loss, and {FLOW_MATCHING_FAMILIES[family]} "
                        f"model trains on rectified flow (diffusers' flow-matching scripts, "
                        f"train_dreambooth_lora_sd3.py and those after it, have no {name}): set training.{name} to 0",
                    }
                )
    if family in TRANSFORMER_ONLY_LORA and training.method == "lora" and training.lora_options.text_encoder:
        problems.append(
            {
                "field": "training.lora.text_encoder",
                "message": f"{TRANSFORMER_ONLY_LORA[family]}: set training.lora.text_encoder to false",
            }
        )
    if problems:
        raise invalid(problems)


def setup_of(
    document: RunDocument, family: str, gpus_per_instance: int, *, with_t5: bool = True, variant: str = ""
) -> memory_estimate.Setup:
    training = document.training
    lora = training.lora_options
    return memory_estimate.Setup(
        family=family,
        method=training.method,
        plugin=training.plugin,
        precision=training.mixed_precision,
        batch=training.train_batch_size,
        resolution=training.resolution,
        gradient_checkpointing=training.gradient_checkpointing,
        use_ema=training.use_ema,
        lora_rank=lora.rank,
        text_encoder_lora=lora.text_encoder,
        gpus=gpus_per_instance * training.instance_count,
        with_t5=with_t5,
        variant=variant,
        gradient_accumulation_steps=training.gradient_accumulation_steps,
    )


def check_memory(
    document: RunDocument, family: str, *, with_t5: bool = True, variant: str = ""
) -> memory_estimate.Estimate | None:
    """Refuse a run whose estimated peak GPU memory exceeds its instance type's GPUs (InvalidRunDocument
    naming what to change). None when the instance type has no GPU this table knows (the local cloud's
    CPU types, new types): nothing to check against."""
    training = document.training
    gpu = memory_estimate.gpu_of(training.instance_type)
    if gpu is None:
        return None
    setup = setup_of(document, family, gpu.count, with_t5=with_t5, variant=variant)
    found = memory_estimate.estimate(setup)
    usable = memory_estimate.usable_gib(gpu)
    if found.total_gib <= usable:
        return found
    changes = memory_estimate.remedies(setup, gpu, training.instance_count)
    advice = "; or ".join(changes) if changes else "no single change fits: train a smaller model"
    label = setup.model.label
    raise _problem(
        "training",
        f"this {label} {training.method} run with plugin {training.plugin}, {training.mixed_precision}, batch "
        f"{training.train_batch_size} at {training.resolution} px needs about {found.total_gib:.1f} GiB per GPU "
        f"({found.breakdown()}), and a GPU of {training.instance_type} ({gpu.name}) has {usable:.1f} GiB to give "
        f"after {memory_estimate.CUDA_RESERVE_GIB:.0f} GiB for CUDA; change one of: {advice} "
        '(docs/run-document.md "Memory before money")',
    )


# The instances of a run's three GPU jobs: (run-document field, what runs there, whether it is an endpoint).
INSTANCE_FIELDS = (
    ("training.instance_type", "training job", False),
    ("evaluation.instance_type", "evaluation job", False),
    ("endpoint.instance_type", "endpoint", True),
)


def working_instance(
    backend: str,
    *,
    endpoint: bool,
    need_gib: float = 0.0,
    count: int = 0,
    bf16: bool = False,
    accepted: frozenset[str] | None = None,
) -> str | None:
    """The instance type with the fewest GPUs, then the least GPU memory, that the backend's image starts on, whose
    GPUs each give `need_gib` after the CUDA reserve, with `count` GPUs when given, and bf16 when asked; among
    `accepted` when given (the types the job's API takes)."""
    # With no count asked (one GPU serves), the fewest GPUs first: an 8-GPU instance costs several 1-GPU ones.
    found = sorted(
        (gpu.count if count == 0 else 0, gpu.gib, instance_types.size_rank(name), name)
        for name, gpu in instance_types.GPU_INSTANCES.items()
        if instance_types.runs_on(name, backend, endpoint=endpoint)
        and memory_estimate.usable_gib(gpu) >= need_gib
        and (count == 0 or gpu.count == count)
        and (gpu.bf16 or not bf16)
        and (accepted is None or name in accepted)
    )
    return found[0][3] if found else None


def _instead(name: str | None) -> str:
    return f"e.g. {name} ({instance_types.GPU_INSTANCES[name].name})" if name else "a larger GPU instance type"


def _image_problems(document: RunDocument) -> list[dict[str, str]]:
    """Instance types the run's image cannot start on (instance_types.why_not), and bf16 training on GPUs
    without bf16."""
    backend, training = document.training.backend, document.training
    bf16 = training.mixed_precision == "bf16"
    problems: list[dict[str, str]] = []
    for field, job, endpoint in INSTANCE_FIELDS:
        instance_type = _field_value(document, field)
        gpu = instance_types.gpu_of(instance_type)
        reason = instance_types.why_not(instance_type, backend, endpoint=endpoint)
        if gpu is None or reason is None:
            continue
        is_training = field == "training.instance_type"
        other = working_instance(
            backend,
            endpoint=endpoint,
            need_gib=memory_estimate.usable_gib(gpu),
            count=gpu.count if is_training else 0,
            bf16=bf16 and is_training,
        )
        problems.append(
            {
                "field": field,
                "message": f"{instance_type} cannot run this {training.backend} run's {job}: {reason}; set {field} "
                f"to an instance type {instance_types.image_of(backend).label} starts on, {_instead(other)}",
            }
        )
    gpu = instance_types.gpu_of(training.instance_type)
    if bf16 and gpu is not None and not gpu.bf16:
        other = working_instance(backend, endpoint=False, need_gib=memory_estimate.usable_gib(gpu), bf16=True)
        precisions = "'no' or 'fp16'" if backend == "colossalai" else "'no'"
        problems.append(
            {
                "field": "training.mixed_precision",
                "message": f"is 'bf16', and the {gpu.name} of {training.instance_type} has no bf16 tensor cores (bf16 "
                f"needs compute capability 8.0, Ampere, or newer): set training.mixed_precision to {precisions}, or "
                f"training.instance_type to {_instead(other)}",
            }
        )
    return problems


def _field_value(document: RunDocument, field: str) -> str:
    """The instance type at `field`; "" when unresolved (evaluation.instance_type before Validate run picks it)."""
    block, name = field.split(".")
    value = getattr(getattr(document, block), name)
    return "" if value is None else str(value)


def _inference_need(
    document: RunDocument, family: str, endpoint: bool, *, with_t5: bool, variant: str, clip_bytes: int
) -> tuple[inference_memory.InferenceEstimate, str]:
    """The evaluation's or the endpoint's peak on one GPU, and what it holds, in words."""
    resolution, label = document.training.resolution, memory_estimate.reference(family, variant).label
    if endpoint:
        found = inference_memory.estimate(
            family, resolution, inference_memory.SERVING_BYTES, variant=variant, with_t5=with_t5
        )
        return found, f"one {label} pipeline in bf16/fp16"
    found = inference_memory.evaluation_estimate(
        family, resolution, clip_bytes=clip_bytes, variant=variant, with_t5=with_t5
    )
    clip = " and the CLIP model in float32" if clip_bytes else ""
    return found, f"one {label} pipeline at a time in bf16/fp16{clip}"


def evaluation_instance(
    document: RunDocument, family: str, *, with_t5: bool = True, variant: str = "", clip_bytes: int = 0
) -> tuple[str | None, float]:
    """The smallest GPU instance type (fewest GPUs, then least memory) the run's image starts on whose GPU holds the
    evaluation (one pipeline at a time and the CLIP model), and the estimate in GiB; None when none does."""
    found, _holds = _inference_need(document, family, False, with_t5=with_t5, variant=variant, clip_bytes=clip_bytes)
    # A processing job: only the instance types CreateProcessingJob takes (no p4d, no p5.48xlarge).
    processing = request_limits.enum_values("ProcessingInstanceType")
    found_type = working_instance(
        document.training.backend, endpoint=False, need_gib=found.total_gib, accepted=processing
    )
    return found_type, found.total_gib


def _inference_problems(
    document: RunDocument, family: str, *, with_t5: bool, variant: str, clip_bytes: int
) -> list[dict[str, str]]:
    """Evaluation and endpoint GPUs too small for one pipeline of the family (and the evaluation's CLIP model)."""
    backend, resolution = document.training.backend, document.training.resolution
    problems: list[dict[str, str]] = []
    for field, job, endpoint in INSTANCE_FIELDS[1:]:
        instance_type = _field_value(document, field)
        gpu = instance_types.gpu_of(instance_type)
        if gpu is None:
            continue
        found, holds = _inference_need(
            document, family, endpoint, with_t5=with_t5, variant=variant, clip_bytes=clip_bytes
        )
        usable = memory_estimate.usable_gib(gpu)
        if found.total_gib <= usable:
            continue
        api = "ProductionVariantInstanceType" if endpoint else "ProcessingInstanceType"  # what the Create call takes
        other = working_instance(
            backend, endpoint=endpoint, need_gib=found.total_gib, accepted=request_limits.enum_values(api)
        )
        problems.append(
            {
                "field": field,
                "message": f"the {job} holds {holds} on one GPU, about "
                f"{found.total_gib:.1f} GiB ({found.breakdown()}) at {resolution} px, and a GPU of {instance_type} "
                f"({gpu.name}) has {usable:.1f} GiB to give after {memory_estimate.CUDA_RESERVE_GIB:.0f} GiB for "
                f'CUDA: set {field} to {_instead(other)} (docs/run-document.md "Memory before money")',
            }
        )
    return problems


def check_instances(
    document: RunDocument, family: str, *, with_t5: bool = True, variant: str = "", clip_bytes: int = 0
) -> None:
    """Refuse the training, evaluation and endpoint instance types the run's image cannot start on or whose GPU
    cannot hold the evaluation's (with its CLIP model's `clip_bytes`) or the endpoint's pipeline, and bf16 training
    on GPUs without bf16, each naming its field and an instance type that works (InvalidRunDocument). CPU, unknown
    and unresolved (null) types pass."""
    problems = _image_problems(document) + _inference_problems(
        document, family, with_t5=with_t5, variant=variant, clip_bytes=clip_bytes
    )
    if problems:
        raise invalid(problems)
