"""The run console in a real browser: Debian's headless Chromium driven by Playwright, against a
local cloud whose SageMaker jobs are no-ops (the console, not the jobs' content, is under test).

Chromium comes from the `chromium` Debian package (.ci/run installs it); Playwright never
downloads a browser of its own. Each page kind is kept as a screenshot under the test's temporary
folder (its path is printed, to be looked at) and checked as a person would (console_looks.py):
the runs, a succeeded run with its training, evaluation and endpoint panels, a run failed in
validation, one whose job failed, then redriven, a stopped one, the Map's children."""

from __future__ import annotations

import io
import json
import os
import shutil
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sdflow.console.server import ConsoleConfig, ConsoleServer
from sdflow.local.cloud import LocalCloud
from sdflow.local.sagemaker.noop import NoOpSageMaker
from sdflow.session import Session
from sdflow_common.evaluation import EVALUATION_FILE
from sdflow_common.run_document import parse_s3_uri
from tests.constants import hold_for
from tests.e2e.clouds import CloudSpec, NoOpCloud
from tests.e2e.console_looks import durations_fixed, look, shoot
from tests.helpers import free_port, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHROMIUM = os.environ.get("SDFLOW_CHROMIUM", "/usr/bin/chromium")
# As the machine's notes advise for a closed network: no background connections, no first-run work.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
SHARDS = 3
# Long enough to see Train model running, in colour, before it succeeds.
TRAINING_HOLD_S = hold_for(6.0)
CONSOLE_PORT = free_port()
CLOUD = CloudSpec(
    dataset="console",
    shards=SHARDS,
    job_seconds=0.5,
    seconds_by_kind={"training": TRAINING_HOLD_S},
    parameters={"ConsoleUrl": f"http://127.0.0.1:{CONSOLE_PORT}/"},
)
WAIT_MS = 120_000


def _full_evaluation(sagemaker: NoOpSageMaker, request: dict[str, Any]) -> None:
    """evaluation.json as the real job writes it (48 prompts, each with its result), so that the
    Evaluation panel is seen with what it shows after a real run, not the no-op's four scores."""
    original(sagemaker, request)
    [output] = request["ProcessingOutputConfig"]["Outputs"]
    bucket, key = parse_s3_uri(output["S3Output"]["S3Uri"])
    colours = ("red", "green", "blue", "yellow")
    results = [
        {"prompt": f"a {colours[i % 4]} circle on a {colours[(i + 1) % 4]} background", "foreground": colours[i % 4],
         "background": colours[(i + 1) % 4] if i % 5 else "white", "shape": "circle" if i % 3 else "square",
         "foreground_ok": True,
         "background_ok": bool(i % 5), "shape_ok": i % 3 != 0}
        for i in range(48)
    ]  # fmt: skip
    document = {
        "prompt_adherence": 0.9, "base_prompt_adherence": 0.125, "prompts": 48, "foreground_accuracy": 1.0,
        "background_accuracy": 0.8, "shape_accuracy": 0.66, "base": {"foreground_accuracy": 0.25,
        "background_accuracy": 0.0, "shape_accuracy": 0.3}, "grid": "adherence.png",
        "settings": {"resolution": 32, "num_inference_steps": 4, "guidance_scale": 7.5, "seed": 0, "device": "cpu"},
        "results": results,
        # The held-out metrics (docs/contracts.md "The evaluation job"), FID missing, and their grid.
        "metrics": {"clip_score": {"base": 21.3, "trained": 27.9, "samples": 64},
                    "kid": {"base": 0.051, "trained": 0.012, "base_std": 0.004, "trained_std": 0.002, "samples": 64,
                            "subset_size": 64},
                    "prompt_adherence": {"base": 0.125, "trained": 0.9, "samples": 48}},
        "missing": [{"metric": "fid", "reason": "64 held-out samples, fewer than the 512 of the CLIP features"}],
        "holdout": {"samples": 64, "grid": HOLDOUT_GRID},
    }  # fmt: skip
    sagemaker._put(bucket, key.rstrip("/") + "/" + EVALUATION_FILE, json.dumps(document).encode())
    sagemaker._put(bucket, key.rstrip("/") + "/" + HOLDOUT_GRID, _png_of(3 * 32, 4 * 32))


original = NoOpSageMaker._evaluation_output
# What a download job since the filters counts in its _SUCCESS (docs/contracts.md "_SUCCESS"): 4 rows read,
# 3 dropped by the filters, the 1 left downloaded; the no-op job writes only its sample.
FILTER_COUNTS = {"rows_read": 4, "filter_drops": {"min_width": 2, "max_punsafe": 1}, "rows_to_download": 1,
                 "failed_to_download": 0, "failed_to_resize": 0}  # fmt: skip


def _counting_put(put: Callable[[str, str, bytes], None]) -> Callable[[str, str, bytes], None]:
    def put_with_counts(bucket: str, key: str, body: bytes) -> None:
        if key.endswith("/_SUCCESS"):
            body = json.dumps(json.loads(body) | FILTER_COUNTS).encode()
        put(bucket, key, body)

    return put_with_counts


HOLDOUT_GRID = "holdout.png"


def _png_of(width: int, height: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), "orange").save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def cloud(noop: NoOpCloud) -> LocalCloud:
    noop.cloud.console_port = CONSOLE_PORT  # type: ignore[attr-defined]
    noop.sagemaker._evaluation_output = types.MethodType(_full_evaluation, noop.sagemaker)  # type: ignore[method-assign]
    noop.sagemaker._put = _counting_put(noop.sagemaker._put)  # type: ignore[method-assign]
    return noop.cloud


@pytest.fixture
def report(capsys: pytest.CaptureFixture[str]) -> Callable[[str], None]:
    """Prints into the test output even when pytest captures it: the screenshots' paths."""

    def say(line: str) -> None:
        with capsys.disabled():
            print(f"\n{line}")

    return say


@pytest.fixture(scope="module")
def console(cloud: LocalCloud) -> Iterator[ConsoleServer]:
    with ConsoleServer(Session.for_cloud(cloud).console_config(), port=cloud.console_port) as server:  # type: ignore[attr-defined]
        yield server


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    assert shutil.which(CHROMIUM) or Path(CHROMIUM).exists(), (
        f"{CHROMIUM} is missing: install Debian's chromium package (`.ci/run` does: apt-get install chromium)"
    )
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Any, tmp_path: Path) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1500, "height": 1100})
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    yield opened
    context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


def _document(cloud: LocalCloud, endpoint: str) -> dict[str, Any]:
    return {
        "dataset": {"prefix": f"s3://{cloud.bucket}/datasets/console/"},
        "base_model_uri": f"s3://{cloud.bucket}/models/tiny/",
        "download": {"max_concurrency": SHARDS},
        "training": {"instance_type": "ml.m5.xlarge", "max_train_steps": 12},
        "endpoint": {"name": endpoint, "instance_type": "ml.m5.large"},
    }


def _state(page: Any, name: str) -> Any:
    return page.locator(f'g.state[data-state="{name}"]').first


def _fill(page: Any, name: str) -> str:
    return str(_state(page, name).locator("rect").first.evaluate("el => getComputedStyle(el).fill"))


def test_console_upload_run_graph_follows_states_to_success_with_details(
    cloud: LocalCloud, console: ConsoleServer, page: Any, tmp_path: Path, report: Callable[[str], None]
) -> None:
    page.goto(console.url)
    cloud.client("s3").put_object(
        Bucket=cloud.bucket,
        Key="manifests/console-ok.json",
        # A gate the evaluation passes, for the panel's gate checks.
        Body=json.dumps(_document(cloud, "sdflow-console") | {"evaluation": {"min_prompt_adherence": 0.5}}).encode(),
    )
    row = page.locator('[data-testid="run-row"]').first
    row.wait_for(timeout=WAIT_MS)
    name = row.get_attribute("data-run-name")
    assert name
    assert name.startswith("console-ok-")
    assert "upload" in row.inner_text()
    row.locator("a").first.click()
    page.locator('[data-testid="graph"] g.state').first.wait_for(timeout=WAIT_MS)

    # Live, without a reload: Train model is seen running (held), then succeeded, in other colours.
    page.wait_for_selector('g.state[data-state="Train model"][data-status="running"]', timeout=WAIT_MS)
    running_fill = _fill(page, "Train model")
    assert _state(page, "Deploy endpoint").get_attribute("data-status") == "not_reached"
    counts = page.locator('[data-testid="map-counts"][data-state="Download shards"]')
    assert counts.get_attribute("data-succeeded") == str(SHARDS)
    assert counts.get_attribute("data-total") == str(SHARDS)
    page.wait_for_selector('g.state[data-state="Deploy endpoint"][data-status="succeeded"]', timeout=WAIT_MS)
    assert _state(page, "Train model").get_attribute("data-status") == "succeeded"
    assert _fill(page, "Train model") != running_fill, "a finished state is drawn in another colour"

    # A state's input and output, as the AWS console shows them.
    _state(page, "Validate run").click()
    panel = page.locator('[data-testid="state-panel"][data-state="Validate run"]')
    panel.wait_for(timeout=WAIT_MS)
    output = page.locator('pre[data-testid="state-output"]')
    page.locator('[data-testid="tab-output"]').click()
    output.wait_for(state="visible", timeout=WAIT_MS)
    assert json.loads(output.inner_text())["config"]["run"]["endpoint"]["name"] == "sdflow-console"
    page.locator('[data-testid="tab-input"]').click()
    assert json.loads(page.locator('pre[data-testid="state-input"]').inner_text()) == {}

    # Training: the loss curve from the job's log, the sample grid from its output archive.
    page.wait_for_selector('svg[data-testid="loss-curve"]', timeout=WAIT_MS)
    assert int(page.locator('svg[data-testid="loss-curve"]').get_attribute("data-points") or 0) == 12
    samples_img = page.locator('img[data-testid="samples"]')
    samples_img.wait_for(timeout=WAIT_MS)
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=samples_img.element_handle())

    # The notification, with a link to this console rather than to the AWS console.
    note = page.locator('[data-testid="notification"]').first
    note.wait_for(timeout=WAIT_MS)
    assert f"127.0.0.1:{cloud.console_port}/#/runs/{name}" in note.inner_text()  # type: ignore[attr-defined]
    # The Distributed Map's inner states ran in its children: drawn from them, not "not reached".
    page.wait_for_selector('g.state[data-state="Download shard"][data-status="succeeded"]', timeout=WAIT_MS)
    assert _state(page, "Check shard cache").get_attribute("data-status") == "succeeded"
    assert f"{SHARDS} of {SHARDS} children" in (_state(page, "Download shard").text_content() or "")
    assert _state(page, "Reuse downloaded shard").get_attribute("data-status") == "not_reached"

    # Evaluation: the 48 prompts as rows in a bounded box, the scores next to their labels.
    rows = page.locator('[data-testid="result-row"]')
    rows.first.wait_for(timeout=WAIT_MS)
    assert rows.count() == 48
    assert page.locator('[data-testid="results"]').bounding_box()["height"] <= 400
    gaps = page.evaluate("""() => [...document.querySelectorAll('[data-testid=evaluation] table.kv tr')]
        .map(tr => tr.cells[1].getBoundingClientRect().left - tr.cells[0].getBoundingClientRect().left)""")
    assert gaps
    assert max(gaps) < 300, f"labels far from their values: {gaps}"
    page.locator('img[data-testid="adherence-grid"]').wait_for(timeout=WAIT_MS)
    # Each metric base → trained with its direction, the one not computed with its reason, the held-out grid.
    metric_rows = page.locator('[data-testid="metric-row"]')
    assert metric_rows.count() == 3
    kid = page.locator('[data-testid="metric-row"][data-metric="kid"]').inner_text()
    assert "kid ↓" in kid
    assert "0.0510 ± 0.0040" in kid
    assert "0.0120 ± 0.0020" in kid
    assert "fid: 64 held-out samples" in page.locator('[data-testid="missing-metric"]').inner_text()
    check = page.locator('[data-testid="gate-check"]')
    assert check.count() == 1
    assert check.inner_text() == "✓ prompt_adherence (trained ≥ 0.5): base 0.12 → trained 0.90"
    holdout_img = page.locator('img[data-testid="holdout-grid"]')
    holdout_img.wait_for(timeout=WAIT_MS)
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=holdout_img.element_handle())
    # The dataset panel: what was kept of the rows read and why.
    funnel = page.locator('[data-testid="dataset-funnel"]')
    funnel.wait_for(timeout=WAIT_MS)
    stages = {row.get_attribute("data-stage"): row.inner_text() for row in funnel.locator("tbody tr").all()}
    assert stages["Rows read"].split("\t")[:2] == ["Rows read", f"{4 * SHARDS}"]
    assert stages["Filtered"].split("\t")[1:] == [
        f"{3 * SHARDS}",
        "75.0%",
        f"{2 * SHARDS} by min_width, {SHARDS} by max_punsafe",
    ]
    assert stages["Kept for training"].split("\t")[1:3] == [f"{SHARDS}", "25.0%"]
    durations_fixed(page)
    look(page, tmp_path, "succeeded-run", report)
    for panel in ("dataset", "training", "evaluation", "endpoint"):
        shoot(page.locator(f'[data-testid="{panel}"]'), tmp_path, f"{panel}-panel", report)

    # The Map's child executions: one per shard, each with its download job and its log link;
    # a shard whose job stored none of its images is flagged, though its child succeeded.
    arn = cloud.client("stepfunctions").describe_execution(
        executionArn=cloud.state_machine_arn.replace(":stateMachine:", ":execution:") + f":{name}"
    )["executionArn"]
    _empty_one_shard(cloud, arn)
    page.goto(f"{console.url}#/runs/{name}/maps/Download%20shards")
    page.wait_for_function(
        f"document.querySelectorAll('[data-testid=\"child-row\"]').length === {SHARDS}", timeout=WAIT_MS
    )
    rows = page.locator('[data-testid="child-row"]')
    for i in range(SHARDS):
        text = rows.nth(i).inner_text()
        assert "sdf-dl-" in text
        assert rows.nth(i).get_attribute("data-status") == "SUCCEEDED"
    assert page.locator('[data-testid="empty-shard"]').count() == 1
    assert "0 of 1" in page.locator('[data-testid="empty-shard"]').inner_text()
    assert "1 shard on this page downloaded no images" in page.locator('[data-testid="empty-shards"]').inner_text()
    # Each shard's counts as the index recorded them (before the marker above was rewritten): 4 read, 3 filtered.
    assert page.locator('[data-testid="count-read"]').all_inner_texts() == ["4"] * SHARDS
    assert page.locator('[data-testid="count-filtered"]').all_inner_texts() == ["3"] * SHARDS
    assert page.locator('[data-testid="count-kept"]').all_inner_texts() == ["1"] * SHARDS
    look(page, tmp_path, "children", report)


def _empty_one_shard(cloud: LocalCloud, execution_arn: str) -> None:
    """One shard's _SUCCESS rewritten as a job that stored none of its images writes it (every
    URL failed), before the console first reads it."""
    sfn, s3 = cloud.client("stepfunctions"), cloud.client("s3")
    map_run = sfn.list_map_runs(executionArn=execution_arn)["mapRuns"][0]["mapRunArn"]
    child = sfn.list_executions(mapRunArn=map_run)["executions"][0]["executionArn"]
    shard = json.loads(sfn.describe_execution(executionArn=child)["input"])["shard"]
    bucket, key = parse_s3_uri(shard["output_uri"])
    marker = {"shard_id": shard["shard_id"], "samples": 0, "failed": 1, "tar_files": ["00000.tar"]}
    s3.put_object(Bucket=bucket, Key=key.rstrip("/") + "/_SUCCESS", Body=json.dumps(marker).encode())


def test_console_endpoint_prompt_box_returns_an_image(cloud: LocalCloud, console: ConsoleServer, page: Any) -> None:
    runs = cloud.client("stepfunctions").list_executions(stateMachineArn=cloud.state_machine_arn)["executions"]
    done = [r["name"] for r in runs if r["status"] == "SUCCEEDED"]
    assert done, "the upload test's run ends first"
    page.goto(f"{console.url}#/runs/{done[0]}")
    section = page.locator('[data-testid="endpoint"]')
    section.wait_for(timeout=WAIT_MS)
    page.wait_for_function("el => el.innerText.includes('InService')", arg=section.element_handle(), timeout=WAIT_MS)
    page.locator('[data-testid="prompt-input"]').fill("a red circle on a blue background")
    page.locator('[data-testid="prompt-submit"]').click()
    image = page.locator('img[data-testid="prompt-image"]')
    image.wait_for(timeout=WAIT_MS)
    page.wait_for_function("img => img.complete && img.naturalWidth === 4", arg=image.element_handle())

    page.locator('[data-testid="prompt-input"]').fill("")
    page.locator('[data-testid="prompt-submit"]').click()
    error = page.locator('[data-testid="prompt-error"]')
    error.wait_for(timeout=WAIT_MS)
    assert "prompt" in error.inner_text().lower()


def test_console_killed_training_job_shows_failed_state_then_redrive_and_later_endpoint(
    cloud: LocalCloud, console: ConsoleServer, sagemaker: NoOpSageMaker, page: Any, tmp_path: Path,
    report: Callable[[str], None],
) -> None:  # fmt: skip
    sfn = cloud.client("stepfunctions")
    # The endpoint of the upload test's run: deployed by this run once redriven, the older run's
    # endpoint panel must say that it serves this run's model now.
    arn = sfn.start_execution(
        stateMachineArn=cloud.state_machine_arn, name="console-killed",
        input=json.dumps(_document(cloud, "sdflow-console")),
    )["executionArn"]  # fmt: skip
    page.goto(f"{console.url}#/runs/console-killed")
    page.wait_for_selector('g.state[data-state="Train model"][data-status="running"]', timeout=WAIT_MS)
    api = cloud.client("sagemaker")
    # The state is entered a moment before its Lambda creates the job.
    jobs = wait_for(
        lambda: api.list_training_jobs(StatusEquals="InProgress")["TrainingJobSummaries"],
        timeout_s=60, interval_s=0.1, what="the held training job",
    )  # fmt: skip
    job = jobs[0]["TrainingJobName"]
    sagemaker.kill_job("training", job)

    page.wait_for_selector('g.state[data-state="Train model"][data-status="failed"]', timeout=WAIT_MS)
    header = page.locator('[data-testid="run-header"]')
    page.wait_for_function("el => el.innerText.includes('FAILED')", arg=header.element_handle(), timeout=WAIT_MS)
    assert "TrainingJobFailed" in header.inner_text()
    assert "training job ended Failed or Stopped" in header.inner_text()  # the error said as the problem
    assert sfn.describe_execution(executionArn=arn)["status"] == "FAILED"
    assert _state(page, "Evaluate model").get_attribute("data-status") == "not_reached"
    page.wait_for_selector('[data-testid="training-status"]', timeout=WAIT_MS)
    durations_fixed(page)
    look(page, tmp_path, "job-failed-run", report)

    sfn.redrive_execution(executionArn=arn)
    page.wait_for_selector('g.state[data-state="Deploy endpoint"][data-status="succeeded"]', timeout=WAIT_MS)
    page.wait_for_function("el => el.innerText.includes('SUCCEEDED')", arg=header.element_handle(), timeout=WAIT_MS)
    assert "Redrives" in header.inner_text()
    durations_fixed(page)
    look(page, tmp_path, "redriven-run", report)

    older = next(r["name"] for r in _runs(cloud) if r["name"].startswith("console-ok-"))
    page.goto(f"{console.url}#/runs/{older}")
    notice = page.locator('[data-testid="endpoint-other-run"]')
    notice.wait_for(timeout=WAIT_MS)
    assert "console-killed" in notice.inner_text()
    look(page, tmp_path, "endpoint-of-later-run", report)
    shoot(page.locator('[data-testid="endpoint"]'), tmp_path, "endpoint-panel-of-later-run", report)


def _runs(cloud: LocalCloud) -> list[dict[str, Any]]:
    return list(cloud.client("stepfunctions").list_executions(stateMachineArn=cloud.state_machine_arn)["executions"])


def test_console_validation_failure_reads_as_fields_and_fixes_with_raw_cause_one_click_away(
    cloud: LocalCloud, console: ConsoleServer, page: Any, tmp_path: Path, report: Callable[[str], None]
) -> None:
    document = _document(cloud, "sdflow-console-invalid")
    document["dataset"] = {"prefix": f"s3://{cloud.bucket}/datasets/nothing-here/"}
    cloud.client("stepfunctions").start_execution(
        stateMachineArn=cloud.state_machine_arn, name="console-invalid", input=json.dumps(document)
    )
    page.goto(f"{console.url}#/runs/console-invalid")
    page.wait_for_selector('g.state[data-state="Validate run"][data-status="failed"]', timeout=WAIT_MS)
    cause = page.locator('[data-testid="run-cause"]')
    cause.wait_for(timeout=WAIT_MS)
    assert "dataset.prefix" in page.locator('[data-testid="cause-problems"]').inner_text()
    assert "upload the parquet files there" in cause.inner_text()
    raw = cause.locator('[data-testid="raw-cause"]')
    assert raw.get_attribute("open") is None  # closed: the raw cause is one click away, not on the page
    sub = _state(page, "Validate run").locator(".state-sub").text_content() or ""
    assert sub.endswith(" s"), f"a step of moments shown as {sub!r}"
    assert "min" not in sub
    durations_fixed(page)
    look(page, tmp_path, "validation-failed-run", report)

    # The state's Error tab reads the same way.
    _state(page, "Validate run").click()
    page.locator('[data-testid="tab-error"]').click()
    page.locator('[data-testid="state-cause"] [data-testid="cause-problems"]').wait_for(timeout=WAIT_MS)
    look(page, tmp_path, "validation-failed-state-error", report)
    raw.locator("summary").click()
    assert "errorMessage" in raw.inner_text()  # one click shows the raw cause


def test_console_stopped_run_states_end_at_the_stop(
    cloud: LocalCloud, console: ConsoleServer, sagemaker: NoOpSageMaker, page: Any, tmp_path: Path,
    report: Callable[[str], None],
) -> None:  # fmt: skip
    sfn = cloud.client("stepfunctions")
    arn = sfn.start_execution(
        stateMachineArn=cloud.state_machine_arn, name="console-stopped",
        input=json.dumps(_document(cloud, "sdflow-console-stopped")),
    )["executionArn"]  # fmt: skip
    page.goto(f"{console.url}#/runs/console-stopped")
    page.wait_for_selector('g.state[data-state="Train model"][data-status="running"]', timeout=WAIT_MS)
    sfn.stop_execution(executionArn=arn, error="Stopped.ByUser", cause="a person stopped it from the console test")
    page.wait_for_selector('g.state[data-state="Train model"][data-status="aborted"]', timeout=WAIT_MS)
    page.wait_for_function(
        "el => el.innerText.includes('ABORTED')", arg=page.locator('[data-testid="run-header"]').element_handle(),
        timeout=WAIT_MS,
    )  # fmt: skip
    durations_fixed(page)
    look(page, tmp_path, "stopped-run", report)


def test_console_runs_list_of_every_kind_reads_well(
    cloud: LocalCloud, console: ConsoleServer, page: Any, tmp_path: Path, report: Callable[[str], None]
) -> None:
    page.goto(console.url)
    page.wait_for_function("document.querySelectorAll('[data-testid=\"run-row\"]').length >= 4", timeout=WAIT_MS)
    look(page, tmp_path, "runs-list", report)


def test_console_unknown_run_and_stopped_cloud_show_messages_not_traces(console: ConsoleServer, page: Any) -> None:
    page.goto(f"{console.url}#/runs/no-such-run")
    banner = page.locator('[data-testid="error"]')
    banner.wait_for(timeout=WAIT_MS)
    assert "does not exist" in banner.inner_text().lower()
    assert "Traceback" not in page.content()

    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there: a stopped local cloud
    config = ConsoleConfig(
        client=lambda service, **options: __import__("boto3").client(
            service, endpoint_url=nowhere, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing", **options,
        ),
        endpoint_url=nowhere, region="us-east-1", bucket="b",
        state_machine_arn="arn:aws:states:us-east-1:123456789012:stateMachine:sdflow-local-pipeline",
    )  # fmt: skip
    with ConsoleServer(config, port=0) as stopped:
        page.goto(stopped.url)
        banner = page.locator('[data-testid="error"]')
        banner.wait_for(timeout=WAIT_MS)
        assert f"cannot reach {nowhere}" in banner.inner_text()
        assert "sdflow local up" in banner.inner_text()
