"""sdflow.sdk against moto: connecting, starting runs both ways, finding them, their summaries and errors."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.core.config import default_user_config

from sdflow import sdk
from sdflow.local import template
from sdflow.sdk.summary import RunSummary
from sdflow.session import LOCAL_STACK_NAME, STATE_FILE, Session
from sdflow_common.start_pipeline import ManifestRef, handle_manifest
from tests.constants import ACCOUNT, REGION
from tests.unit.evaluation_documents import EVALUATION_URI, registered_model
from tests.unit.helpers import DATA_BUCKET, STATE_MACHINE_ARN, STATE_MACHINE_NAME, AwsWorld
from tests.unit.parquet_files import parquet_bytes

DOCUMENT = {
    "run_name": "cats-v1",
    "dataset": {"parquet_uris": [f"s3://{DATA_BUCKET}/datasets/laion-mini/part-00000.parquet"]},
    "base_model_uri": f"s3://{DATA_BUCKET}/models/sd15/",
}
PASS = {"StartAt": "Done", "States": {"Done": {"Type": "Pass", "End": True}}}
ROLE = f"arn:aws:iam::{ACCOUNT}:role/sdflow-states-test"
TRAINING_JOB = "sdf-tr-cats-v1-0123456789-r0-a0"
MODEL = f"s3://{DATA_BUCKET}/runs/x/training/{TRAINING_JOB}/output/model.tar.gz"
# The pipeline's state names and ResultPaths (statemachines/pipeline.asl.json), each step a Pass with
# what the real step writes, so histories and outputs have the pipeline's shape.
STEPS: list[tuple[str, str, Any]] = [
    ("Validate run", "$.config", {"run_id": "x"}),
    ("Build dataset index", "$.dataset", {"index_uri": "s3://b/i.json", "total_samples": 42, "shards_ok": 2,
                                          "shards_failed": 1, "failed_shards": [],
                                          "curation": {"rows_read": 60, "filter_drops": {"min_width": 10},
                                                       "failed_to_download": 8, "failed_to_resize": 0, "holdout": 0,
                                                       "url_duplicates": None, "image_duplicates": None, "kept": 42,
                                                       "deduplicated": False, "unhashed_shards": 0}}),
    ("Train model", "$.training", {"job_name": TRAINING_JOB, "model_data_url": MODEL,
                                   "final_metrics": {"train:loss": 0.125}}),
    ("Register model", "$.registry.model", {"model_package_arn": "arn:aws:sagemaker:p/1", "prompt_adherence": 0.9,
                                            "base_prompt_adherence": 0.125}),
    ("Deploy endpoint", "$.endpoint", {"endpoint_name": "sdflow-cats", "endpoint_config_name": "c"}),
]  # fmt: skip


def _machine(steps: list[tuple[str, str, Any]], fail_after: str | None = None) -> dict[str, Any]:
    states: dict[str, Any] = {}
    for i, (name, path, result) in enumerate(steps):
        nxt = steps[i + 1][0] if i + 1 < len(steps) else None
        states[name] = {"Type": "Pass", "Result": result, "ResultPath": path}
        if name == fail_after:
            nxt = "Training failed"
            states[nxt] = {"Type": "Fail", "Error": "TrainingJobFailed", "Cause": "job sdf-tr-x: exit code 137"}
        states[name].update({"Next": nxt} if nxt else {"End": True})
        if name == fail_after:
            break
    return {"StartAt": steps[0][0], "States": states}


class StartPipelineOnUpload:
    """The S3 client with the stack's manifest rule in between: an upload runs StartPipeline's real code.
    `afterwards` runs right after StartPipeline (another caller starting a run at the same moment)."""

    def __init__(self, client: Any, afterwards: Callable[[], None] | None = None) -> None:
        self.client, self.afterwards = client, afterwards
        self.keys: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def put_object(self, **params: Any) -> dict[str, Any]:
        put = dict(self.client.put_object(**params))
        self.keys.append(params["Key"])
        ref = ManifestRef(params["Bucket"], params["Key"], put.get("VersionId"), put["ETag"].strip('"'))
        handle_manifest(
            ref,
            state_machine_arn=STATE_MACHINE_ARN,
            topic_arn=os.environ["TOPIC_ARN"],
            max_shards=50,
            data_bucket=DATA_BUCKET,
        )
        if self.afterwards is not None:
            self.afterwards()
        return put


@pytest.fixture
def world(mocked_aws: AwsWorld) -> AwsWorld:
    mocked_aws.sfn.create_state_machine(name=STATE_MACHINE_NAME, definition=json.dumps(PASS), roleArn=ROLE)
    # As template.yaml has it: the execution name of an upload comes from the object's version.
    mocked_aws.s3.put_bucket_versioning(Bucket=DATA_BUCKET, VersioningConfiguration={"Status": "Enabled"})
    mocked_aws.put_json("models/sd15/model_index.json", {"_class_name": "StableDiffusionPipeline"})
    mocked_aws.s3.put_object(Bucket=DATA_BUCKET, Key="datasets/laion-mini/part-00000.parquet", Body=parquet_bytes())
    return mocked_aws


def _pipeline(s3: Any = None) -> sdk.Pipeline:
    def client(name: str, **options: Any) -> Any:
        if name == "s3" and s3 is not None:
            return s3
        return boto3.client(name, region_name=REGION, **options)  # type: ignore[call-overload]

    return sdk.Pipeline(Session(client=client, bucket=DATA_BUCKET, state_machine_arn=STATE_MACHINE_ARN))


def _input(world: AwsWorld, arn: str) -> Any:
    return json.loads(world.sfn.describe_execution(executionArn=arn)["input"])


# ---------------------------------------------------------------------------- connect


def test_connect_stack_outputs_come_from_cloudformation(world: AwsWorld, tmp_path: Path) -> None:
    outputs = {"DataBucketName": DATA_BUCKET, "PipelineStateMachineArn": STATE_MACHINE_ARN}
    stack = {
        "Resources": {"Queue": {"Type": "AWS::SQS::Queue"}},
        "Outputs": {key: {"Value": value} for key, value in outputs.items()},
    }
    boto3.client("cloudformation", region_name=REGION).create_stack(StackName="sdflow", TemplateBody=json.dumps(stack))

    pipeline = sdk.Pipeline.connect(workdir=tmp_path)

    assert (pipeline.bucket, pipeline.state_machine_arn) == (DATA_BUCKET, STATE_MACHINE_ARN)
    assert pipeline.session.endpoint_url is None


def test_connect_explicit_bucket_and_arn_need_no_stack(world: AwsWorld, tmp_path: Path) -> None:
    pipeline = sdk.Pipeline.connect(workdir=tmp_path, bucket=DATA_BUCKET, state_machine_arn=STATE_MACHINE_ARN)

    assert (pipeline.bucket, pipeline.state_machine_arn) == (DATA_BUCKET, STATE_MACHINE_ARN)
    assert pipeline.runs() == []


def test_connect_without_local_cloud_or_stack_raises_not_connected(world: AwsWorld, tmp_path: Path) -> None:
    with pytest.raises(sdk.NotConnected, match=r"no sdflow stack 'sdflow'.*no local cloud runs.*sdflow local up"):
        sdk.Pipeline.connect(workdir=tmp_path)


def test_connect_stale_state_file_says_the_local_cloud_ended(world: AwsWorld, tmp_path: Path) -> None:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    (tmp_path / STATE_FILE).write_text(json.dumps({"endpoint_url": "http://127.0.0.1:9", "pid": ended.pid}))

    with pytest.raises(sdk.NotConnected, match=rf"pid {ended.pid}\) has ended.*sdflow local up"):
        sdk.Pipeline.connect(workdir=tmp_path)


def test_connect_live_state_file_uses_its_endpoint_outputs_and_credentials(tmp_path: Path) -> None:
    state = {
        "endpoint_url": "http://127.0.0.1:9",
        "outputs": {"DataBucketName": "local-bucket", "PipelineStateMachineArn": STATE_MACHINE_ARN},
        "env": {"AWS_ACCESS_KEY_ID": "local-key", "AWS_SECRET_ACCESS_KEY": "s", "AWS_SESSION_TOKEN": "t"},
        "region": "eu-west-1",
        "workdir": str(tmp_path / "cloud"),
        "pid": os.getpid(),
    }
    (tmp_path / STATE_FILE).write_text(json.dumps(state))

    session = Session.connect(workdir=tmp_path)

    assert (session.bucket, session.endpoint_url, session.region) == ("local-bucket", "http://127.0.0.1:9", "eu-west-1")
    assert session.workdir == tmp_path / "cloud"
    s3 = session.client("s3")
    assert s3.meta.endpoint_url == "http://127.0.0.1:9"
    assert s3._request_signer._credentials.access_key == "local-key"
    assert session.client("s3") is s3, "one client per service"


def test_connect_local_stack_name_is_the_local_clouds() -> None:
    assert LOCAL_STACK_NAME == template.DEFAULT_STACK_NAME


# ---------------------------------------------------------------------------- start


def test_start_via_upload_manifest_lands_where_start_pipeline_starts_it(world: AwsWorld) -> None:
    s3 = StartPipelineOnUpload(world.s3)

    run = _pipeline(s3).start(DOCUMENT, via="upload")

    [key] = s3.keys
    assert key.startswith("manifests/cats-v1-")
    assert key.endswith(".json")
    assert run.name.startswith("cats-v1-")
    assert _input(world, run.execution_arn) == DOCUMENT
    started_by = world.get_json(f"runs/{run.name}/started_by.json")
    assert started_by["manifest"] == f"s3://{DATA_BUCKET}/{key}"


def test_start_via_upload_path_uses_file_name_and_skips_a_newer_api_run(world: AwsWorld, tmp_path: Path) -> None:
    manifest = tmp_path / "dogs.json"
    manifest.write_text(json.dumps({**DOCUMENT, "run_name": "dogs"}))

    def api_start() -> None:
        world.sfn.start_execution(stateMachineArn=STATE_MACHINE_ARN, name="by-api", input="{}")

    s3 = StartPipelineOnUpload(world.s3, afterwards=api_start)
    run = _pipeline(s3).start(str(manifest))

    assert s3.keys == ["manifests/dogs.json"]
    assert run.name.startswith("dogs-"), "the upload's run, not the API run started a moment after it"


def test_start_via_upload_invalid_document_raises_manifest_rejected_naming_the_field(world: AwsWorld) -> None:
    broken = {"dataset": DOCUMENT["dataset"], "training": {"max_train_step": 5}}

    with pytest.raises(sdk.ManifestRejected, match=r"(?s)base_model_uri: is required.*max_train_step") as caught:
        _pipeline(StartPipelineOnUpload(world.s3)).start(broken, name="broken")

    assert caught.value.report_uri == f"s3://{DATA_BUCKET}/rejected/manifests/broken.json.errors.json"
    assert world.sfn.list_executions(stateMachineArn=STATE_MACHINE_ARN)["executions"] == []


def test_start_via_api_input_equals_document_and_name_is_given(world: AwsWorld) -> None:
    run = _pipeline().start(DOCUMENT, via="api", name="cats-api")

    assert run.execution_arn == f"arn:aws:states:{REGION}:{ACCOUNT}:execution:{STATE_MACHINE_NAME}:cats-api"
    assert _input(world, run.execution_arn) == DOCUMENT
    assert run.status == "RUNNING"


def test_start_via_api_name_taken_raises_sdflow_error(world: AwsWorld) -> None:
    pipeline = _pipeline()
    pipeline.start(DOCUMENT, via="api", name="twice")
    with pytest.raises(sdk.SdflowError, match="StartExecution refused the run"):
        pipeline.start({**DOCUMENT, "run_name": "other"}, via="api", name="twice")


def test_start_unknown_via_raises_value_error(world: AwsWorld) -> None:
    with pytest.raises(ValueError, match="via must be"):
        _pipeline().start(DOCUMENT, via="email")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- lookup, resume


def test_run_by_name_or_arn_is_the_same_run(world: AwsWorld) -> None:
    pipeline = _pipeline()
    started = pipeline.start(DOCUMENT, via="api", name="cats-1")
    pipeline.start(DOCUMENT, via="api", name="cats-2")

    assert pipeline.run("cats-1") == started
    assert pipeline.run(started.execution_arn) == started
    assert [run.name for run in pipeline.runs(limit=1)] == ["cats-2"]


def test_run_unknown_name_raises_run_not_found_saying_how_to_list(world: AwsWorld) -> None:
    with pytest.raises(sdk.RunNotFound, match=r"no execution 'nope' of .*pipeline\.runs\(\)"):
        _pipeline().run("nope")
    with pytest.raises(sdk.RunNotFound, match="no execution arn:"):
        _pipeline().run(f"arn:aws:states:{REGION}:{ACCOUNT}:execution:{STATE_MACHINE_NAME}:gone")


def test_resume_with_new_document_starts_run_with_resume_from(world: AwsWorld) -> None:
    pipeline = _pipeline()
    old = pipeline.start(DOCUMENT, via="api", name="cats-v1")
    world.sfn.stop_execution(executionArn=old.execution_arn)

    new = old.resume({**DOCUMENT, "training": {"max_train_steps": 5}})

    assert new.name.startswith("cats-v1-resume-")
    expected = {**DOCUMENT, "training": {"max_train_steps": 5}, "resume_from": old.execution_arn}
    assert _input(world, new.execution_arn) == expected


# ---------------------------------------------------------------------------- wait, summary


@pytest.fixture
def executing(world: AwsWorld, monkeypatch: pytest.MonkeyPatch) -> AwsWorld:
    """moto's Step Functions interpreter runs the executions (real histories and outputs)."""
    monkeypatch.setitem(default_user_config, "stepfunctions", {"execute_state_machine": True})
    return world


def _run_of(world: AwsWorld, definition: dict[str, Any], name: str) -> sdk.Run:
    machine = world.sfn.create_state_machine(name=f"m-{name}", definition=json.dumps(definition), roleArn=ROLE)
    session = Session(
        client=lambda service, **options: boto3.client(service, region_name=REGION, **options),  # type: ignore[call-overload]
        bucket=DATA_BUCKET,
        state_machine_arn=machine["stateMachineArn"],
    )
    return sdk.Pipeline(session).start({}, via="api", name=name)


def test_summary_of_succeeded_run_reads_its_output(executing: AwsWorld, capsys: pytest.CaptureFixture[str]) -> None:
    executing.put_json("runs/good/shards.json", [{"shard_id": f"{i:05d}"} for i in range(3)])
    executing.put_json("runs/good/dataset/index.json", {"shards": [{}, {}], "failed_shards": [{}]})
    run = _run_of(executing, _machine(STEPS), "good")

    summary = run.wait(progress=True, poll_s=0.05, timeout_s=20)

    assert summary.status == "SUCCEEDED"
    assert (summary.shards_total, summary.shards_succeeded, summary.shards_failed, summary.samples) == (3, 2, 1, 42)
    assert (summary.training_job_name, summary.final_loss, summary.model_data_uri) == (TRAINING_JOB, 0.125, MODEL)
    assert (summary.prompt_adherence, summary.base_prompt_adherence) == (0.9, 0.125)
    assert (summary.endpoint_name, summary.failed_state, summary.error) == ("sdflow-cats", None, None)
    assert summary.stopped is not None
    assert summary.duration_s >= 0
    assert "2 of 3 downloaded, 1 failed; 42 samples" in str(summary)
    assert summary.data is not None
    assert summary.data["kept"] == 42
    assert ("data", "60 rows read") in summary.rows()
    assert ("", "10 filtered (16.7%): 10 by min_width") in summary.rows()
    assert ("", "42 kept for training (70.0%)") in summary.rows()
    assert "<th style='text-align:left'>endpoint</th>" in summary._repr_html_()
    assert "2/3" in capsys.readouterr().err, "the bar counts shards done of the run's shards"
    assert run.predictor().endpoint_name == "sdflow-cats"


def test_wait_failed_run_raises_run_failed_with_error_and_what_it_finished(executing: AwsWorld) -> None:
    run = _run_of(executing, _machine(STEPS, fail_after="Build dataset index"), "bad")

    with pytest.raises(sdk.RunFailed, match=r"run bad ended FAILED: TrainingJobFailed: job sdf-tr-x") as caught:
        run.wait(progress=False, poll_s=0.05, timeout_s=20)

    failed = caught.value
    assert (failed.error, failed.cause) == ("TrainingJobFailed", "job sdf-tr-x: exit code 137")
    assert (failed.summary.samples, failed.summary.shards_succeeded, failed.summary.training_job_name) == (42, 2, None)
    assert run.wait(progress=False, raise_on_failure=False).status == "FAILED"
    with pytest.raises(sdk.NoEndpoint, match=r"run bad is FAILED \(TrainingJobFailed\).*run\.resume\(\)"):
        run.predictor()


def test_wait_past_timeout_raises_wait_timeout(world: AwsWorld) -> None:
    run = _pipeline().start(DOCUMENT, via="api", name="slow")  # moto leaves it RUNNING

    started = time.monotonic()
    with pytest.raises(sdk.WaitTimeout, match=r"still RUNNING after 0\.2 s"):
        run.wait(progress=False, poll_s=0.05, timeout_s=0.2)
    assert time.monotonic() - started < 5


# ---------------------------------------------------------------------------- predictor


class _Runtime:
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def invoke_endpoint(self, **params: Any) -> dict[str, Any]:
        self.bodies.append(json.loads(params["Body"]))
        return {"Body": io.BytesIO(json.dumps({"images": [base64.b64encode(b"\x89PNG-1").decode()]}).encode())}


def test_predictor_predict_returns_png_bytes_and_save_writes_them(tmp_path: Path) -> None:
    runtime = _Runtime()
    session = Session(client=lambda _name: runtime, bucket=None, state_machine_arn=None)

    predictor = sdk.Predictor("sdflow-cats", session)

    assert predictor.predict("a red circle", seed=1, width=None) == b"\x89PNG-1"
    assert predictor.save("a red circle", tmp_path / "out.png").read_bytes() == b"\x89PNG-1"
    assert runtime.bodies[0] == {"prompt": "a red circle", "seed": 1}


def test_summary_shard_with_no_image_not_counted_as_downloaded() -> None:
    started = datetime(2026, 11, 27, tzinfo=UTC)
    summary = RunSummary(
        name="r", execution_arn="arn", status="SUCCEEDED", started=started, stopped=started, duration_s=60.0,
        shards_total=4, shards_succeeded=4, shards_failed=0, shards_empty=1,
    )  # fmt: skip
    assert dict(summary.rows())["shards"] == "3 of 4 downloaded, 1 held no image"


def test_summary_rows_registered_evaluation_show_each_metric_gate_missing_and_grid() -> None:
    started = datetime(2026, 11, 27, tzinfo=UTC)
    model = registered_model()
    summary = RunSummary(
        name="r", execution_arn="arn", status="SUCCEEDED", started=started, stopped=started, duration_s=60.0,
        metrics=model["metrics"], gate=model["gate"], missing=model["missing"], holdout_samples=64,
        holdout_grid_uri=model["holdout_grid_uri"],
    )  # fmt: skip

    rows = summary.rows()

    assert ("clip_score ↑", "base 21.30 → trained 27.90 (64 held-out samples)") in rows
    assert ("kid ↓", "base 0.0510 ± 0.0040 → trained 0.0120 ± 0.0020 (64 held-out samples)") in rows
    assert ("prompt_adherence ↑", "base 0.12 → trained 0.85 (48 scene prompts)") in rows
    assert ("quality gate", "2 of 2 checks passed") in rows
    assert ("", "✓ kid (trained - base ≤ 0): base 0.0510 → trained 0.0120, change -0.0390") in rows
    assert ("fid ↓", "not computed: 64 held-out samples, fewer than the 512 of the CLIP feature dimension") in rows
    assert ("held-out grid", f"{EVALUATION_URI}holdout.png (real | base | trained per caption)") in rows
    assert "prompt adherence" not in dict(rows), "the registered metrics replace the training job's own score"
    assert "<td style='text-align:left'>base 21.30 → trained 27.90 (64 held-out samples)</td>" in summary._repr_html_()


def test_summary_of_run_reads_registered_evaluation_from_its_output(executing: AwsWorld) -> None:
    steps = [(n, p, registered_model() if n == "Register model" else r) for n, p, r in STEPS]
    run = _run_of(executing, _machine(steps), "evaluated")

    summary = run.wait(poll_s=0.05, timeout_s=20)

    assert summary.metrics["clip_score"] == {"base": 21.3, "trained": 27.9, "samples": 64}
    assert [check["passed"] for check in summary.gate] == [True, True]
    assert summary.missing[0]["metric"] == "fid"
    assert (summary.holdout_samples, summary.holdout_grid_uri) == (64, f"{EVALUATION_URI}holdout.png")
    assert (summary.prompt_adherence, summary.approval_status) == (0.85, "Approved")
