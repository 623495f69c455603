"""reconciler: only claims near or past their deadline are looked at; a terminal resource resolves its
token as if the event had arrived, a job that outlived its task is stopped."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

# The X-Ray SDK opens its UDP emitter's socket on first import (Tracer() triggers it); import it
# here, at collection, before the unit fixtures block sockets.
import aws_xray_sdk.core  # noqa: F401
import pytest
from botocore.exceptions import ClientError
from moto.sagemaker.models import sagemaker_backends

from sdflow_common import aws, dedup_job, sagemaker_jobs
from sdflow_common.errors import ReconcileIncomplete
from sdflow_common.run_document import DownloadOptions, RunDocument
from sdflow_common.token_store import Kind, TokenStore
from tests.constants import ACCOUNT, REGION
from tests.helpers import load_function_module
from tests.unit.helpers import (
    DATA_BUCKET,
    SAGEMAKER_ROLE_ARN,
    STATE_MACHINE_ARN,
    TOKEN_TABLE,
    TRAINING_IMAGE_URI,
    AwsWorld,
    FakeLambdaContext,
    load_event,
)

EXECUTION_ARN = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:sdflow-pipeline-test:run-under-test"
RUN_ID = "run-under-test"
RUN_HASH = "0123456789"
TIMEOUT = 4500  # the task's TimeoutSeconds
LEAD = 1200  # RECONCILE_LEAD_SECONDS


@dataclass
class Resolutions:
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def by_token(self) -> dict[str, tuple[str, dict[str, Any]]]:
        return {params["taskToken"]: (operation, params) for operation, params in self.calls}


@pytest.fixture
def sfn(mocked_aws: AwsWorld, monkeypatch: pytest.MonkeyPatch) -> Resolutions:
    monkeypatch.setenv("RECONCILE_LEAD_SECONDS", str(LEAD))
    recorder = Resolutions()
    client = aws.client("stepfunctions")
    monkeypatch.setattr(client, "send_task_success", lambda **kw: recorder.calls.append(("success", kw)) or {})
    monkeypatch.setattr(client, "send_task_failure", lambda **kw: recorder.calls.append(("failure", kw)) or {})
    return recorder


@pytest.fixture
def sagemaker_calls(mocked_aws: AwsWorld) -> list[str]:
    """Every SageMaker API call the functions' client makes, by operation name."""
    calls: list[str] = []
    aws.client("sagemaker").meta.events.register(
        "before-call.sagemaker.*", lambda model, **_kw: calls.append(model.name)
    )
    return calls


def claim(name: str, token: str, kind: Kind, *, deadline_in: int, context: dict[str, str] | None = None) -> None:
    """A claim whose task's deadline is `deadline_in` seconds from now (negative: passed)."""
    store = TokenStore(TOKEN_TABLE, clock=lambda: time.time() + deadline_in - TIMEOUT)
    store.claim(name, token, EXECUTION_ARN, kind, context, timeout_seconds=TIMEOUT)


def reconcile() -> dict[str, int]:
    handler = load_function_module("reconciler").lambda_handler
    return handler(load_event("scheduled_reconciler.json"), FakeLambdaContext())  # type: ignore[no-any-return]


def set_status(name: str, status: str) -> None:
    backend = sagemaker_backends[ACCOUNT][REGION]
    if name in backend.processing_jobs:
        backend.processing_jobs[name].processing_job_status = status
    else:
        backend.training_jobs[name].training_job_status = status


def create_training_job(world: AwsWorld, name: str, keep_alive_seconds: int = 0) -> None:
    run = RunDocument.model_validate(
        {
            "dataset": {"prefix": f"s3://{DATA_BUCKET}/d/"},
            "base_model_uri": f"s3://{DATA_BUCKET}/models/m/",
            "training": {"keep_alive_seconds": keep_alive_seconds},
        }
    )
    world.sagemaker.create_training_job(
        **sagemaker_jobs.training_job_request(
            job_name=name,
            run_id=RUN_ID,
            run_hash=RUN_HASH,
            bucket=DATA_BUCKET,
            dataset_prefix_uri=f"s3://{DATA_BUCKET}/runs/{RUN_ID}/dataset/",
            run=run,
            image_uri=TRAINING_IMAGE_URI,
            role_arn=SAGEMAKER_ROLE_ARN,
        )
    )


def create_processing_job(world: AwsWorld, name: str) -> None:
    world.sagemaker.create_processing_job(
        **sagemaker_jobs.processing_job_request(
            job_name=name,
            run_id=RUN_ID,
            run_hash=RUN_HASH,
            shard_id="00000",
            parquet_uri=f"s3://{DATA_BUCKET}/d/part-0.parquet",
            output_uri=f"s3://{DATA_BUCKET}/runs/{RUN_ID}/dataset/shards/00000/",
            options=DownloadOptions(),
            url_column="URL",
            caption_column="TEXT",
            image_uri=TRAINING_IMAGE_URI,
            role_arn=SAGEMAKER_ROLE_ARN,
        )
    )


def create_dedup_job(world: AwsWorld, name: str) -> str:
    """The run's dedup job as Find duplicates starts it; returns the summary URI its claim carries."""
    task = dedup_job.DedupTask.model_validate(load_event("find_duplicates_task.json"))
    request = dedup_job.dedup_job_request(
        job_name=name, config=task.config, run_hash=RUN_HASH, image_uri=TRAINING_IMAGE_URI, role_arn=SAGEMAKER_ROLE_ARN
    )
    world.sagemaker.create_processing_job(**request)
    return dedup_job.summary_uri(task.config.bucket, task.config.run_id)


def test_reconciler_dedup_job_whose_event_was_missed_answers_find_duplicates_at_once(
    mocked_aws: AwsWorld, sfn: Resolutions
) -> None:
    summary = create_dedup_job(mocked_aws, "sdf-dd-missed-r0-a0")  # moto completes jobs at once
    # Not a download: looked at every pass, however far its deadline.
    claim("sdf-dd-missed-r0-a0", "token-dd", "dedup", deadline_in=LEAD + 3600, context={"summary_uri": summary})

    counts = reconcile()

    operation, params = sfn.by_token()["token-dd"]
    assert operation == "success"
    assert json.loads(params["output"]) == {"job_name": "sdf-dd-missed-r0-a0", "summary_uri": summary}
    assert counts["resolved"] == 1
    assert TokenStore(TOKEN_TABLE).get("sdf-dd-missed-r0-a0") is None


def test_reconciler_dedup_job_running_past_its_deadline_is_stopped_and_its_task_failed(
    mocked_aws: AwsWorld, sfn: Resolutions
) -> None:
    create_dedup_job(mocked_aws, "sdf-dd-late-r0-a0")
    set_status("sdf-dd-late-r0-a0", "InProgress")
    claim("sdf-dd-late-r0-a0", "token-dd-late", "dedup", deadline_in=-30)

    counts = reconcile()

    job = mocked_aws.sagemaker.describe_processing_job(ProcessingJobName="sdf-dd-late-r0-a0")
    assert job["ProcessingJobStatus"] == "Stopped"
    operation, params = sfn.by_token()["token-dd-late"]
    assert (operation, params["error"]) == ("failure", "DedupJobFailed")
    assert "dedup job sdf-dd-late-r0-a0" in params["cause"]
    assert counts["stopped"] == 1


def test_reconciler_resolves_training_job_whose_event_was_missed_before_its_deadline(
    mocked_aws: AwsWorld, sfn: Resolutions
) -> None:
    create_training_job(mocked_aws, "sdf-tr-missed-a0")  # moto completes jobs at once
    claim("sdf-tr-missed-a0", "token-missed", "training", deadline_in=LEAD - 60)
    counts = reconcile()
    operation, params = sfn.by_token()["token-missed"]
    assert operation == "success"
    output = json.loads(params["output"])
    assert output["job_name"] == "sdf-tr-missed-a0"
    assert output["model_data_url"].endswith("sdf-tr-missed-a0/output/model.tar.gz")
    assert counts == {
        "checked": 1, "resolved": 1, "pending": 0, "vanished": 0, "stopped": 0, "runs_closed": 0, "errors": 0
    }  # fmt: skip
    assert TokenStore(TOKEN_TABLE).get("sdf-tr-missed-a0") is None


def test_reconciler_normal_path_makes_no_sagemaker_call(
    mocked_aws: AwsWorld, sfn: Resolutions, sagemaker_calls: list[str]
) -> None:
    # 50 shards in flight, their events on time: nothing is due, nothing is described.
    for index in range(50):
        create_processing_job(mocked_aws, f"sdf-dl-run-{index:05d}-r0-a0")
        claim(f"sdf-dl-run-{index:05d}-r0-a0", f"token-{index}", "download", deadline_in=LEAD + 600)
    sagemaker_calls.clear()
    counts = reconcile()
    assert sagemaker_calls == []
    assert sfn.calls == []
    assert counts["checked"] == 0


def test_reconciler_running_job_before_its_deadline_is_left_alone(
    mocked_aws: AwsWorld, sfn: Resolutions, sagemaker_calls: list[str]
) -> None:
    create_processing_job(mocked_aws, "sdf-dl-running-00000-r0-a0")
    set_status("sdf-dl-running-00000-r0-a0", "InProgress")
    claim("sdf-dl-running-00000-r0-a0", "token-running", "download", deadline_in=LEAD - 60)
    sagemaker_calls.clear()
    counts = reconcile()
    assert sfn.calls == []
    assert sagemaker_calls == ["DescribeProcessingJob"]
    assert counts == {
        "checked": 1, "resolved": 0, "pending": 1, "vanished": 0, "stopped": 0, "runs_closed": 0, "errors": 0
    }  # fmt: skip
    assert TokenStore(TOKEN_TABLE).get("sdf-dl-running-00000-r0-a0") is not None


def test_reconciler_job_running_past_its_deadline_is_stopped_and_its_task_failed(
    mocked_aws: AwsWorld, sfn: Resolutions
) -> None:
    create_processing_job(mocked_aws, "sdf-dl-late-00000-r0-a0")
    set_status("sdf-dl-late-00000-r0-a0", "InProgress")
    claim("sdf-dl-late-00000-r0-a0", "token-late", "download", deadline_in=-30)
    counts = reconcile()
    job = mocked_aws.sagemaker.describe_processing_job(ProcessingJobName="sdf-dl-late-00000-r0-a0")
    assert job["ProcessingJobStatus"] == "Stopped"
    operation, params = sfn.by_token()["token-late"]
    assert (operation, params["error"]) == ("failure", "DownloadJobFailed")
    assert "outlived its task" in params["cause"]
    assert counts["stopped"] == 1
    assert TokenStore(TOKEN_TABLE).get("sdf-dl-late-00000-r0-a0") is None


def test_reconciler_training_job_past_its_deadline_is_stopped(
    mocked_aws: AwsWorld, sfn: Resolutions, monkeypatch: pytest.MonkeyPatch
) -> None:
    create_training_job(mocked_aws, "sdf-tr-late-r0-a0")
    set_status("sdf-tr-late-r0-a0", "InProgress")
    claim("sdf-tr-late-r0-a0", "token-late", "training", deadline_in=-30)
    stops: list[str] = []
    # moto 5.2.5 has no StopTrainingJob.
    monkeypatch.setattr(aws.client("sagemaker"), "stop_training_job", lambda **kw: stops.append(kw["TrainingJobName"]))
    reconcile()
    assert stops == ["sdf-tr-late-r0-a0"]
    assert sfn.by_token()["token-late"][1]["error"] == "TrainingJobFailed"


def test_reconciler_training_job_with_a_warm_pool_past_its_deadline_is_stopped_and_its_warm_pool_ended(
    mocked_aws: AwsWorld, sfn: Resolutions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32 item 3: a stopped training job keeps its warm pool (billed); the task timed out,
    so nothing will use it, and the run's cleanup will not see the job (its claim goes here)."""
    create_training_job(mocked_aws, "sdf-tr-warm-r0-a0", keep_alive_seconds=900)
    set_status("sdf-tr-warm-r0-a0", "InProgress")
    claim("sdf-tr-warm-r0-a0", "token-warm", "training", deadline_in=-30)
    updates: list[dict[str, Any]] = []
    client = aws.client("sagemaker")
    monkeypatch.setattr(client, "stop_training_job", lambda **kw: {})  # moto 5.2.5 has no StopTrainingJob
    monkeypatch.setattr(client, "update_training_job", lambda **kw: updates.append(kw) or {})  # nor UpdateTrainingJob

    reconcile()

    assert updates == [{"TrainingJobName": "sdf-tr-warm-r0-a0", "ResourceConfig": {"KeepAlivePeriodInSeconds": 0}}]


def test_reconciler_warm_pool_end_refused_the_task_is_answered_and_the_refusal_reported(
    mocked_aws: AwsWorld, sfn: Resolutions, monkeypatch: pytest.MonkeyPatch
) -> None:
    create_training_job(mocked_aws, "sdf-tr-warm-r0-a0", keep_alive_seconds=900)
    set_status("sdf-tr-warm-r0-a0", "InProgress")
    claim("sdf-tr-warm-r0-a0", "token-warm", "training", deadline_in=-30)
    client = aws.client("sagemaker")
    monkeypatch.setattr(client, "stop_training_job", lambda **kw: {})

    def throttled(**kw: Any) -> Any:
        raise ClientError({"Error": {"Code": "ThrottlingException", "Message": "Rate exceeded"}}, "UpdateTrainingJob")

    monkeypatch.setattr(client, "update_training_job", throttled)

    with pytest.raises(ReconcileIncomplete, match="warm pool may still be billed"):
        reconcile()
    assert sfn.by_token()["token-warm"][1]["error"] == "TrainingJobFailed"


def test_reconciler_endpoint_still_changing_past_its_deadline_keeps_its_claim(
    mocked_aws: AwsWorld, sfn: Resolutions, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        aws.client("sagemaker"),
        "describe_endpoint",
        lambda **_kw: {"EndpointName": "sdflow", "EndpointStatus": "Updating", "EndpointConfigName": "old"},
    )
    context = {"endpoint_config_name": "sdflow-dep-a0", "model_name": "sdflow-dep-a0", "action": "update"}
    claim("sdflow", "token-endpoint", "endpoint", deadline_in=-30, context=context)
    counts = reconcile()
    assert sfn.calls == []
    assert counts["pending"] == 1
    assert TokenStore(TOKEN_TABLE).get("sdflow") is not None, "its settling event rolls the update back"


def test_reconciler_fails_task_whose_job_vanished(mocked_aws: AwsWorld, sfn: Resolutions) -> None:
    claim("sdf-dl-ghost-00000-r0-a0", "token-ghost", "download", deadline_in=-30)
    counts = reconcile()
    operation, params = sfn.by_token()["token-ghost"]
    assert (operation, params["error"]) == ("failure", "DownloadJobFailed")
    assert "vanished" in params["cause"]
    assert counts["vanished"] == 1
    assert TokenStore(TOKEN_TABLE).get("sdf-dl-ghost-00000-r0-a0") is None


def test_reconciler_resolves_endpoint_through_describe(mocked_aws: AwsWorld, sfn: Resolutions) -> None:
    sm = mocked_aws.sagemaker
    sm.create_model(
        ModelName="sdflow-dep-a0",
        PrimaryContainer={"Image": TRAINING_IMAGE_URI, "ModelDataUrl": "s3://b/m.tar.gz"},
        ExecutionRoleArn=SAGEMAKER_ROLE_ARN,
    )
    sm.create_endpoint_config(
        EndpointConfigName="sdflow-dep-a0",
        ProductionVariants=[
            {"VariantName": "AllTraffic", "ModelName": "sdflow-dep-a0", "InitialInstanceCount": 1,
             "InstanceType": "ml.m5.large"}
        ],
    )  # fmt: skip
    sm.create_endpoint(EndpointName="sdflow", EndpointConfigName="sdflow-dep-a0")
    context = {"endpoint_config_name": "sdflow-dep-a0", "model_name": "sdflow-dep-a0", "action": "create"}
    claim("sdflow", "token-endpoint", "endpoint", deadline_in=LEAD - 60, context=context)
    reconcile()
    operation, params = sfn.by_token()["token-endpoint"]
    assert operation == "success"
    assert json.loads(params["output"])["endpoint_config_name"] == "sdflow-dep-a0"


def test_reconciler_one_broken_claim_does_not_block_the_others(
    mocked_aws: AwsWorld, sfn: Resolutions, monkeypatch: pytest.MonkeyPatch
) -> None:
    create_training_job(mocked_aws, "sdf-tr-ok-a0")
    claim("sdf-tr-ok-a0", "token-ok", "training", deadline_in=-30)
    claim("sdf-dl-broken-00000-a0", "token-broken", "download", deadline_in=-30)

    def access_denied(**_kwargs: Any) -> None:
        raise ClientError({"Error": {"Code": "AccessDeniedException", "Message": "no"}}, "DescribeProcessingJob")

    monkeypatch.setattr(aws.client("sagemaker"), "describe_processing_job", access_denied)
    with pytest.raises(ReconcileIncomplete, match="sdf-dl-broken-00000-a0"):
        reconcile()
    assert sfn.by_token()["token-ok"][0] == "success"
    assert "token-broken" not in sfn.by_token()


def _model_package(world: AwsWorld, status: str) -> str:
    world.sagemaker.create_model_package_group(ModelPackageGroupName="sdf-cats")
    return str(
        world.sagemaker.create_model_package(
            ModelPackageGroupName="sdf-cats",
            InferenceSpecification={
                "Containers": [{"Image": TRAINING_IMAGE_URI, "ModelDataUrl": f"s3://{DATA_BUCKET}/m.tar.gz"}],
                "SupportedContentTypes": ["application/json"],
                "SupportedResponseMIMETypes": ["image/png"],
            },
            ModelApprovalStatus=status,
        )["ModelPackageArn"]
    )


def test_reconciler_approval_decided_while_its_event_was_lost_answers_the_task(
    mocked_aws: AwsWorld, sfn: Resolutions
) -> None:
    arn = _model_package(mocked_aws, "Approved")
    claim(arn, "token-approved", "approval", deadline_in=LEAD - 60)

    counts = reconcile()

    operation, params = sfn.by_token()["token-approved"]
    assert operation == "success"
    assert json.loads(params["output"])["model_package_arn"] == arn
    assert counts["resolved"] == 1
    assert TokenStore(TOKEN_TABLE).get(arn) is None


def test_reconciler_approval_still_pending_past_its_deadline_drops_the_claim(
    mocked_aws: AwsWorld, sfn: Resolutions
) -> None:
    arn = _model_package(mocked_aws, "PendingManualApproval")
    claim(arn, "token-pending", "approval", deadline_in=-30)

    counts = reconcile()

    operation, params = sfn.by_token()["token-pending"]
    assert (operation, params["error"]) == ("failure", "ModelRejected")
    assert "still PendingManualApproval" in params["cause"]
    assert counts["stopped"] == 1
    assert TokenStore(TOKEN_TABLE).get(arn) is None
    described = mocked_aws.sagemaker.describe_model_package(ModelPackageName=arn)
    assert described["ModelApprovalStatus"] == "PendingManualApproval", "nobody decided: the package is left as it is"


def test_reconciler_training_job_ended_long_before_its_deadline_answers_the_task_at_once(
    mocked_aws: AwsWorld, sfn: Resolutions
) -> None:
    """A lost "Completed" event of a training job: the run does not wait a day for the deadline's lead."""
    create_training_job(mocked_aws, "sdf-tr-early-a0")  # moto completes jobs at once
    claim("sdf-tr-early-a0", "token-early", "training", deadline_in=86_400)
    claim("sdf-dl-early-00000-r0-a0", "token-dl", "download", deadline_in=86_400)

    counts = reconcile()

    assert sfn.by_token()["token-early"][0] == "success"
    assert "token-dl" not in sfn.by_token(), "downloads wait for their deadline's lead"
    assert counts["checked"] == 1


def test_reconciler_stopped_run_whose_last_claim_the_pass_settles_still_gets_its_end_handled(
    mocked_aws: AwsWorld, sfn: Resolutions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run was stopped and its end event lost; its training job has ended since. The pass
    settles the job's claim, and the lost end is found from the claims as they were before it."""
    create_training_job(mocked_aws, "sdf-tr-stopped-a0")  # moto completes jobs at once
    claim("sdf-tr-stopped-a0", "token-stopped", "training", deadline_in=86_400)
    ended = {
        "executionArn": EXECUTION_ARN,
        "stateMachineArn": EXECUTION_ARN.replace(":execution:", ":stateMachine:").rsplit(":", 1)[0],
        "name": RUN_ID,
        "status": "ABORTED",
        "startDate": datetime.fromtimestamp(time.time() - 7200, tz=UTC),  # boto3 parses dates
        "stopDate": datetime.fromtimestamp(time.time() - 900, tz=UTC),
    }
    monkeypatch.setattr(aws.client("stepfunctions"), "describe_execution", lambda **_kw: ended)
    invoked: list[dict[str, Any]] = []
    monkeypatch.setattr(aws.client("lambda"), "invoke", lambda **kw: invoked.append(kw) or {"StatusCode": 202})

    counts = reconcile()

    assert TokenStore(TOKEN_TABLE).get("sdf-tr-stopped-a0") is None, "the pass settled the claim"
    assert counts["runs_closed"] == 1
    [call] = invoked
    assert call["FunctionName"] == "sdflow-test-NotifyFunction"
    assert json.loads(call["Payload"])["detail"]["status"] == "ABORTED"


def test_reconciler_succeeded_run_without_claims_whose_end_event_was_lost_gets_its_notice(
    mocked_aws: AwsWorld, sfn: Resolutions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32 item 3: a run that succeeded holds no claims, so the claims alone never showed
    that its end event was lost; the pass lists the pipeline's recently ended executions too."""
    ended = {
        "executionArn": EXECUTION_ARN,
        "stateMachineArn": STATE_MACHINE_ARN,
        "name": RUN_ID,
        "status": "SUCCEEDED",
        "startDate": datetime.fromtimestamp(time.time() - 7200, tz=UTC),
        "stopDate": datetime.fromtimestamp(time.time() - 900, tz=UTC),
        "output": "{}",
    }
    listed: list[dict[str, Any]] = []
    client = aws.client("stepfunctions")
    monkeypatch.setattr(client, "list_executions", lambda **kw: listed.append(kw) or {"executions": [ended]})
    monkeypatch.setattr(client, "describe_execution", lambda **_kw: ended)
    invoked: list[dict[str, Any]] = []
    monkeypatch.setattr(aws.client("lambda"), "invoke", lambda **kw: invoked.append(kw) or {"StatusCode": 202})

    counts = reconcile()

    assert listed[0]["stateMachineArn"] == STATE_MACHINE_ARN
    assert counts["runs_closed"] == 1
    [call] = invoked
    assert json.loads(call["Payload"])["detail"]["status"] == "SUCCEEDED"
