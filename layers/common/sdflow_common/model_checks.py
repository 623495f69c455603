"""What the model is, checked at Validate run before anything trains (both doors: validate_run.check_inputs).

- every component the base model's model_index.json lists has its files under base_model_uri (a model's config
  and weights, a tokenizer's, a scheduler's config), as the image's `from_pretrained(base, subfolder=…)` reads
  them: an SDXL folder without text_encoder_2/ is refused naming base_model_uri, not found by the training job
  as a container path;
- training.lora.target_modules name modules of the family's denoiser that LoRA can adapt (lora_modules);
- training.resolution is a multiple of what the family's latents need (RESOLUTION_MULTIPLE);
- a dataset too small for the run's training processes is refused, one smaller than its global batch said.
"""

from __future__ import annotations

import re

from sdflow_common import aws, instance_types, lora_modules
from sdflow_common.model_family import BaseModelIndex
from sdflow_common.run_document import RunDocument, invalid, parse_s3_uri

# The image's resolution rule per family: the VAE downsamples by 8 (2 ** (len(block_out_channels) - 1) of every
# family's VAE; Qwen-Image's 2 ** len(temperal_downsample)); SD 1.x/2.x's and SDXL's UNet take any latent size
# (diffusers passes the skip connections' sizes to its upsamplers), while SD 3's and SD 3.5's transformers cut
# the latents into 2x2 patches (patch_size 2) and FLUX.2 [klein] and Qwen-Image pack 2x2 latents into one token:
# an odd latent size fails in the first step. tests/image/test_resolution_multiple.py and
# tests/image_accelerate/test_resolution_multiple_next.py hold these equal to the real models' configs and show
# the step failing off the multiple. The image itself checks only the multiple of 8 (train.parse_args).
RESOLUTION_MULTIPLE = {"sd": 8, "sdxl": 8, "sd3": 16, "sd35": 16, "flux2": 16, "qwenimage": 16}
RESOLUTION_WHY = {
    8: "its VAE downsamples by 8",
    16: "its VAE downsamples by 8 and its transformer takes 2x2 latent patches",
}
RESOLUTION_RANGE = (32, 2048)  # training_options.TrainingOptions.resolution's bounds

# The weight files `from_pretrained` reads without a `variant` (the image passes none): diffusers' and
# transformers' single-file and sharded names.
WEIGHT_FILES = (
    "diffusion_pytorch_model.safetensors",
    "diffusion_pytorch_model.bin",
    "model.safetensors",
    "pytorch_model.bin",
)
SHARD = re.compile(r"^(?P<stem>.+)-(?P<number>\d{5})-of-(?P<total>\d{5})\.(?P<ext>safetensors|bin)$")
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.json", "spiece.model")
# An image processor's (SD 1.5's feature_extractor, CLIPImageProcessor) or a multimodal processor's config.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
FIX = (
    "copy that folder from the original model (e.g. `aws s3 sync <model>/{name}/ {uri}{name}/`), or upload the "
    "whole folder pipeline.save_pretrained() writes"
)


def _list_folder(bucket: str, folder: str) -> dict[str, set[str]]:
    """Component folder → the names of the files directly in it, for every object below `folder`."""
    files: dict[str, set[str]] = {}
    paginator = aws.client("s3").get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=folder):
        for obj in page.get("Contents", []):
            parts = obj["Key"][len(folder) :].split("/")
            if len(parts) == 2:
                files.setdefault(parts[0], set()).add(parts[1])
    return files


def _weights_missing(files: set[str]) -> str | None:
    """What is missing of a model component's weights; None when `from_pretrained` finds them."""
    if any(name in files for name in WEIGHT_FILES):
        return None
    indexes = sorted(f"{name}.index.json" for name in WEIGHT_FILES if f"{name}.index.json" in files)
    if not indexes:
        variants = sorted(name for name in files if name.endswith((".safetensors", ".bin")))
        found = f" (it holds {', '.join(variants[:3])}: a variant's or another tool's names)" if variants else ""
        names = f"{', '.join(WEIGHT_FILES)} or a sharded index"
        return f"weights ({names}){found}"
    shards = [m for m in (SHARD.match(name) for name in files) if m is not None]
    totals = {int(m["total"]) for m in shards}
    have = {int(m["number"]) for m in shards}
    total = max(totals, default=0)
    absent = [n for n in range(1, total + 1) if n not in have]
    if total == 0 or absent:
        shown = ", ".join(f"{n:05d}" for n in absent[:5]) if absent else "every one"
        return f"weight shards named by {indexes[0]} ({shown} of {total or '?'})"
    return None


def _component_missing(name: str, class_name: str, files: set[str]) -> str | None:
    """What is wrong with the folder of a listed component, in words; None when it has what loading it reads."""
    if not files:
        return "does not exist (no object below it)"
    needed: str | None
    if class_name.endswith("Scheduler"):
        needed = None if "scheduler_config.json" in files else "scheduler_config.json"
    elif "Tokenizer" in class_name:
        needed = None if files.intersection(TOKENIZER_FILES) else f"its tokenizer files ({', '.join(TOKENIZER_FILES)})"
    elif class_name.endswith(("Processor", "FeatureExtractor")):
        needed = None if files.intersection(PROCESSOR_FILES) else " or ".join(PROCESSOR_FILES)
    else:
        needed = "config.json" if "config.json" not in files else _weights_missing(files)
    return None if needed is None else f"has no {needed}"


def component_problems(base_model_uri: str, index: BaseModelIndex) -> list[dict[str, str]]:
    """One problem (field base_model_uri) per component model_index.json lists whose files are not there."""
    bucket, key = parse_s3_uri(base_model_uri)
    folder = key if not key or key.endswith("/") else f"{key}/"
    uri = f"s3://{bucket}/{folder}"
    if not index.components:
        return []
    found = _list_folder(bucket, folder)
    problems = []
    for name, class_name in index.components:
        missing = _component_missing(name, class_name, found.get(name, set()))
        if missing is not None:
            problems.append(
                {
                    "field": "base_model_uri",
                    "message": f"{uri}model_index.json lists the component {name} ({class_name}), and "
                    f"{uri}{name}/ {missing}; {FIX.format(name=name, uri=uri)}",
                }
            )
    return problems


def lora_problems(document: RunDocument, index: BaseModelIndex) -> list[dict[str, str]]:
    """training.lora.target_modules that the family's denoiser has no adaptable module of (the text encoders take
    the image's own q/k/v/out_proj targets, never these: sdflow_image.training.lora.add_adapters)."""
    training = document.training
    targets = training.lora_options.target_modules if training.method == "lora" else None
    names = lora_modules.module_names(index.family, index.variant) if targets else None
    if not targets or names is None:
        return []
    problems = []
    for position, target in enumerate(targets):
        why = names.problem(target)
        if why is None:
            continue
        problems.append(
            {
                "field": f"training.lora.target_modules.{position}",
                "message": f"{why} in the {index.family} denoiser; name Linear or Conv2d modules by their full name or "
                f"its dotted tail (peft's match), e.g. {', '.join(names.leaf_names())}, or leave "
                "target_modules out for the family's default",
            }
        )
    return problems


def nearest_multiples(value: int, multiple: int) -> list[int]:
    """The multiples of `multiple` just below and above `value`, within the resolution's range."""
    low, high = RESOLUTION_RANGE
    below, above = value // multiple * multiple, (value // multiple + 1) * multiple
    return [n for n in (below, above) if low <= n <= high]


def resolution_problems(document: RunDocument, family: str) -> list[dict[str, str]]:
    resolution = document.training.resolution
    multiple = RESOLUTION_MULTIPLE.get(family, 8)
    if resolution % multiple == 0:
        return []
    choices = " or ".join(str(n) for n in nearest_multiples(resolution, multiple))
    return [
        {
            "field": "training.resolution",
            "message": f"is {resolution}, and a {family} model trains on a multiple of {multiple} pixels "
            f"({RESOLUTION_WHY[multiple]}): set training.resolution to {choices}",
        }
    ]


def check_model(document: RunDocument, index: BaseModelIndex) -> None:
    """Refuse (InvalidRunDocument) a base model missing a listed component, LoRA targets the denoiser lacks, a
    resolution off the family's multiple: every problem at once."""
    problems = (
        component_problems(document.base_model_uri, index)
        + lora_problems(document, index)
        + resolution_problems(document, index.family)
    )
    if problems:
        raise invalid(problems)


def training_processes(document: RunDocument) -> int:
    """The training job's processes, as the image's launcher starts them: one per GPU of each instance (one on an
    instance without GPUs), on every instance."""
    training = document.training
    gpu = instance_types.gpu_of(training.instance_type)
    return max(gpu.count if gpu else 1, 1) * training.instance_count


def batch_warnings(document: RunDocument, rows: int, holdout_rate: float) -> list[dict[str, str]]:
    """A dataset too small for the run. Refused when training is certain to fail: fewer parquet rows (what the
    download can give at most) than training processes leaves a process without a sample, and the image's loader
    stops it (sdflow_image.training.data EmptyStreamError). Said (a warning in the notification) when the rows
    left after the held-out share are fewer than one global batch (per-GPU batch x processes): the image then
    fills each batch by reading the samples again (its loader runs on into the next epoch), so every step sees
    the same images several times."""
    training = document.training
    processes = training_processes(document)
    if rows < processes:
        raise invalid(
            [
                {
                    "field": "training.instance_count",
                    "message": f"the dataset has {rows} rows, fewer than the {processes} training processes "
                    f"({training.instance_count} x {training.instance_type}, one per GPU), so one of them gets no "
                    f"sample and the training job stops: train on at most {max(rows, 1)} GPUs, or add data",
                }
            ]
        )
    train_rows = rows - round(rows * holdout_rate)
    global_batch = training.train_batch_size * processes
    if global_batch <= train_rows:
        return []
    return [
        {
            "field": "training.train_batch_size",
            "message": f"one step's global batch is {global_batch} samples ({training.train_batch_size} per GPU x "
            f"{processes} processes), more than the about {train_rows} rows left to train on after the held-out "
            f"share: every step repeats samples; set training.train_batch_size to at most "
            f"{max(train_rows // processes, 1)}, or add data",
        }
    ]
