"""The evaluate job: score a trained model against its base model on the run's held-out data
(CLIP score, KID, FID) and, for the demo's scenes, on prompt adherence.

SageMaker runs it as a processing job after training (`ContainerEntrypoint = ["evaluate"]`, the
flags as ContainerArguments), so the pipeline can gate registration on the scores:

    evaluate --model_dir /opt/ml/processing/model --base_model_dir /opt/ml/processing/base_model
             --output_dir /opt/ml/processing/evaluation
             [--holdout_dir /opt/ml/processing/holdout --holdout_samples 256]
             [--clip_model_dir /opt/ml/processing/clip_model]
             [--scene_adherence true] [--prompts_file FILE | --prompts JSON]
             [--num_inference_steps 20] [--guidance_scale 5.0] [--seed 0] [--resolution 0]

What it promises:
- every flag and folder is checked before a model is loaded or an image rendered (the held-out
  tars are listed, the CLIP config read, the prompts parsed), and a bad one fails in seconds with a
  message naming the flag and the fix; with neither held-out samples nor scene adherence there is
  nothing to score, and the job says what to pass;
- the held-out samples are the --holdout_samples of smallest holdout fraction (evaluation.heldout):
  each caption is rendered by the trained model, then (that model freed) by the base, from the same
  seed (seed + i), one pipeline in memory at a time; the scene prompts ride in the same two loads;
- --model_dir may hold a LoRA run's adapter (sdflow_model.json says `"method": "lora"`): it is
  scored loaded on --base_model_dir, so the comparison is base against base + adapter;
- --model_dir holds the trained model's files as SageMaker downloads the training job's uncompressed
  output (OutputDataConfig.CompressionType NONE); an older job's `model.tar.gz` there is
  extracted (tarfile's "data" filter: no links or paths out of the folder) under --work_dir;
- the CLIP model loads only after both pipelines are gone (evaluation.holdout_scores, metrics);
- scene adherence is the training job's end-of-training score (adherence), so the two scores of a
  model agree for the same prompts and settings; on a GPU the models load in the endpoint's dtype
  (`EVALUATION_DTYPE`), where the training job's own evaluation computes in fp32;
- `<output_dir>/evaluation.json` (evaluation.report) is written last, after `holdout.png` and
  `adherence.png`; a metric not computed is listed in its `missing` with the reason, never guessed.
Any error goes to the processing job's ExitMessage file (and the failure file), and the exit
status is non-zero; on success the ExitMessage sums up each metric base → trained."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdflow_image import contract, flags, gpu_check, scenes
from sdflow_image.evaluation import adherence, clip_model, heldout, holdout_scores, report
from sdflow_image.evaluation.errors import EvaluationError
from sdflow_image.serving import serve_model
from sdflow_image.serving.serve_request import SIZE_MULTIPLE

LOG = logging.getLogger("sdflow.evaluate")

EVALUATION_FILE = "evaluation.json"
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # training.lora.LORA_WEIGHTS, without torch
MAX_PROMPTS = 256
MODEL_FIX = "mount the training job's model there: the files of its uncompressed output (or its model.tar.gz)"
BASE_FIX = "mount the base diffusers model the training job started from there"


class Terminated(EvaluationError):
    """SIGTERM: SageMaker is stopping the job."""


def _path(text: str) -> Path:
    if not text.strip():
        raise ValueError("is empty; expected a path")
    return Path(text)


def _resolution(text: str) -> int:
    value = flags.non_negative_int(text)
    if value % SIZE_MULTIPLE:
        raise ValueError(f"must be a multiple of {SIZE_MULTIPLE} (or 0: the trained resolution)")
    return int(value)


FLAGS: list[flags.Flag] = [
    flags.Flag("model_dir", _path, None, "the trained model: diffusers files or the job's model.tar.gz", required=True),
    flags.Flag("base_model_dir", _path, None, "the base diffusers model the training started from", required=True),
    flags.Flag("output_dir", _path, None, "where evaluation.json, holdout.png, adherence.png go", required=True),
    flags.Flag("holdout_dir", _path, None, "a folder whose *.tar files (at any depth) hold the held-out samples"),
    flags.Flag("holdout_samples", flags.positive_int, 256, "how many held-out samples to score (smallest fraction)"),
    flags.Flag("clip_model_dir", _path, None, "a transformers CLIPModel folder with its processor files"),
    flags.Flag("scene_adherence", flags.boolean, False, "score the scene prompts' adherence (demo's grammar)"),
    flags.Flag("prompts_file", _path, None, "a JSON list of scene prompts, or one per line (# comments); implies it"),
    flags.Flag("prompts", flags.prompt_list, None, "JSON list of scene prompts (implies --scene_adherence true)"),
    flags.Flag("num_inference_steps", flags.positive_int, 20, "denoising steps per image"),
    flags.Flag("guidance_scale", flags.non_negative_float, 5.0, "classifier-free guidance scale"),
    flags.Flag("seed", flags.non_negative_int, 0, "seed of the first prompt's generator (prompt i: seed + i)"),
    flags.Flag("resolution", _resolution, 0, "image side in pixels; 0 = the trained resolution (sdflow_model.json)"),
    flags.Flag("work_dir", _path, None, "where a model.tar.gz is extracted (None: $SDFLOW_OPT_ML/processing/work)"),
]


def build_parser() -> argparse.ArgumentParser:
    return flags.build_parser("evaluate", "Score a trained model against its base.", FLAGS)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the job's arguments; raises flags.FlagError naming the flag."""
    return flags.parse(build_parser(), FLAGS, argv)


# --- prompts ------------------------------------------------------------------------------


def _prompts_from_file(path: Path) -> list[str]:
    if not path.is_file():
        raise EvaluationError(f"--prompts_file {path} is not a file; pass the prompts file the job mounts")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EvaluationError(f"--prompts_file {path} is not readable UTF-8 text ({exc})") from exc
    if text.lstrip().startswith("["):
        try:
            return flags.prompt_list(text)
        except ValueError as exc:
            raise EvaluationError(f"--prompts_file {path} {exc}") from None
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts to score, each checked against the scene grammar the score reads."""
    if args.prompts is not None and args.prompts_file is not None:
        raise EvaluationError("pass --prompts or --prompts_file, not both")
    if args.prompts_file is not None:
        source, prompts = f"--prompts_file {args.prompts_file}", _prompts_from_file(args.prompts_file)
    elif args.prompts is not None:
        source, prompts = "--prompts", list(args.prompts)
    else:
        return adherence.default_prompts()
    if not prompts:
        raise EvaluationError(f"{source} holds no prompts")
    if len(prompts) > MAX_PROMPTS:
        raise EvaluationError(f"{source} holds {len(prompts)} prompts; at most {MAX_PROMPTS} are scored")
    for number, prompt in enumerate(prompts, 1):
        try:
            scenes.parse_prompt(prompt)
        except scenes.PromptGrammarError as exc:
            raise EvaluationError(
                f"{source}, prompt {number}: {exc}. Every prompt must read {scenes.GRAMMAR!r} "
                f"with colours {', '.join(scenes.COLORS)} and shapes {', '.join(scenes.SHAPES)}"
            ) from None
    return prompts


# --- model folders ------------------------------------------------------------------------


def check_pipeline_dir(path: Path, flag: str, fix: str) -> Path:
    """`path` holds a diffusers pipeline: model_index.json and a folder for each component it names."""
    if not path.is_dir():
        raise EvaluationError(f"{flag} {path} does not exist or is not a folder; {fix}")
    index = path / "model_index.json"
    if not index.is_file():
        raise EvaluationError(f"{flag} {path} holds no diffusers pipeline (model_index.json missing); {fix}")
    try:
        components = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise EvaluationError(f"{flag} {index} is not readable JSON ({exc}); {fix}") from exc
    if not isinstance(components, dict):
        raise EvaluationError(f"{flag} {index} is not a JSON object; {fix}")
    # Entries are [library, class] (null for an absent optional part such as the safety checker).
    missing = [
        name
        for name, spec in components.items()
        if not name.startswith("_") and isinstance(spec, list) and spec and spec[0] and not (path / name).is_dir()
    ]
    if missing:
        raise EvaluationError(f"{flag} {path} lacks the pipeline's {', '.join(sorted(missing))} folder(s); {fix}")
    return path


def is_adapter(path: Path) -> bool:
    """`path` holds a LoRA run's output: an adapter that loads on the base model."""
    try:
        info = serve_model.read_model_info(path)
    except serve_model.ModelInfoError as exc:
        raise EvaluationError(f"--model_dir: {exc}") from None
    return info is not None and info.method == "lora"


def check_model_dir(path: Path, flag: str, fix: str) -> Path:
    """A whole pipeline, or a LoRA adapter with its file (the base is checked on its own)."""
    if is_adapter(path):
        if not (path / LORA_WEIGHTS).is_file():
            raise EvaluationError(f"{flag} {path} is a LoRA model without its {LORA_WEIGHTS}; {fix}")
        return path
    return check_pipeline_dir(path, flag, fix)


def model_folder(path: Path, work: Path) -> Path:
    """The trained model's folder: --model_dir itself, or its model.tar.gz extracted into `work`."""
    if path.is_dir() and ((path / "model_index.json").is_file() or is_adapter(path)):
        return check_model_dir(path, "--model_dir", MODEL_FIX)
    if path.is_file():
        archive = path
    elif path.is_dir():
        archives = sorted(path.glob("*.tar.gz"))
        if len(archives) != 1:
            return check_pipeline_dir(path, "--model_dir", MODEL_FIX)  # raises, naming what is missing
        archive = archives[0]
    else:
        raise EvaluationError(f"--model_dir {path} does not exist; {MODEL_FIX}")
    LOG.info("extracting %s into %s", archive, work)
    try:
        with tarfile.open(archive, "r:*") as tar:
            tar.extractall(work, filter="data")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise EvaluationError(f"--model_dir {archive} is not a readable tar.gz archive ({exc}); {MODEL_FIX}") from exc
    # An archive made of a folder (tar czf model.tar.gz model/) holds the pipeline one level down.
    entries = [p for p in work.iterdir() if not p.name.startswith(".")]
    root = entries[0] if len(entries) == 1 and entries[0].is_dir() else work
    return check_model_dir(root, "--model_dir", f"{archive.name} must hold the trained model's files")


def trained_resolution(model_dir: Path) -> int:
    """As the server picks its default size: sdflow_model.json's resolution, else the UNet's
    sample size times the VAE's downscaling, else 512."""
    try:
        info = serve_model.read_model_info(model_dir)
    except serve_model.ModelInfoError as exc:
        raise EvaluationError(f"--model_dir: {exc}; pass --resolution to override") from None
    if info is not None:
        return info.resolution
    try:
        unet = json.loads((model_dir / "unet" / "config.json").read_text(encoding="utf-8"))
        vae = json.loads((model_dir / "vae" / "config.json").read_text(encoding="utf-8"))
        return int(unet["sample_size"]) * 2 ** (len(vae["block_out_channels"]) - 1)
    except (OSError, ValueError, KeyError, TypeError):
        return serve_model.FALLBACK_IMAGE_SIZE


# Both models load as the endpoint serves them: on a GPU in serve_model.serving_dtype of their family
# (bf16 for FLUX.2, Qwen-Image and SD 3.5, whose fp16 overflows; half precision for SD), so the score
# is the deployed model's and a model that fits the endpoint fits here (in float32, Qwen-Image's
# transformer alone is 82 GB). On a CPU, float32 (the training job's own evaluation computes in it).
EVALUATION_DTYPE = "auto"


def _loader(path: Path, flag: str, fix: str, device: str, base: Path | None = None) -> Callable[[], Any]:
    def load() -> Any:
        try:
            # The base only for an adapter: a whole pipeline loads as it always did.
            if base is None:
                return adherence.load_pipeline(path, device, dtype=EVALUATION_DTYPE)
            return adherence.load_pipeline(path, device, base, dtype=EVALUATION_DTYPE)
        except Exception as exc:  # diffusers raises OSError, ValueError, KeyError... for a bad file
            raise EvaluationError(
                f"{flag} {path}: the pipeline does not load ({type(exc).__name__}: {exc}); {fix}"
            ) from exc

    return load


# --- the job ------------------------------------------------------------------------------

NOTHING_TO_EVALUATE = (
    "pass --holdout_dir (the run's held-out tars: set evaluation.holdout_samples) or "
    "--scene_adherence true (or --prompts / --prompts_file) for the demo's scene prompts"
)


@dataclass
class Plan:
    """What the checks found: what to score, before anything heavy is loaded."""

    prompts: list[str] | None  # scene prompts; None: no scene adherence
    clip: clip_model.ClipConfig | None


def plan(args: argparse.Namespace) -> Plan:
    """Check every input; raises EvaluationError naming the flag and the fix."""
    scene = args.scene_adherence or args.prompts is not None or args.prompts_file is not None
    prompts = read_prompts(args) if scene else None
    if args.holdout_dir is None and prompts is None:
        raise EvaluationError(f"nothing to evaluate: {NOTHING_TO_EVALUATE}")
    tars = heldout.tar_files(args.holdout_dir) if args.holdout_dir is not None else []
    if args.holdout_dir is not None and not tars and prompts is None:
        raise EvaluationError(
            f"nothing to evaluate: --holdout_dir {args.holdout_dir} holds no .tar file; {heldout.HOLDOUT_FIX}"
        )
    clip = clip_model.check_clip_dir(args.clip_model_dir) if args.clip_model_dir is not None else None
    check_pipeline_dir(args.base_model_dir, "--base_model_dir", BASE_FIX)
    return Plan(prompts, clip)


def _select(
    args: argparse.Namespace, checked: Plan, scores: report.Scores, fit: Callable[[int, Any], Any]
) -> heldout.Selection | None:
    if args.holdout_dir is None:
        holdout_scores.lack_all(scores, report.NO_HOLDOUT, *([report.NO_CLIP] if checked.clip is None else []))
        return None
    selection = heldout.select(args.holdout_dir, args.holdout_samples, fit)
    if not selection.samples:
        found = f"--holdout_dir {args.holdout_dir} holds no held-out sample with an image and a caption"
        if checked.prompts is None:
            raise EvaluationError(f"nothing to evaluate: {found}; {heldout.HOLDOUT_FIX}")
        holdout_scores.lack_all(scores, f"no held-out samples: {found}")
    LOG.info(
        "held-out: %d of %d candidates in %d tar files",
        len(selection.samples),
        selection.candidates,
        selection.tar_files,
    )
    return selection


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Do the job; return the evaluation.json document."""
    checked = plan(args)
    scores = report.Scores()
    prompts = checked.prompts or []
    work_root = args.work_dir if args.work_dir is not None else contract.opt_ml() / "processing" / "work"
    work_root.mkdir(parents=True, exist_ok=True)
    # On the job's volume (not the image's small root disk): a real model is gigabytes.
    with tempfile.TemporaryDirectory(prefix="model-", dir=work_root) as work:
        model_dir = model_folder(args.model_dir, Path(work))
        import torch  # here: a job failing the checks above should not pay for importing it

        device = "cuda" if torch.cuda.is_available() else "cpu"
        settings = {
            "resolution": args.resolution or trained_resolution(model_dir),
            "num_inference_steps": args.num_inference_steps,
            "guidance_scale": args.guidance_scale,
            "seed": args.seed,
        }
        # Selected once the resolution is known: each image is fitted to it as it is decoded.
        side = holdout_scores.metric_side(checked.clip, settings["resolution"])
        selection = _select(args, checked, scores, holdout_scores.real_fit(settings["resolution"], side))
        samples = selection.samples if selection is not None else []
        captions = [sample.caption for sample in samples]
        LOG.info("rendering %d held-out captions and %d scene prompts on %s with %s",
                 len(captions), len(prompts), device, json.dumps(settings))  # fmt: skip
        args.output_dir.mkdir(parents=True, exist_ok=True)
        # A LoRA adapter is evaluated on the base it was trained on: base vs base + adapter.
        adapter_base = args.base_model_dir if is_adapter(model_dir) else None
        loaders = {
            "trained": _loader(model_dir, "--model_dir", MODEL_FIX, device, adapter_base),
            "base": _loader(args.base_model_dir, "--base_model_dir", BASE_FIX, device),
        }
        # Trained first, then the base, each freed before the next loads (adherence.render_with).
        keeps = [holdout_scores.render_keep(side), None]
        renders = {
            name: adherence.render_with(load, [captions, prompts], keeps, **settings) for name, load in loaders.items()
        }
    scene = None
    if checked.prompts is not None:
        scene = adherence.compare_images(renders["trained"][1], renders["base"][1], prompts, out_dir=args.output_dir)
        scores.metrics["prompt_adherence"] = report.adherence_metric(scene)
    else:
        scores.lack("prompt_adherence", report.NO_SCENES)
    clip_entry = None
    if samples:
        clip_entry = holdout_scores.score(
            samples, {name: images[0] for name, images in renders.items()}, checked.clip, scores,
            resolution=settings["resolution"], seed=args.seed, device=device, out_dir=args.output_dir, fitted=True,
        )  # fmt: skip
    holdout_record = {"holdout_samples_asked": args.holdout_samples, **_selection_record(selection)}
    document = report.evaluation_document(
        scores, captions=captions, holdout=holdout_record, clip_model=clip_entry, scene=scene,
        settings={**settings, "device": device},
    )  # fmt: skip
    # Written last: its presence means the grids are in place too.
    (args.output_dir / EVALUATION_FILE).write_text(json.dumps(document, indent=2), encoding="utf-8")
    return document


def _selection_record(selection: heldout.Selection | None) -> dict[str, Any]:
    if selection is None:
        return {}
    return {"candidates": selection.candidates, "tar_files": selection.tar_files, "skipped": selection.skipped}


def main(args: argparse.Namespace | None = None) -> int:
    """Run the job; return the exit status (0 scored, 1 failed)."""

    def work() -> str:
        gpu_check.require_cuda()  # a GPU torch cannot use fails the job here, naming the driver
        return report.summary(evaluate(args if args is not None else parse_args()))

    return contract.run_processing_job(
        work,
        lambda signum: Terminated(
            f"stopped by signal {signum} (SageMaker stops jobs with SIGTERM) before it wrote {EVALUATION_FILE}"
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
