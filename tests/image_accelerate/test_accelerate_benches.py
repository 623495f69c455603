"""The second stack's bench (bench/trace_memory.py, on .venv-accelerate) runs at a tiny size, so it cannot rot:
one row through its command line, the published model on the meta device at a small resolution."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_trace_memory_one_small_row_prints_the_table_and_writes_json(tmp_path: Path) -> None:
    rows = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "trace_memory.py"), "--variants", "sd35-medium", "--methods", "lora",
         "--plugins", "ddp", "--gpus", "1", "--resolution", "64", "--json", str(rows)],
        capture_output=True, text=True, timeout=600, cwd=REPO, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| sd35-medium | lora | ddp | 1 |" in done.stdout
    [row] = json.loads(rows.read_text(encoding="utf-8"))
    assert row["traced_gib"] > 0
    assert row["estimated_gib"] > 0
