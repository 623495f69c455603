"""`sdflow plan` against the local cloud: the stack's own Validate run settings, the same checks, nothing written;
exit 0 for a run that would start, 2 for one that would be refused."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from sdflow.session import write_state
from tests.e2e.clouds import CloudSpec, NoOpCloud
from tests.e2e.commands import SDFLOW

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CLOUD = CloudSpec(dataset="plan", shards=2, prewarm=False)


def _plan(workdir: Path, manifest: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "AWS_ENDPOINT_URL"}
    command = [*SDFLOW, "--workdir", str(workdir), "plan", str(manifest), *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, check=False)


def _document(noop: NoOpCloud, **sections: Any) -> dict[str, Any]:
    base = {"training": {"instance_type": "ml.g5.2xlarge"}, "endpoint": {"name": "sdflow-plan"}}
    return noop.document(**(base | sections))


def test_cli_plan_on_the_local_cloud_says_what_validate_run_would_decide_and_writes_nothing(
    noop: NoOpCloud, tmp_path: Path
) -> None:
    write_state(tmp_path, noop.cloud)  # what `sdflow local up` writes for other processes
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(_document(noop)))
    bad.write_text(json.dumps(_document(noop, endpoint={"name": "sdflow-plan", "instance_type": "ml.c5.3xlarge"})))

    started = _plan(tmp_path, good, "--json")
    text = _plan(tmp_path, good, "--name", "my(run)!")
    refused = _plan(tmp_path, bad)

    assert started.returncode == 0, started.stderr
    plan = json.loads(started.stdout)
    assert (plan["family"], plan["shards"]) == ("sd", 2)
    assert plan["execution_name"].startswith("good-")
    assert {item["operation"] for item in plan["requests"]} >= {"CreateTrainingJob", "CreateModelPackage"}
    assert text.returncode == 0, text.stderr
    assert "Validate run would start run my(run)!" in text.stdout
    assert "sdf-tr-my-run-" in text.stdout
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "endpoint.instance_type: the endpoint config's CreateEndpointConfig would be refused" in refused.stdout
    s3 = noop.cloud.client("s3")
    assert s3.list_objects_v2(Bucket=noop.cloud.bucket, Prefix="runs/").get("KeyCount") == 0
