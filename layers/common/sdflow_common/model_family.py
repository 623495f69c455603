"""The base model's family, read from its model_index.json, and the memory check that depends on it.

diffusers' `save_pretrained` writes the pipeline's class as `_class_name` in model_index.json; its
class decides how a run trains, samples and serves (docs/run-document.md "Model families"):

    StableDiffusionPipeline    sd    SD 1.x / 2.x (UNet, one CLIP text encoder; epsilon or v-prediction)
    StableDiffusionXLPipeline  sdxl  SDXL (UNet, two CLIP text encoders, pooled embeddings, time ids)
    StableDiffusion3Pipeline   sd3   SD 3 / 3.5 (MMDiT transformer, CLIP-L, CLIP-G, optional T5; flow matching)

Any other class (an inpainting or img2img pipeline, PixArt, Flux, …) is refused, naming it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sdflow_common import memory_estimate
from sdflow_common.errors import InvalidRunDocument
from sdflow_common.run_document import RunDocument, invalid

FAMILY_OF_CLASS = {
    "StableDiffusionPipeline": "sd",
    "StableDiffusionXLPipeline": "sdxl",
    "StableDiffusion3Pipeline": "sd3",
}
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
    return BaseModelIndex(family=family, with_t5=with_t5)


def resolve_family(document: RunDocument, found: str) -> RunDocument:
    """The document with `base_model_family` set to what the model is; a stated family must agree."""
    stated = document.base_model_family
    if stated not in ("auto", found):
        raise _problem(
            "base_model_family",
            f"is '{stated}', but {document.base_model_uri} is a '{found}' model (its model_index.json): set "
            f"base_model_family to '{found}' or 'auto', or point base_model_uri at a {stated} model",
        )
    return document.model_copy(update={"base_model_family": found})


def check_family_settings(document: RunDocument, family: str) -> None:
    """Training settings only some families train with (the image refuses them too, at the job's start:
    sdflow_image.train.check_family); refused here, before any job starts, naming the field."""
    training = document.training
    problems: list[dict[str, str]] = []
    if training.cache_latents and family != "sd":
        problems.append(
            {
                "field": "training.cache_latents",
                "message": f"caches one text encoder's embeddings (SD 1.x/2.x); a {family} model has several: set "
                "training.cache_latents to false",
            }
        )
    if family == "sd3":
        for name, value in (("snr_gamma", training.snr_gamma), ("noise_offset", training.noise_offset)):
            if value:
                problems.append(
                    {
                        "field": f"training.{name}",
                        "message": f"weights the DDPM noise-prediction loss, and an SD 3 model trains on rectified "
                        f"flow (diffusers' train_dreambooth_lora_sd3.py has no {name}): set training.{name} to 0",
                    }
                )
        if training.method == "lora" and training.lora_options.text_encoder:
            problems.append(
                {
                    "field": "training.lora.text_encoder",
                    "message": "diffusers 0.29 saves and loads an SD 3 LoRA for the transformer only: set "
                    "training.lora.text_encoder to false",
                }
            )
    if problems:
        raise invalid(problems)


def setup_of(
    document: RunDocument, family: str, gpus_per_instance: int, *, with_t5: bool = True
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
    )


def check_memory(document: RunDocument, family: str, *, with_t5: bool = True) -> memory_estimate.Estimate | None:
    """Refuse a run whose estimated peak GPU memory exceeds its instance type's GPUs (InvalidRunDocument
    naming what to change). None when the instance type has no GPU this table knows (the local cloud's
    CPU types, new types): nothing to check against."""
    training = document.training
    gpu = memory_estimate.gpu_of(training.instance_type)
    if gpu is None:
        return None
    setup = setup_of(document, family, gpu.count, with_t5=with_t5)
    found = memory_estimate.estimate(setup)
    usable = memory_estimate.usable_gib(gpu)
    if found.total_gib <= usable:
        return found
    changes = memory_estimate.remedies(setup, gpu, training.instance_count)
    advice = "; or ".join(changes) if changes else "no single change fits: train a smaller model"
    label = memory_estimate.FAMILIES[family].label
    raise _problem(
        "training",
        f"this {label} {training.method} run with plugin {training.plugin}, {training.mixed_precision}, batch "
        f"{training.train_batch_size} at {training.resolution} px needs about {found.total_gib:.1f} GiB per GPU "
        f"({found.breakdown()}), and a GPU of {training.instance_type} ({gpu.name}) has {usable:.1f} GiB to give "
        f"after {memory_estimate.CUDA_RESERVE_GIB:.0f} GiB for CUDA; change one of: {advice} "
        '(docs/run-document.md "Memory before money")',
    )
