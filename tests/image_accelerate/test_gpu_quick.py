"""bench/gpu_acceptance.py --quick where no GPU is: every row's arguments pass the acceptance's own parser
and the image's rules, a row whose stack is missing says so instead of passing, the budget holds, and a
real row runs on the tiny model (--tiny) and comes back in the table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.image

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "gpu_acceptance.py"


@pytest.mark.parametrize("tiny", [False, True])
def test_quick_plan_rows_arguments_pass_the_acceptance_parser(
    quick_bench: ModuleType, acceptance_bench: ModuleType, tiny: bool
) -> None:
    acceptance = acceptance_bench
    plans = quick_bench.plans(tiny)
    assert [p.name for p in plans] == ["flux2-lora-ddp", "sd35-full-fsdp2", "sd15-llz-resume"]
    for plan in plans:
        args = acceptance.parse_args(plan.argv)  # exits 2 on an argument or a rule the image refuses
        assert args.steps == quick_bench.QUICK_STEPS
        assert args.data == "folder"
    flux, sd35, sd15 = (acceptance.parse_args(p.argv) for p in plans)
    assert (flux.family, flux.method, flux.plugins, flux.no_stop) == ("flux2", "lora", ["ddp"], False)
    assert (sd35.family, sd35.method, sd35.plugins, sd35.no_stop) == ("sd35", "full", ["fsdp2"], True)
    assert (sd15.family, sd15.plugins, sd15.backend) == ("sd", ["low_level_zero"], "colossalai")
    if not tiny:
        assert (flux.variant, sd35.variant, flux.resolution) == ("flux2-klein-4b", "sd35-medium", 512)


def test_quick_colossalai_row_without_its_stack_is_not_run_and_says_why(
    quick_bench: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("SDFLOW_COLOSSALAI_PYTHON", raising=False)
    sd15 = quick_bench.plans(True)[-1]  # this venv has no colossalai
    row = quick_bench.run_plan(sd15, tmp_path, 60)
    assert row.status == "not run"
    assert "Colossal-AI" in row.detail
    table = quick_bench.table([row])
    assert "0 of 0 rows that ran held; 1 not run" in table


def test_quick_without_cuda_exits_2_unless_tiny(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--budget-s", "30"],
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "a CUDA device is needed" in done.stderr


def test_quick_tiny_sd35_fsdp2_row_runs_and_reports_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "quick.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--tiny", "--only", "sd35-full-fsdp2", "--work-dir",
         str(tmp_path / "work"), "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"driver", "sd35-full-fsdp2"}
    sd35 = rows["sd35-full-fsdp2"]
    assert sd35["status"] == "ok", sd35
    assert sd35["figures"]["final_loss"] > 0
    assert "2 of 2 rows that ran held; 0 not run" in done.stdout
