"""What a finished training job leaves in /opt/ml/model.

- training_method=full: the fine-tuned pipeline of the model's family (diffusers layout,
  safetensors), in half precision when trained in fp16 or bf16 (the weights the serving
  container loads, at half the bytes), else fp32;
- training_method=lora: only the adapter, `pytorch_lora_weights.safetensors` as the family's
  pipeline's `save_lora_weights` writes it (megabytes); the base model stays where it was, and
  sdflow_model.json names its URI;
- `sdflow_model.json`: {"format", "family", "method", "base_model_uri", "lora" (LoRA only:
  rank, alpha, target_modules, text_encoder), "resolution", "dtype", "steps", "base_model"}; the
  server's default image size is the trained resolution;
- `training_summary.json`, `loss.png`, `samples.png` (one image per validation prompt);
- with --eval_adherence: `adherence.png` (each held-out prompt: base | trained) and the base and
  trained prompt-adherence scores in the summary and in the log, where the job's metric
  definitions pick them up (`eval:prompt_adherence=`, `eval:base_prompt_adherence=`).

The summary and the images are copied to /opt/ml/output/data too (rank 0, like the rest), which
SageMaker uploads as `output/output.tar.gz`: its place for a job's non-model artifacts.

The training state is freed before anything is rendered: the wrapped denoiser, optimizer states,
EMA and frozen parts stay on the device until the weights are exported, then are dropped, so
rendering the samples cannot run out of device memory on a job that has finished training.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

from sdflow_image import contract
from sdflow_image.families import Family
from sdflow_image.training import lora, model
from sdflow_image.training.loop import Trainer, barrier

MODEL_INFO = "sdflow_model.json"
MODEL_INFO_FORMAT = 1
DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16", "no": "float32"}
# Copied to the output data dir as well (output.tar.gz), with adherence.GRID_FILE when it is made.
REPORT_FILES = ("training_summary.json", "loss.png", "samples.png")
ADHERENCE_GRID = "adherence.png"  # sdflow_image.evaluation.adherence.GRID_FILE, without importing numpy here


def save(args: argparse.Namespace, trainer: Trainer, summary: dict[str, Any]) -> None:
    """Collective: export the weights (sharded plugins gather them onto rank 0), free the training
    state on every rank, then rank 0 writes the outputs."""
    device, losses, steps, family = trainer.device, list(trainer.state.losses), trainer.state.step, trainer.family
    method = "lora" if trainer.lora else "full"
    pipe = save_lora(args, trainer) if trainer.lora else save_full(args, trainer)
    if pipe is None:
        return  # not rank 0
    out = Path(args.output_dir)
    if method == "full":
        out.mkdir(parents=True, exist_ok=True)
        pipe.save_pretrained(out, safe_serialization=True)
    summary["model_family"], summary["training_method"] = family.name, method
    summary["model_bytes"] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"model output: {summary['model_bytes'] / 1e6:.2f} MB ({summary['training_method']})", flush=True)
    write_model_info(out, args, steps)
    write_loss_plot(losses, out / "loss.png")
    write_samples(pipe, args, device, out / "samples.png")
    if args.eval_adherence:
        summary["prompt_adherence"] = write_adherence(pipe, args, device, out)
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2))
    report = [*REPORT_FILES, ADHERENCE_GRID] if args.eval_adherence else list(REPORT_FILES)
    copy_report(out, contract.output_data_dir(), report)
    print(f"saved model to {out}", flush=True)


def save_lora(args: argparse.Namespace, trainer: Trainer) -> Any:
    """Collective: rank 0 writes the adapter in diffusers' format and returns the base pipeline
    with it loaded (for the samples and the adherence score); the others return None."""
    rank0, family = trainer.rank == 0, trainer.family
    layers = lora.adapter_layers(family, trainer.parts, args) if rank0 else None
    trainer.release()
    barrier()
    if layers is None:
        return None
    out = Path(args.output_dir)
    lora.save_adapter(family, layers, out)
    pipe = base_pipeline(args, family)
    lora.load_adapter(pipe, out)
    return pipe


def base_pipeline(args: argparse.Namespace, family: Family) -> Any:
    """The frozen base a LoRA run trained on, every component in the training precision, as the
    examples load it for their final inference (`torch_dtype=weight_dtype`). Without a dtype,
    diffusers loads its models in fp32 while transformers 5 loads a text encoder in the dtype it
    was saved in: a bf16 base then meets a bf16 prompt embedding with an fp32 transformer on the
    GPU (seen on an H200 with FLUX.2 [klein] 4B; the CPU's fp32 samples hid it)."""
    return load_base(
        family,
        args.pretrained_model_name_or_path,
        torch_dtype=model.precision_dtype(args.mixed_precision),
        **dict.fromkeys(family.left_out(args)),
    )


def load_base(family: Family, base: str, **components: Any) -> Any:
    """The base pipeline of `family`, with `components` in place of its own, nothing fetched."""
    return family.pipeline_class().from_pretrained(
        base, local_files_only=True, **{**family.pipeline_kwargs, **components}
    )


def save_full(args: argparse.Namespace, trainer: Trainer) -> Any:
    """Collective: export the whole denoiser, free the training state; rank 0 returns the pipeline."""
    rank0 = trainer.rank == 0
    # Staged inside the model folder: /opt/ml/model is on the job's storage volume (the SageMaker
    # developer guide, "Managing storage paths for different types of instance local storage": the
    # default paths, /opt/ml/model among them, are mounted on the instance's EBS or NVMe volume),
    # where /opt/ml beside it may be the container's root file system. The folder is gone before
    # the model is written there (the context ends first), so it never reaches model.tar.gz.
    staging = Path(args.output_dir).resolve()
    staging.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".sdflow-unet-", dir=staging) as tmp:
        weights = Path(tmp) / "unet.safetensors"
        trainer.backend.export(weights, trainer.rank)
        ema_params = [p.detach().cpu() for p in trainer.ema.shadow_params] if trainer.ema is not None else None
        family = trainer.family
        trainer.release()
        barrier()
        if not rank0:
            return None
        return build_pipeline(args, weights, ema_params, family)


def copy_report(model_dir: Path, data_dir: Path, names: list[str]) -> None:
    """The small outputs also go to the output data dir: SageMaker ships them as output.tar.gz, which
    a reader fetches without the model.tar.gz around them (gigabytes on a real base model)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(model_dir / name, data_dir / name)


def build_pipeline(
    args: argparse.Namespace, weights: Path, ema_params: list[Any] | None, family: Family | None = None
) -> Any:
    """The base pipeline with the trained denoiser (or its EMA), in the precision it is saved in."""
    import torch
    from safetensors.torch import load_file

    from sdflow_image import families

    base = args.pretrained_model_name_or_path
    family = family or families.get(families.detect_family(base))
    unet = family.denoiser_class().from_pretrained(
        base, subfolder=family.denoiser_name, local_files_only=True, torch_dtype=torch.float32
    )
    unet.load_state_dict({k: v.float() for k, v in load_file(str(weights)).items()})
    if ema_params is not None:
        with torch.no_grad():
            for param, averaged in zip(unet.parameters(), ema_params, strict=True):
                param.copy_(averaged)
    # No safety checker (family.pipeline_kwargs), as the server and the adherence comparison load
    # models: a base that has one (SD 1.5's model_index lists it) would black out this side's
    # samples only, and it would travel with the trained model for nothing.
    pipe = load_base(family, base, **{family.denoiser_name: unet}, **dict.fromkeys(family.left_out(args)))
    return pipe.to(dtype=model.precision_dtype(args.mixed_precision))


def model_info(args: argparse.Namespace, steps: int) -> dict[str, Any]:
    """What serving, evaluation and the registry read (the contract with the orchestration)."""
    method = getattr(args, "training_method", "full")
    info: dict[str, Any] = {
        "format": MODEL_INFO_FORMAT,
        "family": getattr(args, "model_family", None) or "sd",
        "method": method,
        "base_model_uri": getattr(args, "base_model_uri", "") or "",
    }
    from sdflow_image import families

    family = families.get(info["family"])
    if family.left_out(args):  # what the model was trained without, so that serving leaves it out too
        info["left_out"] = list(family.left_out(args))
    if method == "lora":
        info["lora"] = {
            "rank": args.lora_rank,
            "alpha": args.lora_alpha,
            "target_modules": lora.target_modules(args, family),
            "text_encoder": bool(args.train_text_encoder_lora),
        }
    return {
        **info,
        "resolution": args.resolution,
        "dtype": DTYPE_NAMES[args.mixed_precision],
        "steps": steps,
        "base_model": str(args.pretrained_model_name_or_path),
    }


def write_model_info(out: Path, args: argparse.Namespace, steps: int) -> None:
    (out / MODEL_INFO).write_text(json.dumps(model_info(args, steps), indent=2))


def write_loss_plot(losses: list[tuple[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    if losses:
        steps, values = zip(*losses, strict=True)
        ax.plot(steps, values, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_samples(pipe: Any, args: argparse.Namespace, device: Any, path: Path) -> None:
    """One image per validation prompt, in a grid. On CPU in fp32: CPU half-precision kernels are
    slow or missing, and the saved weights are already on disk."""
    import torch
    from PIL import Image

    pipe = pipe.to(device) if device.type == "cuda" else pipe.to(device=device, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    images = []
    for prompt in args.validation_prompts:
        with torch.no_grad():
            # By name: FLUX.2 [klein]'s pipeline takes an image first.
            result = pipe(
                prompt=prompt,
                num_inference_steps=args.validation_inference_steps,
                height=args.resolution,
                width=args.resolution,
                generator=generator,
            )
        images.append(result.images[0])
    columns = min(4, len(images))
    rows = math.ceil(len(images) / columns)
    width, height = images[0].size
    grid = Image.new("RGB", (columns * width, rows * height), "white")
    for i, image in enumerate(images):
        grid.paste(image, ((i % columns) * width, (i // columns) * height))
    grid.save(path)


def write_adherence(pipe: Any, args: argparse.Namespace, device: Any, out: Path) -> dict[str, Any]:
    """Score the trained pipeline and the base model on the held-out prompts with the evaluation
    the `evaluate` job runs too (sdflow_image.evaluation.adherence.compare): the side-by-side grid, the
    metric lines in the log. Rank 0, after training."""
    from sdflow_image.evaluation import adherence

    pipe.set_progress_bar_config(disable=True)
    result = adherence.compare(
        lambda: pipe,
        lambda: adherence.load_pipeline(args.pretrained_model_name_or_path, device),
        list(args.eval_prompts) or adherence.default_prompts(),
        out_dir=out,
        resolution=args.resolution,
        num_inference_steps=args.eval_inference_steps,
        guidance_scale=args.eval_guidance_scale,
        seed=args.seed,
    )
    return {
        "base": result.base.score,
        "trained": result.trained.score,
        "prompts": result.trained.prompts,
        "shape_accuracy": {"base": result.base.shape_accuracy, "trained": result.trained.shape_accuracy},
        "grid": adherence.GRID_FILE,
    }
