"""docs/notebooks/sdk-quickstart.ipynb, top to bottom, in the notebook venv (.venv-sdk: the
SageMaker Python SDK v3 and sdflow.sdk) against a fresh local cloud with the tiny model, given
nothing but the environment `sdflow local up` prints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from sdflow.local.cloud import LocalCloud

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.longest]

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "docs" / "notebooks" / "sdk-quickstart.ipynb"
JUPYTER_EXECUTE = ROOT / ".venv-sdk" / "bin" / "jupyter-execute"
PNG = b"\x89PNG\r\n\x1a\n"


def _cell_text(cell: dict[str, Any]) -> str:
    """Everything a code cell showed: streams, results and errors."""
    parts: list[str] = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            parts.append("".join(output.get("text", "")))
        elif "data" in output:
            parts.append("".join(output["data"].get("text/plain", "")))
        elif output.get("output_type") == "error":
            parts.append(f"{output.get('ename')}: {output.get('evalue')}")
    return "".join(parts)


def _cell_showing(cells: list[dict[str, Any]], source_marker: str) -> str:
    [cell] = [c for c in cells if c["cell_type"] == "code" and source_marker in "".join(c["source"])]
    return _cell_text(cell)


@pytest.mark.timeout(1800)
def test_sdk_notebook_local_cloud_runs_top_to_bottom_with_job_logs_and_images(tmp_path: Path) -> None:
    assert JUPYTER_EXECUTE.exists(), "the notebook venv is missing: `make setup` builds .venv-sdk"
    folder = tmp_path / "notebook"
    folder.mkdir()
    # The kernel runs in the notebook's folder (nbclient), so a copy runs: what it writes stays here.
    notebook = folder / NOTEBOOK.name
    shutil.copyfile(NOTEBOOK, notebook)
    executed = tmp_path / "executed.ipynb"
    with LocalCloud(tmp_path / "cloud", port=0) as cloud:
        # Only what `sdflow local up` prints: no AWS profile or key of the machine leaks in.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SAGEMAKER_"))}
        env.update(cloud.cli_env(), JUPYTER_PLATFORM_DIRS="1")
        started = time.monotonic()
        done = subprocess.run(
            [str(JUPYTER_EXECUTE), str(notebook), "--output", str(executed), "--timeout", "1500"],
            cwd=folder, env=env, capture_output=True, text=True, timeout=1700, check=False,
        )  # fmt: skip
        took = time.monotonic() - started
        print(f"notebook {NOTEBOOK.name} ran in {took:.1f} s; executed copy: {executed}")
        assert done.returncode == 0, done.stderr[-6000:]

        cells = json.loads(executed.read_text())["cells"]
        sagemaker = cloud.client("sagemaker")
        # The SDK's endpoint was deleted by the notebook; the pipeline's keeps serving.
        with pytest.raises(ClientError, match="Could not find endpoint"):
            sagemaker.describe_endpoint(EndpointName="notebook-try")
        assert sagemaker.describe_endpoint(EndpointName="sdflow-notebook")["EndpointStatus"] == "InService"
        sdk_jobs = sagemaker.list_training_jobs(NameContains="notebook-try")["TrainingJobSummaries"]

    assert "SUCCEEDED" in _cell_showing(cells, "summary = run.wait()")
    training = _cell_showing(cells, "trainer.train(")
    # The container's own lines, streamed back from CloudWatch Logs by the SDK while the job ran.
    assert "training: plugin=torch_ddp world_size=1 device=cpu" in training
    assert "Completed" in training
    assert [job["TrainingJobStatus"] for job in sdk_jobs] == ["Completed"]
    processing = _cell_showing(cells, "processor.run(")
    assert "sdflow.download INFO done:" in processing
    assert "'_SUCCESS'" in processing
    for image in ("pipeline-endpoint.png", "sdk-endpoint.png"):
        assert (folder / image).read_bytes().startswith(PNG), image
