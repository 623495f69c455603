"""template.yaml through the tools a deploy runs: cfn-lint, `sam validate --lint`, `sam build`
(without Docker) and checkov against its reasoned baseline (security/checkov-baseline.json)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "template.yaml"
TOOLS = ROOT / ".tools"


def _tool(venv: str, binary: str) -> Path:
    path = TOOLS / venv / "bin" / binary
    assert path.exists(), f"{path} is missing: run `make setup` (it installs requirements/tools-{venv}.txt)"
    return path


def _offline_env(tmp_path: Path) -> dict[str, str]:
    """The SAM CLI phones home for telemetry and version checks; only 127.0.0.1 may be reached."""
    env = dict(os.environ)
    env.update(
        {
            "SAM_CLI_TELEMETRY": "0",
            "__SAM_CLI_APP_DIR": str(tmp_path / "samhome"),
            "HTTPS_PROXY": "http://127.0.0.1:9",
            "HTTP_PROXY": "http://127.0.0.1:9",
            "NO_PROXY": "127.0.0.1,localhost",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": str(tmp_path / "none.cfg"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none.creds"),
            "BC_SKIP_MAPPING": "TRUE",
            "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false",
        }
    )
    return env


@pytest.mark.lint
def test_template_cfn_lint_reports_nothing() -> None:
    result = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "cfn-lint"), str(TEMPLATE)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.lint
@pytest.mark.slow
def test_template_sam_validate_lint_passes(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(_tool("sam", "sam")), "validate", "--lint", "-t", str(TEMPLATE)],
        capture_output=True,
        text=True,
        env=_offline_env(tmp_path),
        cwd=ROOT,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "is a valid SAM Template" in result.stdout + result.stderr


@pytest.mark.lint
@pytest.mark.slow
def test_template_checkov_fails_only_baselined_checks(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            str(_tool("checkov", "checkov")),
            "-f",
            str(TEMPLATE),
            "--framework",
            "cloudformation",
            "-o",
            "json",
            "--quiet",
            "--skip-download",
        ],
        capture_output=True,
        text=True,
        env=_offline_env(tmp_path),
        cwd=ROOT,
        check=False,
        timeout=600,
    )
    report = json.loads(result.stdout)
    failed = {(f["check_id"], f["resource"]) for f in report["results"]["failed_checks"]}
    baseline = json.loads((ROOT / "security" / "checkov-baseline.json").read_text())["accepted"]
    accepted = {(entry["check"], resource) for entry in baseline for resource in entry["resources"]}
    for entry in baseline:
        assert len(entry["reason"]) > 30, f"{entry['check']} needs a real reason"
    assert failed - accepted == set(), "new checkov failures: fix them or baseline them with a reason"
    assert accepted - failed == set(), "baselined checks that pass now: remove them from the baseline"
    assert report["summary"]["passed"] > 0


@pytest.mark.lint
@pytest.mark.slow
def test_template_sam_build_without_docker_packages_layer_and_handlers(tmp_path: Path) -> None:
    # Building needs PyPI (the layer's pinned requirements), so the proxy of _offline_env is dropped.
    env = {k: v for k, v in _offline_env(tmp_path).items() if "PROXY" not in k.upper()}
    build_dir = tmp_path / "build"
    result = subprocess.run(
        [str(_tool("sam", "sam")), "build", "--build-dir", str(build_dir), "-t", str(TEMPLATE)],
        capture_output=True, text=True, env=env, cwd=ROOT, check=False, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    layer = build_dir / "CommonLayer" / "python"
    assert (layer / "sdflow_common" / "run_document.py").exists()
    assert (layer / "aws_lambda_powertools").is_dir()
    for function in ("StartPipelineFunction", "JobEventsFunction", "NotifyFunction"):
        assert (build_dir / function / "app.py").exists(), function
