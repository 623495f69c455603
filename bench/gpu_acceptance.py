"""GPU acceptance: the training job itself, at full size, for every plugin x precision asked.

For each plugin (torch_ddp, low_level_zero, gemini) and mixed precision (fp16, bf16) it runs the
training entrypoint as a SageMaker host with every GPU runs it: torchrun through
`sdflow_image.training.elastic_run`, one process per GPU, `sdflow_image.training.train` in each, on a pipeline of
the family asked (`--family`) with random weights, nothing downloaded: SD 1.5's size
(`sdflow_image.builders.random_sd15`), SDXL base 1.0's or SD 3 medium's without T5
(`sdflow_image.builders.random_families`), trained in full or as a LoRA adapter (`--method`); webdataset
shards at the family's resolution are streamed by the real loader, from a local S3 (moto's
server) unless `--data folder`. Three runs per row:

1. **uninterrupted**: `--steps` optimizer steps with a checkpoint halfway, EMA on for SD 1.5 full
   rows where the plugin allows it (not gemini; `uses_ema` says why not elsewhere), DataLoader
   workers on;
2. **stopped**: the same job, SIGTERM to the launcher mid-run (as StopTrainingJob and a spot
   interruption send it): it must save a complete checkpoint and exit 143;
3. **resumed**: the same job again, in fresh processes: it must resume at that checkpoint and
   end with the same per-step losses and the same saved weights as run 1 (the denoiser, or the
   LoRA adapter; relative tolerances `--loss-tolerance`, `--weight-tolerance`).

Printed per row: samples/s per GPU (median step), peak GPU memory (max over ranks), seconds to
save a checkpoint, seconds from SIGTERM to exit, and the differences of the resumed run; before
the rows, the seconds Colossal-AI's kernels take to load (the first time: to build).

    python bench/gpu_acceptance.py --json gpu-acceptance.json     # every GPU of this machine
    python bench/gpu_acceptance.py --plugins gemini --precisions bf16
    python bench/gpu_acceptance.py --family sdxl --method full --precisions bf16     # low_level_zero, gemini
    python bench/gpu_acceptance.py --family sdxl --method lora --plugins torch_ddp --precisions bf16
    python bench/gpu_acceptance.py --family sd3 --method lora --plugins torch_ddp --precisions bf16
    python bench/gpu_acceptance.py --tiny --nproc 2 --plugins torch_ddp --precisions bf16   # CPU: the harness
    .venv-accelerate/bin/python bench/gpu_acceptance.py --backend accelerate --family sd3 --method full  # fsdp2
    .venv-accelerate/bin/python bench/gpu_acceptance.py --backend accelerate --family sd3 --method lora  # ddp

`--backend accelerate` runs the second stack's rows (its own venv: no Colossal-AI there, so no
kernels to load): plugins ddp and fsdp2, bf16, for SD 3 and the new families at full size with
random weights (`sdflow_image.builders.random_families_next`, built on the GPU, at 1024 px), each with
`.venv-accelerate/bin/python`:

    bench/gpu_acceptance.py --backend accelerate --family flux2 --method lora
    bench/gpu_acceptance.py --backend accelerate --family flux2 --variant flux2-klein-9b --method lora
    bench/gpu_acceptance.py --backend accelerate --family sd35 --method full       # fsdp2
    bench/gpu_acceptance.py --backend accelerate --family qwenimage --method lora

Exit status: 0 every row held; 1 one did not (its row says why); 2 bad arguments, or no CUDA
device without `--tiny` (one line says so).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
IMAGE_DIR = REPO / "training_image"
sys.path.insert(0, str(IMAGE_DIR))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # acceptance_inputs, also when loaded by path

from acceptance_inputs import build_base, free_port, in_folder, local_s3, weight_difference, write_shards  # noqa: E402
from acceptance_report import report  # noqa: E402

from sdflow_image import flags  # noqa: E402  (no torch: the CPU exit path stays light)
from sdflow_image.backends import rules  # noqa: E402
from sdflow_image.families.base import FAMILIES, METHODS  # noqa: E402
from sdflow_image.training import checkpoints, launcher, lora  # noqa: E402

PLUGINS = rules.PLUGINS  # colossalai's torch_ddp, low_level_zero, gemini; accelerate's ddp, fsdp2
PRECISIONS = ("fp16", "bf16")
EXIT_NO_CUDA = 2
EXIT_STOPPED = 128 + signal.SIGTERM
PROMPT = "a red square on a blue background"


@dataclass
class Row:
    plugin: str
    precision: str
    gpus: int
    batch_per_gpu: int
    steps: int
    ema: bool
    samples_per_s_per_gpu: float = math.nan
    peak_gpu_gib: float = math.nan
    checkpoint_s: float = math.nan
    stop_s: float = math.nan  # SIGTERM to the launcher's exit, checkpoint included
    stopped_at: int | None = None
    loss_diff: float = math.nan  # max relative difference of the resumed run's step losses
    weight_diff: float = math.nan  # relative L2 difference of the saved UNet weights
    final_loss: float = math.nan
    error: str | None = None
    checks: list[str] = field(default_factory=list)
    family: str = "sd"
    method: str = "full"
    backend: str = "colossalai"

    @property
    def ok(self) -> bool:
        return self.error is None and not self.checks


_positive_int = flags.argparse_type(flags.positive_int)


def _choices(allowed: tuple[str, ...]) -> Any:
    def parse(value: str) -> list[str]:
        picked = [v.strip() for v in value.split(",") if v.strip()]
        unknown = [v for v in picked if v not in allowed]
        if unknown or not picked:
            raise argparse.ArgumentTypeError(f"{value!r}: use a comma-separated subset of {','.join(allowed)}")
        return list(dict.fromkeys(picked))

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/gpu_acceptance.py",
        description="The training job at full size (random weights): plugin x precision, stop, resume, throughput.",
    )
    parser.add_argument("--steps", type=_positive_int, default=12, help="optimizer steps per run (>= 4)")
    parser.add_argument("--batch-size", type=_positive_int, default=4, help="samples per GPU per step")
    # > 1 runs low_level_zero as ZeRO stage 1 with no_sync on the micro-batches before the last
    # (sdflow_image/training/accumulation.py): its exact resume and throughput need a GPU to check.
    parser.add_argument("--gradient-accumulation-steps", type=_positive_int, default=1, help="micro-batches per step")
    parser.add_argument(
        "--family",
        choices=FAMILIES,
        default="sd",
        help="sd: SD 1.5's size; sdxl: SDXL base 1.0's; sd3: SD 3 medium's without T5; sd35, flux2, "
        "qwenimage: --variant's (random weights; the last three need --backend accelerate)",
    )
    parser.add_argument(
        "--variant",
        default=None,
        help="the new families' full-size model: sd35-large, sd35-medium (default), flux2-klein-4b (default), "
        "flux2-klein-9b, qwenimage",
    )
    parser.add_argument(
        "--method", choices=METHODS, default="full", help="train every denoiser weight or a LoRA adapter"
    )
    parser.add_argument(
        "--backend",
        choices=rules.BACKENDS,
        default="colossalai",
        help="colossalai (run in .venv-image) or accelerate (run in .venv-accelerate): the stack of this Python",
    )
    parser.add_argument(
        "--plugins",
        type=_choices(PLUGINS),
        default=None,
        help="comma-separated subset (default: every plugin the family x method x backend is meant for)",
    )
    parser.add_argument("--resolution", type=_positive_int, default=None, help="pixels (default: the family's own)")
    parser.add_argument("--precisions", type=_choices(PRECISIONS), default=None,
                        help="comma-separated (default: fp16,bf16; bf16 under accelerate)")  # fmt: skip
    parser.add_argument("--nproc", type=_positive_int, default=None, help="processes (default: every GPU)")
    parser.add_argument("--data", choices=("s3", "folder"), default="s3", help="shards on a local S3 or in a folder")
    parser.add_argument(
        "--learning-rate", type=float, default=1e-4, help="AdamW learning rate (large: so a lost step shows)"
    )
    parser.add_argument("--loss-tolerance", type=float, default=1e-3, help="max relative step-loss difference")
    parser.add_argument("--weight-tolerance", type=float, default=1e-4, help="max relative L2 weight difference")
    parser.add_argument("--run-timeout", type=_positive_int, default=600, help="seconds one training run may take")
    parser.add_argument("--budget-s", type=_positive_int, default=None,
                        help="start no new row after this many seconds (the rest report 'not run')")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="the tiny model at 32 px, CPU allowed: checks the harness")
    parser.add_argument("--no-stop", action="store_true",
                        help="only the uninterrupted run (throughput, peak memory): no stop and resume")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help="the ten-minute plan for one GPU (acceptance_quick.py): its own rows")  # fmt: skip
    parser.add_argument("--work-dir", type=Path, default=None, help="where models, shards and runs go (default: temp)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    if args.steps < 4:
        parser.error("argument --steps: at least 4 (a checkpoint halfway, a stop after it)")
    args.plugins = args.plugins or default_plugins(args.family, args.method, args.backend)
    args.precisions = args.precisions or list(rules.MIXED_PRECISIONS_OF_BACKEND[args.backend][1:])
    for plugin in args.plugins:  # the image's own rules (train.py refuses the same)
        for precision in args.precisions:
            if reason := rules.refusal(args.family, args.backend, plugin, args.method, precision):
                parser.error(f"argument --plugins/--precisions: {reason}")
    return args


def default_plugins(family: str, method: str, backend: str = "colossalai") -> list[str]:
    """accelerate: its plugin for the method (fsdp2 full, ddp LoRA). colossalai: LoRA trains on
    torch_ddp only (backends/rules.py); a full SDXL run is the one the issue asks to run sharded
    (issue 21: a full SDXL fine-tune needs sharding on 24 GB); the rest, every plugin."""
    if backend != "colossalai":
        return [rules.default_plugin(backend, method)]
    if method == "lora":
        return ["torch_ddp"]
    if family == "sdxl":
        return ["low_level_zero", "gemini"]
    return list(rules.PLUGINS_OF_BACKEND["colossalai"])


def cuda_missing_reason() -> str | None:
    """One line saying why this machine cannot run the acceptance, or None when it can."""
    import torch

    if not torch.cuda.is_available():
        return (
            "gpu_acceptance: a CUDA device is needed (torch.cuda.is_available() is False on this machine); "
            "run it on a GPU host, see the README's 'GPU acceptance' (--tiny checks the harness on a CPU)"
        )
    return None


# --- runs ---------------------------------------------------------------------------------


@dataclass
class Run:
    """One launch of the training job: its exit status and what its log said."""

    code: int
    losses: dict[int, float]
    log: Path
    resumed_at: int | None = None
    stop_s: float | None = None

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _watch(process: subprocess.Popen[str], log: Path, losses: dict[int, float], seen: threading.Event,
           stop_at: int | None, resumed: list[int]) -> None:  # fmt: skip
    with log.open("w") as out:
        assert process.stdout is not None
        for line in process.stdout:
            out.write(line)
            out.flush()
            if line.startswith("step=") and " loss=" in line:
                step_text, loss_text = line.split()[:2]
                step = int(step_text.removeprefix("step="))
                losses[step] = float(loss_text.removeprefix("loss="))
                if stop_at is not None and step >= stop_at:
                    seen.set()
            elif line.startswith("resumed from checkpoint") and " at step " in line:
                resumed.append(int(line.rsplit(" at step ", 1)[1]))


def launch(opt_ml: Path, nproc: int, env: dict[str, str], timeout_s: int, stop_at: int | None = None) -> Run:
    """The job on one host as SageMaker runs it with `nproc` GPUs (torchrun through elastic_run);
    with `stop_at`, SIGTERM to the launcher once step `stop_at - 1` is logged (so it lands mid-step)."""
    topology = launcher.plan(
        {"hosts": ["algo-1"], "current_host": "algo-1"},
        nproc,
        {"SDFLOW_MASTER_ADDR": "127.0.0.1", "SDFLOW_MASTER_PORT": str(free_port())},
    )
    command = launcher.torchrun_command(topology, [])
    child_env = {**launcher.child_environment(topology), **env, "SDFLOW_OPT_ML": str(opt_ml)}
    losses: dict[int, float] = {}
    seen, resumed = threading.Event(), list[int]()
    log = opt_ml / f"run-{len(list(opt_ml.glob('run-*.log')))}.log"
    process = subprocess.Popen(command, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watcher = threading.Thread(target=_watch, args=(process, log, losses, seen, stop_at and stop_at - 1, resumed))
    watcher.start()
    stop_s = None
    try:
        if stop_at is not None and seen.wait(timeout_s):
            signalled = time.perf_counter()
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=timeout_s)
            stop_s = time.perf_counter() - signalled
        code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        code = process.wait()
    watcher.join()
    return Run(code if code >= 0 else 128 - code, losses, log, resumed[0] if resumed else None, stop_s)


def hyperparameters(args: argparse.Namespace, plugin: str, precision: str, base: Path, data_dir: str,
                    resolution: int) -> dict[str, str]:  # fmt: skip
    """As the pipeline passes them (strings); EMA where `uses_ema` says."""
    hp = {
        "pretrained_model_name_or_path": str(base),
        "model_family": args.family,
        "backend": args.backend,
        "training_method": args.method,
        "dataset_dir": data_dir,
        "plugin": plugin,
        "mixed_precision": precision,
        "resolution": str(resolution),
        "train_batch_size": str(args.batch_size),
        "gradient_accumulation_steps": str(args.gradient_accumulation_steps),
        "max_train_steps": str(args.steps),
        "checkpointing_steps": str(args.steps // 2),
        "learning_rate": str(args.learning_rate),
        "lr_scheduler": "linear",  # a schedule that moves: a resumed run on the wrong step shows
        "use_ema": str(uses_ema(args.family, args.method, plugin)).lower(),
        "ema_decay": "0.9",
        "dataloader_num_workers": "2",
        "validation_prompts": json.dumps([PROMPT]),
        "validation_inference_steps": "2",
    }
    if args.family in ("sd3", "sd35"):
        hp["sd3_t5"] = "false"  # the random SD 3 and 3.5 have no T5 (build_base): a run that leaves it out
    return hp


def uses_ema(family: str, method: str, plugin: str) -> bool:
    """EMA on SD 1.5-sized full rows where the plugin allows it (not gemini). LoRA keeps none
    (train.py refuses it, as diffusers' LoRA examples keep none). Off for SDXL and SD 3 full: by
    estimate (not measured) their checkpoint with an fp32 EMA copy is ~40 GB (UNet 10.3 GB, Adam
    20.5 GB, EMA 10.3 GB), beside a ~14 GB base, two saved models and a 64 GB disk on the lent GPU
    machine."""
    return method == "full" and plugin not in ("gemini", "fsdp2") and family == "sd"


def prepare(opt_ml: Path, hp: dict[str, str]) -> Path:
    config = opt_ml / "input" / "config"
    config.mkdir(parents=True, exist_ok=True)
    (config / "hyperparameters.json").write_text(json.dumps(hp))
    (config / "resourceconfig.json").write_text(json.dumps({"current_host": "algo-1", "hosts": ["algo-1"]}))
    return opt_ml


def run_row(row: Row, args: argparse.Namespace, work: Path, hp: dict[str, str], env: dict[str, str]) -> None:
    """Uninterrupted, stopped and resumed runs of one plugin x precision; fills `row`. Only the
    logs stay: an SD 1.5 checkpoint with EMA is ~15 GB, and a 64 GB disk filled up mid-save
    (torch.save: 'unexpected pos') when every row kept its own."""
    try:
        _runs(row, args, work, hp, env)
    finally:
        for run in ("uninterrupted", "stopped"):
            for bulky in ("checkpoints", "model", ".checkpoints-staging"):
                shutil.rmtree(work / run / bulky, ignore_errors=True)


def _runs(row: Row, args: argparse.Namespace, work: Path, hp: dict[str, str], env: dict[str, str]) -> None:
    nproc = row.gpus
    full = launch(prepare(work / "uninterrupted", hp), nproc, env, args.run_timeout)
    if full.code != 0:
        row.error = f"uninterrupted run exited {full.code}:\n{full.tail()}"
        return
    summary = json.loads((work / "uninterrupted" / "model" / "training_summary.json").read_text())
    row.samples_per_s_per_gpu = float(summary["median_samples_per_second"]) / nproc
    row.peak_gpu_gib = float(summary.get("peak_gpu_memory_gib") or math.nan)
    row.checkpoint_s = float(summary["checkpoint_time_s"])
    row.final_loss = float(summary["final_loss"])
    shutil.rmtree(work / "uninterrupted" / "checkpoints")  # only its saved model is compared
    if args.no_stop:
        return
    stop_at = args.steps // 2 + 1
    stopped_dir = prepare(work / "stopped", hp)
    stopped = launch(stopped_dir, nproc, env, args.run_timeout, stop_at=stop_at)
    row.stop_s = stopped.stop_s if stopped.stop_s is not None else math.nan
    found = checkpoints.list_checkpoints(stopped_dir / "checkpoints")
    row.stopped_at = found[-1][0] if found else None
    if stopped.code != EXIT_STOPPED or row.stopped_at is None or row.stopped_at < stop_at:
        row.error = (f"SIGTERM at step {stop_at}: exit {stopped.code} (want {EXIT_STOPPED}), newest complete "
                     f"checkpoint {row.stopped_at} (want >= {stop_at}):\n{stopped.tail()}")  # fmt: skip
        return
    resumed = launch(stopped_dir, nproc, env, args.run_timeout)
    if resumed.code != 0 or resumed.resumed_at != row.stopped_at:
        row.error = f"resumed run exited {resumed.code}, resumed at {resumed.resumed_at}:\n{resumed.tail()}"
        return
    compare(row, args, full, {**stopped.losses, **resumed.losses}, work)


def compare(row: Row, args: argparse.Namespace, full: Run, pieced: dict[int, float], work: Path) -> None:
    steps = sorted(full.losses)
    if sorted(pieced) != steps:
        row.checks.append(f"steps logged: uninterrupted {steps}, stopped + resumed {sorted(pieced)}")
        return
    row.loss_diff = max(abs(pieced[s] - full.losses[s]) / max(abs(full.losses[s]), 1e-12) for s in steps)
    saved = saved_weights(row.family, row.method)
    row.weight_diff = weight_difference(work / "uninterrupted" / "model" / saved, work / "stopped" / "model" / saved)
    if not row.loss_diff <= args.loss_tolerance:
        worst = max(steps, key=lambda s: abs(pieced[s] - full.losses[s]))
        row.checks.append(f"step losses differ by {row.loss_diff:.2e} (step {worst}: {full.losses[worst]:.6f} "
                          f"uninterrupted, {pieced[worst]:.6f} stopped+resumed)")  # fmt: skip
    if not row.weight_diff <= args.weight_tolerance:
        row.checks.append(f"saved {saved} differs by {row.weight_diff:.2e} (relative L2) from the uninterrupted run's")


def saved_weights(family: str, method: str) -> str:
    """What a row compares, relative to the saved model: the adapter file (LoRA) or the denoiser's folder."""
    if method == "lora":
        return lora.LORA_WEIGHTS
    return "transformer" if family == "sd3" else "unet"


# --- the whole acceptance -----------------------------------------------------------------

KERNEL_PROBE = """
import time
started = time.perf_counter()
from colossalai.kernel.kernel_loader import CPUAdamLoader, FusedOptimizerLoader
CPUAdamLoader().load()
FusedOptimizerLoader().load()
print(f"{time.perf_counter() - started:.1f}")
"""


def kernel_load_seconds() -> tuple[float, str | None]:
    """Seconds for Colossal-AI's Adam kernels (HybridAdam's) to load in a fresh process: a
    prebuilt kernel's import, or the JIT build the first time on a machine without one."""
    done = subprocess.run([sys.executable, "-c", KERNEL_PROBE], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return math.nan, (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return float(done.stdout.strip().splitlines()[-1]), None


def environment_line(nproc: int, cuda: bool, backend: str = "colossalai") -> str:
    import importlib

    import diffusers
    import torch

    device = f"{nproc} x {torch.cuda.get_device_name()}" if cuda else f"{nproc} CPU processes"
    stack = importlib.import_module(backend)  # colossalai or accelerate: the backend's own library
    return (
        f"backend {backend}: torch {torch.__version__} (CUDA {torch.version.cuda}), {backend} {stack.__version__}, "
        f"diffusers {diffusers.__version__}; {device}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--quick" in argv:  # a plan of rows, each one run of this script (acceptance_quick.py)
        from acceptance_quick import main as quick

        return quick([a for a in argv if a != "--quick"])
    args = parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    if not args.tiny and (reason := cuda_missing_reason()):
        print(reason, file=sys.stderr)
        return EXIT_NO_CUDA
    nproc = args.nproc or (torch.cuda.device_count() if cuda else 1)
    print(environment_line(nproc, cuda, args.backend), flush=True)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="sdflow-acceptance-"))
    started = time.perf_counter()
    kernels: list[tuple[float, str | None]] = []  # built beside the inputs: both take minutes
    colossalai = args.backend == "colossalai"  # the other backend's optimizer is torch's AdamW: no kernels
    skipped = (math.nan, "no CUDA" if colossalai else None)
    probe = threading.Thread(target=lambda: kernels.append(kernel_load_seconds() if cuda and colossalai else skipped))
    probe.start()
    base, resolution = build_base(work / "base", args.family, args.tiny, args.variant)
    resolution = args.resolution or resolution
    shards = write_shards(work / "dataset", resolution)
    print(f"inputs: base model and shards in {time.perf_counter() - started:.0f} s under {work}", flush=True)
    probe.join()
    (kernel_s, kernel_error), rows = kernels[0], []
    if colossalai:
        print(f"Colossal-AI Adam kernels: {kernel_s:.1f} s{'' if kernel_error is None else ', ' + kernel_error}",
              flush=True)  # fmt: skip
    with local_s3(shards) if args.data == "s3" else in_folder(shards) as (data_dir, env):
        for precision in args.precisions:  # every plugin in one precision first: the likelier to fit a budget
            for plugin in args.plugins:
                ema = uses_ema(args.family, args.method, plugin)
                row = Row(plugin, precision, nproc, args.batch_size, args.steps, ema, family=args.family,
                          method=args.method, backend=args.backend)  # fmt: skip
                hp = hyperparameters(args, plugin, precision, base, data_dir, resolution)
                if args.budget_s and time.perf_counter() - started > args.budget_s:
                    row.error = f"not run: --budget-s {args.budget_s} spent"
                else:
                    try:
                        run_row(row, args, work / f"{args.family}-{args.method}-{plugin}-{precision}", hp, env)
                    except Exception as exc:  # a row's own failure: report it, go on with the others
                        row.error = f"{type(exc).__name__}: {exc}"
                rows.append(row)
                print(report([row], kernel_s, kernel_error).splitlines()[-1], flush=True)
                if row.error and not row.error.startswith("not run"):
                    print(row.error, flush=True)
                if args.json:
                    args.json.write_text(json.dumps({"kernel_load_s": kernel_s, "kernel_error": kernel_error,
                                                     "rows": [asdict(r) for r in rows]}, indent=2))  # fmt: skip
    print(report(rows, kernel_s, kernel_error), flush=True)
    return 0 if rows and all(r.ok for r in rows) and (kernel_error is None or not cuda) else 1


if __name__ == "__main__":
    sys.exit(main())
