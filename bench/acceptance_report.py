"""gpu_acceptance's table: one line per row (plugin x precision), its status after it."""

from __future__ import annotations

from typing import Any

COLUMNS = (  # (title, width)
    ("family", -7), ("method", -7),
    ("plugin", -15), ("precision", -10), ("GPUs", 5), ("batch", 6), ("steps", 6), ("EMA", 5), ("samples/s/GPU", 14),
    ("peak GiB", 9), ("ckpt s", 8), ("stop s", 8), ("stop@", 6), ("loss diff", 10), ("weight diff", 12),
)  # fmt: skip


def _cells(r: Any) -> list[str]:
    stopped = "-" if r.stopped_at is None else str(r.stopped_at)
    return [r.family, r.method,
            r.plugin, r.precision, str(r.gpus), str(r.batch_per_gpu), str(r.steps), "on" if r.ema else "off",
            f"{r.samples_per_s_per_gpu:.2f}", f"{r.peak_gpu_gib:.2f}", f"{r.checkpoint_s:.1f}", f"{r.stop_s:.1f}",
            stopped, f"{r.loss_diff:.1e}", f"{r.weight_diff:.1e}"]  # fmt: skip


def _line(cells: list[str], status: str) -> str:
    text = "".join(cell.ljust(-w) if w < 0 else cell.rjust(w) for cell, (_, w) in zip(cells, COLUMNS, strict=True))
    return f"{text}  {status}"


def report(rows: list[Any], kernel_s: float, kernel_error: str | None) -> str:
    kernels = f"{kernel_s:.1f} s" if kernel_error is None else f"FAILED: {kernel_error}"
    if rows and rows[0].backend != "colossalai":
        kernels = f"not used (backend={rows[0].backend})"
    header = _line([title for title, _ in COLUMNS], "status")
    lines = [f"Colossal-AI Adam kernels load: {kernels}", header, "-" * len(header)]
    for r in rows:
        status = "ok" if r.ok else "FAILED: " + (r.error or "; ".join(r.checks)).splitlines()[0]
        lines.append(_line(_cells(r), status))
    return "\n".join(lines)
