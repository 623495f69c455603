"""Text-to-image fine-tuning of SD 1.x/2.x, SDXL and SD3, in the shape of diffusers' examples
(text_to_image/train_text_to_image*.py, dreambooth/train_dreambooth*_sd3.py), distributed by a
backend (sdflow_image.backends): Colossal-AI's Booster, or accelerate's DDP and torch's FSDP2
on the second stack (`backend`, by default the model family's: backends.rules).

The model family comes from the base model's model_index.json (sdflow_image.families); its
denoiser (UNet or SD3 transformer) trains, whole (`training_method=full`) or as a LoRA adapter
(`lora`: torch_ddp or ddp, backends.rules.LORA_REFUSALS says why); the VAE and the text
encoders are frozen.
The plugin is a hyperparameter: colossalai's torch_ddp | low_level_zero | gemini (on CPU only
torch_ddp runs: see `check_inputs` for where Colossal-AI 0.5.0 stops on CPU), accelerate's
ddp | fsdp2 (both run on CPU, with gloo). The shards stream from
`dataset_dir` as the dataset index lists them (sdflow_image.training.data). The work itself is in
sdflow_image.training: model building, the loop, checkpoints, outputs.

Flags come from `$SDFLOW_OPT_ML/input/config/hyperparameters.json` (strings, as SageMaker
writes them; each key is a flag's name) and the command line, which wins.

Exit status (`cli`): 0 done; 1 failed (the reason is in `$SDFLOW_OPT_ML/output/failure`);
143 stopped by SIGTERM, after a checkpoint when one can reach S3 within the stop window
(training.stop_save). A stop is not a failure, so it writes no failure file: SageMaker reports a
stopped job itself, and the next run of the same job (spot restart, retry) resumes from the newest
complete checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sdflow_image import contract, families, flags, scenes
from sdflow_image.backends import rules
from sdflow_image.families.base import FAMILIES, METHODS, FamilyError, detect_family, resolve_family
from sdflow_image.training.buckets import buckets_for, position_grid_refusal
from sdflow_image.training.checkpoints import CheckpointError, list_checkpoints
from sdflow_image.training.data_source import FLAGS as DATA_FLAGS
from sdflow_image.training.data_source import DatasetIndexError, load_index
from sdflow_image.training.loop import TrainingStopped

__all__ = [
    "EXIT_STOPPED",
    "FLAGS",
    "ChannelError",
    "CheckpointError",
    "HyperparameterError",
    "PluginError",
    "TrainingStopped",
    "check_inputs",
    "cli",
    "list_checkpoints",
    "main",
    "parse_args",
]

log = logging.getLogger("sdflow.train")

PLUGINS = rules.PLUGINS
MIXED_PRECISIONS = ("no", "fp16", "bf16")
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
EXIT_STOPPED = 128 + signal.SIGTERM
DEFAULT_VALIDATION_PROMPTS = [
    "a photograph of an astronaut riding a horse",
    "a red square on a blue background",
]
BASE_MODEL_PARTS = ("model_index.json", "unet", "vae", "text_encoder", "tokenizer", "scheduler")  # SD's

HyperparameterError = flags.FlagError  # a flag or hyperparameter is wrong; the message names it


class TrainConfigError(ValueError):
    """The inputs or settings cannot train here; the message names what and the fix."""


class ChannelError(TrainConfigError):
    """An input (dataset index, base_model channel) is missing or incomplete."""


class PluginError(TrainConfigError):
    """The chosen plugin cannot run here or with these settings."""


Flag = flags.Flag
FLAGS: list[flags.Flag] = [
    Flag(
        "pretrained_model_name_or_path",
        flags.text,
        None,
        "base model folder (diffusers layout); default: the base_model channel",
    ),
    *DATA_FLAGS,
    Flag("output_dir", flags.text, None, "where the fine-tuned pipeline goes; default: $SDFLOW_OPT_ML/model"),
    Flag("checkpoints_dir", flags.text, None, "periodic checkpoints; default: $SDFLOW_OPT_ML/checkpoints"),
    Flag(
        "checkpoint_s3_uri",
        flags.text,
        None,
        "the job's CheckpointConfig.S3Uri: old checkpoints are pruned there too (SageMaker's sync only adds)",
    ),
    Flag(
        "backend",
        flags.choice(rules.BACKENDS),
        None,
        "colossalai (Colossal-AI's Booster: sd, sdxl, sd3) | accelerate (accelerate DDP / torch FSDP2: every family, "
        "and the only one for sd35, flux2, qwenimage); default: the model family's",
    ),
    Flag(
        "plugin",
        flags.choice(PLUGINS),
        None,
        "backend=colossalai: torch_ddp | low_level_zero | gemini (the last two need CUDA); backend=accelerate: "
        "ddp (replicated) | fsdp2 (sharded full fine-tune); default: torch_ddp, and under accelerate fsdp2 for "
        "training_method=full, ddp for lora",
    ),
    Flag(
        "model_family",
        flags.choice(FAMILIES),
        None,
        "sd | sdxl | sd3; default: the base model's (model_index.json), which must agree when this is set",
    ),
    Flag("base_model_uri", flags.text, "", "the base model's S3 URI, recorded in sdflow_model.json (a LoRA's base)"),
    Flag("training_method", flags.choice(METHODS), "full", "full (every denoiser weight) | lora (an adapter only)"),
    Flag("lora_rank", flags.positive_int, 4, "LoRA rank r (diffusers' LoRA examples: 4)"),
    Flag(
        "lora_alpha",
        flags.positive_float,
        None,
        "LoRA alpha (scale alpha / r); default: the rank, as diffusers' examples",
    ),
    Flag("lora_dropout", flags.number(float, 0, maximum=1), 0.0, "dropout on the LoRA branch (0..1)"),
    Flag(
        "lora_target_modules",
        flags.name_list,
        [],
        "comma-separated module names to adapt; empty: the family's default (attention projections)",
    ),
    Flag("train_text_encoder_lora", flags.boolean, False, "adapt the CLIP text encoders too (sd, sdxl)"),
    Flag(
        "sd3_t5",
        flags.boolean,
        True,
        "model_family=sd3: encode prompts with T5 too; false leaves it out of training, samples and serving "
        "(zeros in its place, as the SD3 pipeline without T5), to save its memory",
    ),
    Flag("mixed_precision", flags.choice(MIXED_PRECISIONS), "no", "no | fp16 (CUDA) | bf16"),
    Flag(
        "resolution",
        flags.positive_int,
        512,
        "training image size in pixels, multiple of 8 (the square's side; with aspect_buckets, each bucket has "
        "about its square's area)",
    ),
    Flag("train_batch_size", flags.positive_int, 4, "batch size per process"),
    Flag("gradient_accumulation_steps", flags.positive_int, 1, "micro-batches per optimizer step"),
    Flag("gradient_checkpointing", flags.boolean, False, "recompute UNet activations in backward to save memory"),
    Flag(
        "cache_latents",
        flags.boolean,
        False,
        "encode each image and caption once (VAE latents, text embeddings) and reuse them in later epochs; "
        "needs center_crop and no random_flip",
    ),
    Flag("cache_latents_max_gb", flags.positive_float, 16.0, "host memory per process for cache_latents, in GB"),
    Flag("learning_rate", flags.positive_float, 1e-5, "AdamW learning rate"),
    Flag("lr_scheduler", flags.choice(LR_SCHEDULERS), "constant", "learning-rate schedule"),
    Flag("lr_warmup_steps", flags.non_negative_int, 0, "warmup steps of the schedule"),
    Flag("adam_beta1", flags.number(float, 0), 0.9, "AdamW beta1 (< 1)"),
    Flag("adam_beta2", flags.number(float, 0), 0.999, "AdamW beta2 (< 1)"),
    Flag("adam_weight_decay", flags.non_negative_float, 1e-2, "AdamW weight decay"),
    Flag("adam_epsilon", flags.positive_float, 1e-8, "AdamW epsilon"),
    Flag("max_grad_norm", flags.non_negative_float, 1.0, "gradient clipping norm (0 disables)"),
    Flag("max_train_steps", flags.positive_int, 1000, "optimizer steps to train for (total, across resumes)"),
    Flag("checkpointing_steps", flags.positive_int, 500, "save a resumable checkpoint every N optimizer steps"),
    Flag("checkpoints_total_limit", flags.positive_int, 2, "keep the newest N checkpoints (in S3: complete ones)"),
    Flag("use_ema", flags.boolean, False, "keep an exponential moving average of the UNet and save that"),
    Flag("ema_decay", flags.number(float, 0), 0.9999, "EMA decay (< 1)"),
    Flag("seed", flags.non_negative_int, 0, "random seed"),
    Flag("noise_offset", flags.non_negative_float, 0.0, "noise offset (0 disables)"),
    Flag("snr_gamma", flags.non_negative_float, 0.0, "Min-SNR loss weighting gamma, e.g. 5 (0 disables)"),
    Flag(
        "proportion_empty_prompts",
        flags.number(float, 0, maximum=1),
        0.0,
        "share of captions replaced by the empty prompt, for classifier-free guidance (0..1)",
    ),
    Flag("validation_prompts", flags.prompt_list, DEFAULT_VALIDATION_PROMPTS, "JSON list of prompts for samples.png"),
    Flag("validation_inference_steps", flags.positive_int, 25, "denoising steps for samples.png"),
    Flag("eval_adherence", flags.boolean, False, "score prompt adherence of the base and trained model at the end"),
    Flag("eval_prompts", flags.prompt_list, [], "JSON list of scene prompts to score; [] = the held-out set"),
    Flag("eval_inference_steps", flags.positive_int, 20, "denoising steps for the adherence images"),
    Flag("eval_guidance_scale", flags.non_negative_float, 5.0, "classifier-free guidance for the adherence images"),
]


def build_parser() -> argparse.ArgumentParser:
    return flags.build_parser(
        "sdflow-train",
        "Fine-tune a diffusion model's denoiser on webdataset shards with Colossal-AI or accelerate/FSDP2.",
        FLAGS,
    )


def parse_args(
    argv: Sequence[str] | None = None, hyperparameters: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """Hyperparameters (default: hyperparameters.json) then `argv` (default: sys.argv[1:]) on top."""
    hp = contract.read_hyperparameters() if hyperparameters is None else hyperparameters
    args = flags.parse(build_parser(), FLAGS, argv, hp)
    if args.resolution % 8:
        raise HyperparameterError(f"resolution={args.resolution} must be a multiple of 8 (e.g. 512)")
    if args.cache_latents and (args.random_flip or not args.center_crop):
        raise HyperparameterError(
            "cache_latents=true keeps one encoding per image, so every epoch must see the same pixels: "
            f"random_flip={str(args.random_flip).lower()}, center_crop={str(args.center_crop).lower()}; set "
            "random_flip=false and center_crop=true, or cache_latents=false"
        )
    for name in ("adam_beta1", "adam_beta2", "ema_decay"):
        if getattr(args, name) >= 1:
            raise HyperparameterError(f"{name}={getattr(args, name)} must be < 1")
    check_method(args)
    args.pretrained_model_name_or_path = args.pretrained_model_name_or_path or str(contract.channel_dir("base_model"))
    default_backend(args)
    args.dataset_dir = args.dataset_dir or str(contract.channel_dir("dataset"))
    args.output_dir = args.output_dir or str(contract.model_dir())
    args.checkpoints_dir = args.checkpoints_dir or str(contract.checkpoints_dir())
    args.checkpoint_s3_uri = args.checkpoint_s3_uri or None
    if args.checkpoint_s3_uri and not args.checkpoint_s3_uri.startswith("s3://"):
        raise HyperparameterError(f"checkpoint_s3_uri={args.checkpoint_s3_uri!r} must be an s3://bucket/prefix/ URI")
    return args


def default_backend(args: argparse.Namespace) -> None:
    """The backend and plugin a run that names none gets (backends.rules): by the model family,
    read here already when the base model is there (the launcher logs what the plugin costs
    before check_inputs runs); an unreadable base model fails in check_base_model, naming it."""
    family = args.model_family
    if family is None:
        try:
            family = detect_family(args.pretrained_model_name_or_path)
        except FamilyError:
            family = None
    args.backend = args.backend or rules.default_backend(family)
    args.plugin = args.plugin or rules.default_plugin(args.backend, args.training_method)


# Where Colossal-AI 0.5.0 stops on a machine without CUDA (found by running each plugin there;
# tests/image/test_plugins.py pins each of these).
CPU_STOPS = {
    "low_level_zero": "its LowLevelZeroOptimizer asserts a CUDA or NPU accelerator ('device is required')",
    "gemini": (
        "its GeminiDDP asks the accelerator for a CUDA stream ('this method is not supported for cpu "
        "accelerator') and its HybridAdam's CPU kernel is a CUDA extension ('No usable kernel found for "
        "CPUAdamLoader')"
    ),
}


def check_method(args: argparse.Namespace) -> None:
    """The settings of `training_method` that contradict each other, whatever the family."""
    if args.lora_alpha is None:
        args.lora_alpha = float(args.lora_rank)
    if args.training_method != "lora":
        if args.train_text_encoder_lora:
            raise HyperparameterError("train_text_encoder_lora=true needs training_method=lora")
        return
    if args.use_ema:
        raise HyperparameterError(
            "use_ema=true is for training_method=full: diffusers' LoRA examples keep no EMA of an adapter; "
            "set use_ema=false"
        )


def check_base_model(args: argparse.Namespace) -> str:
    """The base model folder is a pipeline of a supported family (and of `model_family` when set);
    every component its model_index.json names is there. Returns the family."""
    base = Path(args.pretrained_model_name_or_path)
    if not base.is_dir():
        raise ChannelError(f"base model {base} does not exist: the training job needs a 'base_model' channel")
    if not (base / "model_index.json").is_file():
        missing = [p for p in BASE_MODEL_PARTS if not (base / p).exists()]
        raise ChannelError(f"base model {base} is not a diffusers pipeline folder: missing {', '.join(missing)}")
    try:
        family = resolve_family(args.model_family, base)
    except FamilyError as exc:
        raise (HyperparameterError if args.model_family else ChannelError)(str(exc)) from None
    index = json.loads((base / "model_index.json").read_text(encoding="utf-8"))
    # Entries are [library, class], or [null, null] for a part left out (safety checker, SD3's T5).
    missing = [
        name
        for name, spec in index.items()
        if not name.startswith("_") and isinstance(spec, list) and spec and spec[0] and not (base / name).exists()
    ]
    if missing:
        raise ChannelError(
            f"base model {base} is not a complete diffusers {index.get('_class_name')} folder: "
            f"missing {', '.join(sorted(missing))}"
        )
    return family


# The families cache_latents caches (training.encode_cache for sd, training.embedding_cache for the
# others); the layer's model_family.CACHE_FAMILIES holds the same.
CACHE_FAMILIES = ("sd", "flux2", "qwenimage", "sd35")


def check_family(args: argparse.Namespace) -> None:
    """Settings that only some families train with."""
    family = args.model_family
    multiple = families.get(family).resolution_multiple
    if args.resolution % multiple:
        below = args.resolution // multiple * multiple
        raise HyperparameterError(
            f"resolution={args.resolution} must be a multiple of {multiple} for model_family={family} (its latents "
            f"are patched): use {below} or {below + multiple}"
        )
    if args.cache_latents and family not in CACHE_FAMILIES:
        raise HyperparameterError(
            f"cache_latents=true caches the text encoders' embeddings of model_family {', '.join(CACHE_FAMILIES)}; "
            f"{family}'s are not cached: set cache_latents=false"
        )
    if args.cache_latents and args.train_text_encoder_lora:
        raise HyperparameterError(
            "cache_latents=true keeps each caption's embedding, which train_text_encoder_lora=true changes at "
            "every step: set one of them to false"
        )
    if family not in ("sd", "sdxl") and (args.snr_gamma or args.noise_offset):
        raise HyperparameterError(
            f"snr_gamma and noise_offset weight the DDPM noise-prediction loss; model_family={family} trains on "
            "rectified flow: set both to 0"
        )
    if getattr(args, "aspect_buckets", False):
        refusal = position_grid_refusal(args.pretrained_model_name_or_path, args.resolution,
                                        buckets_for(args.resolution, multiple))  # fmt: skip
        if refusal:
            raise HyperparameterError(refusal)
    if family not in ("sd3", "sd35") and not args.sd3_t5:
        raise HyperparameterError(f"sd3_t5=false is for model_family=sd3 or sd35; this base model is {family}")
    if args.train_text_encoder_lora and not families.get(family).text_encoder_lora:
        raise HyperparameterError(
            f"train_text_encoder_lora=true: diffusers saves and loads a {family} LoRA for the transformer only; "
            "set it to false"
        )


def check_inputs(args: argparse.Namespace, cuda: bool) -> None:
    """The checks that need no torch: before the slow imports and the process group."""
    args.model_family = check_base_model(args)
    check_family(args)
    try:
        load_index(args.dataset_dir, args.dataset_index)
    except DatasetIndexError as exc:
        raise ChannelError(str(exc)) from None
    check_plugin(args, cuda)
    for prompt in args.eval_prompts:
        try:
            scenes.parse_prompt(prompt)
        except scenes.PromptGrammarError as exc:
            raise HyperparameterError(f"eval_prompts: {exc}") from None


def check_plugin(args: argparse.Namespace, cuda: bool) -> None:
    reason = rules.refusal(args.model_family, args.backend, args.plugin, args.training_method, args.mixed_precision)
    if reason:
        raise PluginError(reason)
    if args.plugin == "fsdp2" and args.use_ema:
        raise PluginError(rules.EMA_ON_FSDP2)
    if args.plugin in CPU_STOPS and not cuda:
        raise PluginError(
            f"plugin={args.plugin} needs CUDA GPUs: on CPU {CPU_STOPS[args.plugin]}; on CPU use plugin=torch_ddp"
        )
    if args.mixed_precision == "fp16" and not cuda:
        # Colossal-AI's CPU accelerator returns the nullcontext class as its autocast, so the AMP
        # module's forward fails, and torch's GradScaler disables itself without CUDA.
        raise PluginError("mixed_precision=fp16 needs a CUDA GPU; on CPU use bf16 or no")
    if args.plugin == "gemini" and args.mixed_precision == "no":
        raise PluginError("plugin=gemini trains in fp16 or bf16: set mixed_precision to fp16 or bf16")
    if args.plugin == "gemini" and args.use_ema:
        raise PluginError(
            "use_ema=true is not supported with plugin=gemini (its parameters live in sharded chunks); "
            "use low_level_zero or torch_ddp"
        )


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Train, save the pipeline and the summary; returns the summary. Raises on failure,
    TrainingStopped on SIGTERM (after a checkpoint)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    from sdflow_image import backends
    from sdflow_image.training import loop, outputs

    cuda = torch.cuda.is_available()
    check_inputs(args, cuda)
    backend = backends.make(args)
    with loop.StopFlag() as stop, backend.distributed(args.seed, cuda):
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        trainer = loop.Trainer(args, device, backend)
        trainer.resume()
        trainer.open_data()
        summary = trainer.summary(trainer.train(stop))
        outputs.save(args, trainer, summary)
        return summary


def cli(argv: list[str] | None = None) -> int:
    """Entry point: the exit status per the module docstring."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        summary = main(parse_args(argv))
    except TrainingStopped as stopped:
        print(str(stopped), file=sys.stderr, flush=True)
        return EXIT_STOPPED
    except Exception as exc:
        return contract.fail(exc)
    print(json.dumps({"final_loss": summary["final_loss"], "steps": summary["steps"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
