"""`sdflow resume`: a new execution with the old input (or a new manifest) plus `resume_from`."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import pytest

from sdflow import progress
from sdflow.cli import parse_args
from sdflow.runs import resume_name, start_resume
from sdflow.session import CliError, Session
from tests.constants import ACCOUNT, REGION
from tests.unit.helpers import DATA_BUCKET, STATE_MACHINE_ARN, AwsWorld

OLD_DOCUMENT = {
    "dataset": {"prefix": f"s3://{DATA_BUCKET}/datasets/laion/"},
    "base_model_uri": f"s3://{DATA_BUCKET}/models/sd/",
}


@pytest.fixture
def session(mocked_aws: AwsWorld) -> Session:
    mocked_aws.sfn.create_state_machine(
        name=STATE_MACHINE_ARN.rsplit(":", 1)[-1],
        definition=json.dumps({"StartAt": "P", "States": {"P": {"Type": "Pass", "End": True}}}),
        roleArn=f"arn:aws:iam::{ACCOUNT}:role/sfn",
    )
    return Session(
        client=lambda name: boto3.client(name, region_name=REGION),  # type: ignore[call-overload]
        bucket=DATA_BUCKET,
        state_machine_arn=STATE_MACHINE_ARN,
    )


def start(session: Session, name: str, document: dict[str, Any], *, stop: bool = True) -> str:
    sfn = session.client("stepfunctions")
    arn = str(
        sfn.start_execution(stateMachineArn=STATE_MACHINE_ARN, name=name, input=json.dumps(document))["executionArn"]
    )
    if stop:
        sfn.stop_execution(executionArn=arn)
    return arn


def input_of(session: Session, arn: str) -> dict[str, Any]:
    return dict(json.loads(session.client("stepfunctions").describe_execution(executionArn=arn)["input"]))


def test_resume_starts_execution_with_old_input_and_resume_from(session: Session) -> None:
    old = start(session, "cats-v1", OLD_DOCUMENT)

    new = start_resume(session, "cats-v1")

    assert input_of(session, new) == {**OLD_DOCUMENT, "resume_from": old}
    assert new.rsplit(":", 1)[-1].startswith("cats-v1-resume-")
    assert new.rsplit(":", 2)[0] == old.rsplit(":", 2)[0]  # the same state machine


def test_resume_with_manifest_uses_new_document_and_given_name(session: Session, tmp_path: Path) -> None:
    old = start(session, "cats-v1", OLD_DOCUMENT)
    changed = {**OLD_DOCUMENT, "training": {"learning_rate": 0.0001}, "resume_from": "stale"}
    manifest = tmp_path / "run-v2.json"
    manifest.write_text(json.dumps(changed))

    new = start_resume(session, old, manifest=manifest, name="cats-v2")

    assert new.endswith(":cats-v2")
    assert input_of(session, new) == {**changed, "resume_from": old}


def test_resume_of_resumed_run_points_at_it(session: Session) -> None:
    first = start(session, "cats-v1", OLD_DOCUMENT)
    second = start(session, "cats-v1-resume-20250602T091543", {**OLD_DOCUMENT, "resume_from": first})

    new = start_resume(session, second, name="third")

    assert input_of(session, new)["resume_from"] == second


def test_resume_of_running_execution_is_refused_before_starting_anything(session: Session) -> None:
    start(session, "cats-v1", OLD_DOCUMENT, stop=False)
    with pytest.raises(CliError, match=r"cats-v1 is RUNNING.*stop-execution"):
        start_resume(session, "cats-v1")
    executions = session.client("stepfunctions").list_executions(stateMachineArn=STATE_MACHINE_ARN)["executions"]
    assert len(executions) == 1


def test_resume_with_unreadable_manifest_is_cli_error(session: Session, tmp_path: Path) -> None:
    start(session, "cats-v1", OLD_DOCUMENT)
    manifest = tmp_path / "broken.json"
    manifest.write_text("[1, 2]")
    with pytest.raises(CliError, match="not a JSON object"):
        start_resume(session, "cats-v1", manifest=manifest)
    with pytest.raises(CliError, match="cannot read a run document"):
        start_resume(session, "cats-v1", manifest=tmp_path / "missing.json")


def test_resume_unknown_execution_name_is_cli_error(session: Session) -> None:
    with pytest.raises(CliError, match="no execution 'nope'"):
        start_resume(session, "nope")


def test_resume_name_replaces_earlier_suffix_and_fits_80_characters() -> None:
    now = datetime(2025, 6, 2, 9, 15, 43, tzinfo=UTC)
    assert resume_name("cats-v1", now) == "cats-v1-resume-20250602T091543"
    assert resume_name("cats-v1-resume-20250101T000000", now) == "cats-v1-resume-20250602T091543"
    long = resume_name("x" * 80, now)
    assert len(long) == 80
    assert long.endswith("-resume-20250602T091543")


def test_resume_command_line_parses() -> None:
    args = parse_args(["resume", "cats-v1", "--manifest", "run.json", "--name", "cats-v2"])
    assert (args.execution, args.manifest, args.name) == ("cats-v1", Path("run.json"), "cats-v2")


def test_progress_counts_reused_shards_as_done(mocked_aws: AwsWorld) -> None:
    arn = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:{STATE_MACHINE_ARN.rsplit(':', 1)[-1]}:new"
    mocked_aws.put_json(
        "runs/new/shards.json",
        [
            {"shard_id": "00000", "output_uri": f"s3://{DATA_BUCKET}/runs/old/dataset/shards/00000/", "cached": True},
            {"shard_id": "00001", "output_uri": f"s3://{DATA_BUCKET}/runs/new/dataset/shards/00001/", "cached": False},
            {"shard_id": "00002", "output_uri": f"s3://{DATA_BUCKET}/runs/new/dataset/shards/00002/", "cached": False},
        ],
    )
    mocked_aws.put_json("runs/new/dataset/shards/00001/_SUCCESS", {"samples": 1})
    snap = progress.Progress(execution_arn=arn, status="RUNNING", states={"Download shards": "running"})

    progress._shards(mocked_aws.s3, DATA_BUCKET, "new", snap)

    assert (snap.shards_done, snap.shards_reused, snap.shards_total) == (2, 1, 3)
    assert progress.state_lines(snap)["Download shards"].endswith("2/3 shards downloaded (1 reused)")
