"""What a finished training job leaves in /opt/ml/model.

- the fine-tuned StableDiffusionPipeline (diffusers layout, safetensors), in half precision when
  trained in fp16 or bf16 (the weights the serving container loads, at half the bytes), else fp32;
- `sdflow_model.json`: {"resolution", "dtype", "steps", "base_model"}; the server's default
  image size is the trained resolution;
- `training_summary.json`, `loss.png`, `samples.png` (one image per validation prompt);
- with --eval_adherence: `adherence.png` (each held-out prompt: base | trained) and the base and
  trained prompt-adherence scores in the summary and in the log, where the job's metric
  definitions pick them up (`eval:prompt_adherence=`, `eval:base_prompt_adherence=`).

The summary and the images are copied to /opt/ml/output/data too (rank 0, like the rest), which
SageMaker uploads as `output/output.tar.gz`: its place for a job's non-model artifacts.

The training state is freed before anything is rendered: the boosted UNet, optimizer states,
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
from sdflow_image.training import model
from sdflow_image.training.loop import Trainer, barrier

MODEL_INFO = "sdflow_model.json"
DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16", "no": "float32"}
# Copied to the output data dir as well (output.tar.gz), with adherence.GRID_FILE when it is made.
REPORT_FILES = ("training_summary.json", "loss.png", "samples.png")
ADHERENCE_GRID = "adherence.png"  # sdflow_image.adherence.GRID_FILE, without importing numpy here


def save(args: argparse.Namespace, trainer: Trainer, summary: dict[str, Any]) -> None:
    """Collective: export the weights (sharded plugins gather onto rank 0), free the training
    state on every rank, then rank 0 writes the outputs."""
    rank0, device, losses, steps = trainer.rank == 0, trainer.device, list(trainer.state.losses), trainer.state.step
    # Staged inside the model folder: /opt/ml/model is on the job's storage volume (the SageMaker
    # developer guide, "Managing storage paths for different types of instance local storage": the
    # default paths, /opt/ml/model among them, are mounted on the instance's EBS or NVMe volume),
    # where /opt/ml beside it may be the container's root file system. The folder is gone before
    # the model is written there (the context ends first), so it never reaches model.tar.gz.
    staging = Path(args.output_dir).resolve()
    staging.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".sdflow-unet-", dir=staging) as tmp:
        weights = Path(tmp) / "unet.safetensors"
        b = trainer.boosted
        b.booster.save_model(b.model, str(weights), shard=False, use_safetensors=True)
        ema_params = [p.detach().cpu() for p in trainer.ema.shadow_params] if trainer.ema is not None else None
        del b
        trainer.release()
        barrier()
        if not rank0:
            return
        pipe = build_pipeline(args, weights, ema_params)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    write_model_info(out, args, steps)
    write_loss_plot(losses, out / "loss.png")
    write_samples(pipe, args, device, out / "samples.png")
    if args.eval_adherence:
        summary["prompt_adherence"] = write_adherence(pipe, args, device, out)
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2))
    report = [*REPORT_FILES, ADHERENCE_GRID] if args.eval_adherence else list(REPORT_FILES)
    copy_report(out, contract.output_data_dir(), report)
    print(f"saved model to {out}", flush=True)


def copy_report(model_dir: Path, data_dir: Path, names: list[str]) -> None:
    """The small outputs also go to the output data dir: SageMaker ships them as output.tar.gz, which
    a reader fetches without the model.tar.gz around them (gigabytes on a real base model)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(model_dir / name, data_dir / name)


def build_pipeline(args: argparse.Namespace, weights: Path, ema_params: list[Any] | None) -> Any:
    """The base pipeline with the trained UNet (or its EMA), in the precision it is saved in."""
    import torch
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from safetensors.torch import load_file

    base = args.pretrained_model_name_or_path
    unet = UNet2DConditionModel.from_pretrained(
        base, subfolder="unet", local_files_only=True, torch_dtype=torch.float32
    )
    unet.load_state_dict({k: v.float() for k, v in load_file(str(weights)).items()})
    if ema_params is not None:
        with torch.no_grad():
            for param, averaged in zip(unet.parameters(), ema_params, strict=True):
                param.copy_(averaged)
    # No safety checker, as the server and the adherence comparison load models: a base that has
    # one (SD 1.5's model_index lists it) would black out this side's samples only, and it would
    # travel with the trained model for nothing (serve_model loads without it).
    pipe = StableDiffusionPipeline.from_pretrained(
        base,
        unet=unet,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
        local_files_only=True,
    )
    return pipe.to(dtype=model.precision_dtype(args.mixed_precision))


def model_info(args: argparse.Namespace, steps: int) -> dict[str, Any]:
    return {
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
            result = pipe(
                prompt,
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
    the `evaluate` job runs too (sdflow_image.adherence.compare): the side-by-side grid, the
    metric lines in the log. Rank 0, after training."""
    from sdflow_image import adherence

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
