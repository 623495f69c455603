"""`bench/gpu_acceptance.py --quick`: the rows that settle the most within ten minutes on one GPU,
set-up included, as one command whose table comes back.

    bash bench/gpu_quick.sh                              # the lent GPU machine: carried wheels, then this plan
    python bench/gpu_acceptance.py --quick --budget-s 540 --json quick.json
    .venv-accelerate/bin/python bench/gpu_acceptance.py --quick --tiny   # CPU: the same plan on tiny models

Rows, in the order they run (what each settles that no CPU test can):
1. **driver**: what a job's container sees: the driver, torch's CUDA, the GPU, its compute capability
   and bf16, and `sdflow_image.gpu_check`'s verdict (the check every entrypoint runs first).
2. **flux2-lora-ddp**: FLUX.2 [klein] 4B's size, LoRA on ddp in bf16, stopped by SIGTERM halfway and
   resumed: the losses and the adapter must equal the uninterrupted run's. At full size it shows
   the frozen base loaded in bf16 before it reaches the GPU (a 4B transformer and a 4B text encoder).
3. **sd35-full-fsdp2**: SD 3.5 Medium's size, full on FSDP2 with one GPU, bf16, one uninterrupted
   run: its peak GPU memory beside the estimate (`sdflow_common.memory_estimate`) and the
   fake-tensor trace of the same setup (`bench/trace_memory.py`, run on the CPU from the start,
   beside the GPU rows).
4. **sd15-llz-resume**: SD 1.5's size on Colossal-AI's low_level_zero, bf16, stopped and resumed
   exactly. It needs the first stack (torch 2.5.1, Colossal-AI 0.5.0): run with that stack's Python,
   or name it in SDFLOW_COLOSSALAI_PYTHON; where neither has Colossal-AI the row says "not run" and
   why (the lent machine's image has torch 2.11 and no Colossal-AI, and torch cannot travel as wheels
   within the 64 MiB a call carries).

Each training row is one run of bench/gpu_acceptance.py in a process of its own (its JSON read back),
at 512 px, batch 1 (2 for SD 1.5), 4 steps, shards in a folder: minutes of loading and saving
multi-GB models, seconds of training. A row starts only while the budget (--budget-s) has room for it.

Exit status: 0 when every row that ran held (rows not run are listed with why); 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent / "gpu_acceptance.py"
QUICK_RESOLUTION = 512
QUICK_STEPS = 4  # gpu_acceptance's least: a checkpoint halfway, a stop after it


@dataclass
class QuickRow:
    name: str
    what: str
    status: str = "not run"  # ok | FAILED | not run
    seconds: float = math.nan
    figures: dict[str, Any] = field(default_factory=dict)
    detail: str = ""


@dataclass(frozen=True)
class Plan:
    """One training row: gpu_acceptance's arguments, its Python, the seconds it may take."""

    name: str
    what: str
    argv: list[str]
    timeout_s: int
    python: str | None = sys.executable  # None: no Python has its stack (needs says why)
    needs: str | None = None  # why it cannot run here, when it cannot


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/gpu_acceptance.py --quick", description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU: checks the plan itself")
    parser.add_argument("--budget-s", type=int, default=540, help="start no row past this many seconds (default 540)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where models and runs go (default: temp)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here as JSON")
    parser.add_argument("--only", default=None, help="comma-separated row names to run (default: every row)")
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error("argument --budget-s: must be > 0")
    return args


def colossalai_python() -> tuple[str | None, str | None]:
    """The Python with Colossal-AI for the SD 1.5 row, or None and why not."""
    if importlib.util.find_spec("colossalai") is not None:
        return sys.executable, None
    other = os.environ.get("SDFLOW_COLOSSALAI_PYTHON")
    if other and (Path(other).is_file() or shutil.which(other)):
        return other, None
    return None, (
        "needs the Colossal-AI stack (torch 2.5.1, colossalai 0.5.0): this Python has no colossalai and "
        "SDFLOW_COLOSSALAI_PYTHON names no other"
    )


def plans(tiny: bool) -> list[Plan]:
    common = ["--steps", str(QUICK_STEPS), "--data", "folder", "--nproc", "1", "--precisions", "bf16"]
    size = ["--tiny"] if tiny else ["--resolution", str(QUICK_RESOLUTION)]
    flux = ["--backend", "accelerate", "--family", "flux2", "--method", "lora", "--batch-size", "1"]
    sd35 = ["--backend", "accelerate", "--family", "sd35", "--method", "full", "--plugins", "fsdp2",
            "--batch-size", "1", "--no-stop"]  # fmt: skip
    if not tiny:
        flux += ["--variant", "flux2-klein-4b"]
        sd35 += ["--variant", "sd35-medium"]
    python, why_not = colossalai_python()
    sd15 = ["--family", "sd", "--method", "full", "--plugins", "low_level_zero", "--batch-size", "2"]
    return [
        Plan("flux2-lora-ddp", "FLUX.2 [klein] 4B LoRA, ddp: stop -> resume exact", [*flux, *common, *size], 300),
        Plan("sd35-full-fsdp2", "SD 3.5 Medium full, fsdp2, 1 GPU: peak vs estimate", [*sd35, *common, *size], 240),
        Plan(
            "sd15-llz-resume",
            "SD 1.5 low_level_zero: stop -> resume exact",
            [*sd15, *common, *size],
            300,
            python=python,
            needs=why_not,
        ),
    ]


def driver_row(tiny: bool) -> QuickRow:
    """What the container sees of the GPU, and the entrypoints' own check."""
    import torch

    row = QuickRow("driver", "driver, CUDA, GPU, compute capability, gpu_check")
    started = time.perf_counter()
    figures: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    smi = shutil.which("nvidia-smi")
    if smi:
        query = [smi, "--query-gpu=driver_version,name,compute_cap,memory.total", "--format=csv,noheader"]
        done = subprocess.run(query, capture_output=True, text=True, timeout=60)
        figures["nvidia_smi"] = done.stdout.strip() or done.stderr.strip()
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        figures |= {"gpu": torch.cuda.get_device_name(), "compute_capability": f"{major}.{minor}",
                    "bf16": torch.cuda.is_bf16_supported()}  # fmt: skip
    verdict = gpu_check_verdict()
    figures["gpu_check"] = verdict
    row.figures, row.seconds = figures, time.perf_counter() - started
    if torch.cuda.is_available() and verdict.startswith("ok"):
        row.status = "ok"
    elif tiny and not torch.cuda.is_available():
        row.status, row.detail = "ok", "no GPU: a CPU run of the plan (--tiny)"
    else:
        row.status, row.detail = "FAILED", verdict
    return row


def gpu_check_verdict() -> str:
    """sdflow_image.gpu_check's verdict, as the entrypoints reach it (without cuda-compat's restart)."""
    sys.path.insert(0, str(REPO / "training_image"))
    from sdflow_image import gpu_check

    found = gpu_check.problem()
    seen = f"GPUs seen {gpu_check.visible_gpus() or 'none'}, driver {gpu_check.host_driver() or 'none'}"
    return f"ok ({seen})" if found is None else f"refused: {found}"


def run_plan(plan: Plan, work: Path, timeout_s: int) -> QuickRow:
    row = QuickRow(plan.name, plan.what)
    if plan.needs or plan.python is None:
        row.detail = plan.needs or "no Python for it"
        return row
    out = work / f"{plan.name}.json"
    command = [plan.python, str(BENCH), *plan.argv, "--work-dir", str(work / plan.name), "--json", str(out),
               "--run-timeout", str(timeout_s)]  # fmt: skip
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        row.status, row.detail, row.seconds = "FAILED", f"past its {timeout_s} s", time.perf_counter() - started
        return row
    row.seconds = time.perf_counter() - started
    for bulky in ("base", "dataset"):  # multi-GB models: the disk is 64 GB; the runs' logs stay
        shutil.rmtree(work / plan.name / bulky, ignore_errors=True)
    rows = json.loads(out.read_text())["rows"] if out.is_file() else []
    if not rows:
        row.status, row.detail = "FAILED", "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        return row
    result = rows[0]
    keep = ("samples_per_s_per_gpu", "peak_gpu_gib", "checkpoint_s", "stop_s", "stopped_at", "loss_diff",
            "weight_diff", "final_loss")  # fmt: skip
    row.figures = {k: result[k] for k in keep if k in result}
    failed = result.get("error") or "; ".join(result.get("checks") or [])
    row.status = "FAILED" if failed or done.returncode != 0 else "ok"
    lines = (failed or "").splitlines()
    row.detail = "\n".join(lines[:1] + lines[-4:]) if len(lines) > 5 else "\n".join(lines)
    return row


TRACE_ARGS = ["--variants", "sd35-medium", "--methods", "full", "--plugins", "fsdp2", "--gpus", "1", "--batch", "1",
              "--resolution", str(QUICK_RESOLUTION), "--without-t5"]  # fmt: skip


def start_trace(work: Path) -> subprocess.Popen[str]:
    """The SD 3.5 Medium row's fake-tensor trace (bench/trace_memory.py), on the CPU beside the GPU rows."""
    script = Path(__file__).resolve().parent / "trace_memory.py"
    command = [sys.executable, str(script), *TRACE_ARGS, "--json", str(work / "trace.json")]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def memory_figures(trace: subprocess.Popen[str] | None, work: Path, timeout_s: float) -> dict[str, Any]:
    """The SD 3.5 Medium row's setup as the estimate and the trace see it (GiB per GPU)."""
    if trace is None:
        return {"estimate_gib": "n/a (tiny model)", "trace_gib": "n/a (tiny model)"}
    try:
        output, _ = trace.communicate(timeout=max(timeout_s, 1))
    except subprocess.TimeoutExpired:
        trace.kill()
        output = "past its time"
    rows = json.loads((work / "trace.json").read_text()) if (work / "trace.json").is_file() else []
    if not rows:
        tail = output.strip().splitlines()[-1:] if output else []
        return {"estimate_gib": "?", "trace_gib": f"failed: {' '.join(tail)[:200]}"}
    return {"estimate_gib": round(rows[0]["estimated_gib"], 2), "trace_gib": round(rows[0]["traced_gib"], 2)}


def table(rows: list[QuickRow]) -> str:
    lines = [f"{'row':<17}{'status':<9}{'s':>7}  figures"]
    lines.append("-" * 100)
    for r in rows:
        figures = ", ".join(f"{k}={_fmt(v)}" for k, v in r.figures.items())
        lines.append(f"{r.name:<17}{r.status:<9}{r.seconds:>7.0f}  {figures}")
        lines.extend(f"{'':<33}{line}" for line in r.detail.splitlines())
    ran = [r for r in rows if r.status != "not run"]
    held = sum(r.status == "ok" for r in ran)
    lines.append(f"{held} of {len(ran)} rows that ran held; {len(rows) - len(ran)} not run")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not args.tiny and not torch.cuda.is_available():
        print("gpu_acceptance --quick: a CUDA device is needed (--tiny runs the plan on a CPU)", file=sys.stderr)
        return 2
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="sdflow-quick-"))
    work.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    started = time.perf_counter()
    wanted = only is None or "sd35-full-fsdp2" in only
    trace = start_trace(work) if wanted and not args.tiny else None  # CPU work: beside the GPU rows
    rows = [driver_row(args.tiny)]
    print(table(rows).splitlines()[2], flush=True)
    for plan in plans(args.tiny):
        if only is not None and plan.name not in only:
            continue
        left = args.budget_s - (time.perf_counter() - started)
        if left < 60:
            rows.append(QuickRow(plan.name, plan.what, detail=f"--budget-s {args.budget_s} spent"))
            continue
        row = run_plan(plan, work, int(min(plan.timeout_s, left)))
        if plan.name == "sd35-full-fsdp2" and row.status != "not run":
            left = args.budget_s - (time.perf_counter() - started)
            row.figures |= memory_figures(trace, work, left)
        rows.append(row)
        print(table([row]).splitlines()[2], flush=True)
    print(table(rows), flush=True)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0 if all(r.status != "FAILED" for r in rows) else 1
