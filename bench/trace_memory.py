"""Peak GPU memory per GPU of each family x method x plugin, traced on fake tensors (bench/memory_trace.py)
beside the memory estimate (sdflow_common.memory_estimate), on a CPU, without weights.

    .venv-accelerate/bin/python bench/trace_memory.py                      # the whole table, 8 GPUs
    .venv-accelerate/bin/python bench/trace_memory.py --variants flux2-klein-9b --plugins fsdp2 --accumulation 2

Each row builds the published model on the meta device and traces one step (about a minute of CPU for
the largest); `--json` also writes the rows for the README's table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT / "training_image", ROOT / "layers" / "common", ROOT):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench import memory_trace  # noqa: E402
from sdflow_common import memory_estimate  # noqa: E402

# The rows the pipeline accepts: LoRA under fsdp2 is refused (an adapter gains nothing from sharding).
ROWS = (("full", "fsdp2"), ("full", "ddp"), ("lora", "ddp"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=list(memory_trace.ESTIMATE_NAMES))
    parser.add_argument("--methods", nargs="+", default=list(memory_trace.METHODS))
    parser.add_argument("--plugins", nargs="+", default=list(memory_trace.PLUGINS))
    parser.add_argument("--gpus", type=int, default=8, help="every GPU of the job (FSDP2 shards across them)")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--without-t5", action="store_true", help="SD 3.5 without its T5-XXL encoder")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args(argv)
    rows = [
        memory_trace.Row(
            variant, method, plugin, gpus=args.gpus, batch=args.batch, resolution=args.resolution,
            accumulation=args.accumulation, gradient_checkpointing=args.gradient_checkpointing,
            with_t5=not args.without_t5,
        )
        for variant in args.variants
        for method, plugin in ROWS
        if method in args.methods and plugin in args.plugins
    ]  # fmt: skip
    print("| model | method | plugin | GPUs | estimated GiB | traced GiB | estimate / trace | trace s (CPU s) |")
    print("|---|---|---|---|---|---|---|---|")
    out = []
    for row in rows:
        traced = memory_trace.trace(row)
        estimated = memory_estimate.estimate(memory_trace.estimate_setup(row)).total_gib
        print(
            f"| {row.variant} | {row.method} | {row.plugin} | {row.gpus} | {estimated:.1f} | {traced.peak_gib:.1f} | "
            f"{estimated / traced.peak_gib:.2f} | {traced.seconds:.0f} ({traced.cpu_seconds:.0f}) |",
            flush=True,
        )
        parts = {name: round(value / memory_trace.GIB, 2) for name, value in traced.parts.items()}
        figures = {"estimated_gib": estimated, "traced_gib": traced.peak_gib, "parts_gib": parts}
        timing = {"trained": traced.trained, "seconds": traced.seconds, "cpu_seconds": traced.cpu_seconds}
        out.append({**row.__dict__, **figures, **timing})
        if args.json:
            args.json.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
