"""Resume: shard cache keys, `resume_from` checks, shard and model reuse, the runs-prefix guard."""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from botocore.stub import Stubber
from moto.stepfunctions import models as sfn_models

from sdflow.local.template import load_template
from sdflow_common import aws, resume
from sdflow_common.errors import InvalidRunDocument
from sdflow_common.run_document import RunDocument
from sdflow_common.validate_run import RunConfig, ValidateRunRequest, validate_run
from tests.constants import ACCOUNT, REGION
from tests.unit.helpers import DATA_BUCKET, STATE_MACHINE_ARN, AwsWorld
from tests.unit.parquet_files import parquet_bytes

PARQUET = parquet_bytes()
MODEL_URI = f"s3://{DATA_BUCKET}/models/tiny-sd/"
START = "2025-06-02T09:15:43.512Z"
# An uncompressed training output: the model's files under a prefix (sdflow_common.model_artifact).
MODEL_PREFIX = "runs/old/training/sdf-tr-old/output/model/"
MODEL_KEY = f"{MODEL_PREFIX}model_index.json"
TRAINING: dict[str, Any] = {
    "job_name": "sdf-tr-old-0123456789-r0-a0",
    "model_data_url": f"s3://{DATA_BUCKET}/{MODEL_PREFIX}",
    "final_metrics": {"train:loss": 0.12},
}
# A model recorded before the training output was uncompressed.
ARCHIVE_KEY = "runs/old/training/sdf-tr-old/output/model.tar.gz"


@pytest.fixture
def world(mocked_aws: AwsWorld) -> AwsWorld:
    mocked_aws.put_json("models/tiny-sd/model_index.json", {"_class_name": "StableDiffusionPipeline"})
    mocked_aws.sfn.create_state_machine(
        name=STATE_MACHINE_ARN.rsplit(":", 1)[-1],
        definition=json.dumps({"StartAt": "P", "States": {"P": {"Type": "Pass", "End": True}}}),
        roleArn=f"arn:aws:iam::{ACCOUNT}:role/sfn",
    )
    return mocked_aws


@pytest.fixture
def histories(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[dict[str, Any]]]:
    """GetExecutionHistory answers per execution ARN (moto answers a canned history for every one)."""
    answers: dict[str, list[dict[str, Any]]] = {}
    original = sfn_models.Execution.get_execution_history

    def history(self: Any, role_arn: str) -> list[dict[str, Any]]:
        if self.execution_arn in answers:
            return answers[self.execution_arn]
        return original(self, role_arn)

    monkeypatch.setattr(sfn_models.Execution, "get_execution_history", history)
    return answers


def training_exit(training: dict[str, Any] | None, state: str = "Train model", event_id: int = 40) -> dict[str, Any]:
    output: dict[str, Any] = {"config": {}, "dataset": {}} | ({"training": training} if training else {})
    return {
        "timestamp": datetime(2025, 6, 2, 10, 0, tzinfo=UTC),
        "type": "TaskStateExited" if state == "Train model" else "PassStateExited",
        "id": event_id,
        "previousEventId": event_id - 1,
        "stateExitedEventDetails": {"name": state, "output": json.dumps(output)},
    }


def put_parquet(world: AwsWorld, *keys: str, body: bytes = PARQUET) -> list[str]:
    for key in keys:
        world.s3.put_object(Bucket=DATA_BUCKET, Key=key, Body=body)
    return [f"s3://{DATA_BUCKET}/{key}" for key in keys]


def document(uris: list[str] | None = None, prefix: str | None = None, **changes: Any) -> dict[str, Any]:
    dataset: dict[str, Any] = {"parquet_uris": uris} if uris is not None else {"prefix": prefix}
    return {"dataset": dataset, "base_model_uri": MODEL_URI, **changes}


def ended_execution(world: AwsWorld, name: str) -> str:
    """An execution of the pipeline that has ended (stopped: ABORTED)."""
    arn = str(world.sfn.start_execution(stateMachineArn=STATE_MACHINE_ARN, name=name, input="{}")["executionArn"])
    world.sfn.stop_execution(executionArn=arn)
    return arn


def execution_arn(name: str) -> str:
    return f"arn:aws:states:{REGION}:{ACCOUNT}:execution:{STATE_MACHINE_ARN.rsplit(':', 1)[-1]}:{name}"


def validate(raw: dict[str, Any], name: str, start_time: str = START) -> dict[str, Any]:
    request = ValidateRunRequest(run=raw, execution_name=name, execution_arn=execution_arn(name), start_time=start_time)
    return validate_run(request, data_bucket=DATA_BUCKET, max_shards=50)


def finish_shards(world: AwsWorld, run_id: str, *positions: int) -> None:
    """What a download job leaves in a shard's folder when it succeeds: the tar, then `_SUCCESS`."""
    for item in world.get_json(f"runs/{run_id}/shards.json"):
        if int(item["shard_id"]) in positions and not item["cached"]:
            folder = item["output_uri"].removeprefix(f"s3://{DATA_BUCKET}/")
            world.s3.put_object(Bucket=DATA_BUCKET, Key=f"{folder}00000.tar", Body=b"tar")
            world.put_json(f"{folder}_SUCCESS", {"samples": 2, "tar_files": ["00000.tar"]})


def shards_of(world: AwsWorld, config: dict[str, Any]) -> list[dict[str, Any]]:
    return list(world.get_json(config["shard_list_key"]))


def problems(caught: pytest.ExceptionInfo[InvalidRunDocument]) -> dict[str, str]:
    return {p["field"]: p["message"] for p in json.loads(str(caught.value))}


def count_calls(operation: str) -> Counter[str]:
    """Counts the functions' S3 calls of one operation, by key."""
    seen: Counter[str] = Counter()
    aws.client("s3").meta.events.register(
        f"provide-client-params.s3.{operation}",
        lambda params, **_: seen.update([params.get("Key") or params.get("Prefix")]),
    )
    return seen


# ------------------------------------------------------------------------------ cache keys


def test_cache_key_changes_when_a_versioned_parquet_object_is_overwritten(world: AwsWorld) -> None:
    world.s3.put_bucket_versioning(Bucket=DATA_BUCKET, VersioningConfiguration={"Status": "Enabled"})
    uris = put_parquet(world, "datasets/a.parquet")
    before = resume.object_identities(uris, None)
    put_parquet(world, "datasets/a.parquet")  # the same bytes, but a new version
    after = resume.object_identities(uris, None)
    assert before[uris[0]].startswith("version:")
    assert before != after


def test_cache_key_of_unversioned_object_follows_its_etag(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    first = resume.object_identities(uris, None)
    put_parquet(world, "datasets/a.parquet")
    assert resume.object_identities(uris, None) == first
    put_parquet(world, "datasets/a.parquet", body=parquet_bytes(rows=3))
    assert resume.object_identities(uris, None) != first


def test_cache_key_prefix_dataset_uses_listing_pages_not_one_head_per_object(
    world: AwsWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    world.s3.put_bucket_versioning(Bucket=DATA_BUCKET, VersioningConfiguration={"Status": "Enabled"})
    monkeypatch.setattr(resume, "LIST_PAGE_SIZE", 2)
    uris = put_parquet(world, *(f"datasets/big/p{i}.parquet" for i in range(5)))
    put_parquet(world, "datasets/big/p0.parquet")  # an older version must not be taken for the latest
    listed_uris = resume.object_identities(uris, None)
    heads = count_calls("HeadObject")
    listed = resume.object_identities(uris, f"s3://{DATA_BUCKET}/datasets/big")
    assert listed == listed_uris
    assert not heads


def test_cache_key_depends_on_content_options_and_columns_only() -> None:
    base = RunDocument.model_validate(document(["s3://bkt/a.parquet"]))
    same = RunDocument.model_validate(
        document(["s3://bkt/a.parquet"], download={"processes": 2, "threads": 4, "max_concurrency": 3})
    )
    assert resume.shard_content_digest(base) == resume.shard_content_digest(same)
    for changed in (
        document(["s3://bkt/a.parquet"], download={"image_size": 512}),
        document(["s3://bkt/a.parquet"], download={"resize_mode": "border"}),
        document(["s3://bkt/a.parquet"], download={"samples_per_shard": 500}),
        {
            **document(["s3://bkt/a.parquet"]),
            "dataset": {"parquet_uris": ["s3://bkt/a.parquet"], "caption_column": "C"},
        },
    ):
        assert resume.shard_content_digest(RunDocument.model_validate(changed)) != resume.shard_content_digest(base)


# ------------------------------------------------------------------------------ resume_from checks


def test_resume_from_other_state_machine_is_invalid_without_describing_it(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    other = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:someone-elses-pipeline:run-1"
    describes = Counter[str]()
    aws.client("stepfunctions").meta.events.register(
        "before-call.states.DescribeExecution", lambda **_: describes.update(["call"])
    )
    with pytest.raises(InvalidRunDocument) as caught:
        validate(document(uris, resume_from=other), "new-run")
    assert "is not an execution of this pipeline" in problems(caught)["resume_from"]
    assert not describes
    assert not world.s3.list_objects_v2(Bucket=DATA_BUCKET, Prefix="runs/new-run/").get("Contents")


def test_resume_from_unknown_execution_is_invalid(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    with pytest.raises(InvalidRunDocument) as caught:
        validate(document(uris, resume_from=execution_arn("never-ran")), "new-run")
    assert "no execution" in problems(caught)["resume_from"]


def test_resume_from_running_execution_is_invalid_naming_stop(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    running = world.sfn.start_execution(stateMachineArn=STATE_MACHINE_ARN, name="busy", input="{}")["executionArn"]
    with pytest.raises(InvalidRunDocument) as caught:
        validate(document(uris, resume_from=running), "new-run")
    message = problems(caught)["resume_from"]
    assert "'busy' is RUNNING" in message
    assert "stop-execution" in message


def test_resume_from_itself_is_invalid(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    with pytest.raises(InvalidRunDocument) as caught:
        validate(document(uris, resume_from=execution_arn("new-run")), "new-run")
    assert "this execution itself" in problems(caught)["resume_from"]


# ------------------------------------------------------------------------------ shard reuse


def test_resume_reuses_finished_shards_and_downloads_the_rest(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/a.parquet", "datasets/b.parquet", "datasets/c.parquet")
    validate(document(uris), "old")
    finish_shards(world, "old", 0, 2)
    old_arn = ended_execution(world, "old")

    config = validate(document(uris, resume_from=old_arn), "new")

    assert config["resume"] == {
        "from_execution_arn": old_arn,
        "shards_reused": 2,
        "shards_total": 3,
        "training_reused": False,
    }
    shards = shards_of(world, config)
    assert [s["cached"] for s in shards] == [True, False, True]
    assert shards[0]["output_uri"] == f"s3://{DATA_BUCKET}/runs/old/dataset/shards/00000/"
    assert shards[1]["output_uri"] == f"s3://{DATA_BUCKET}/runs/new/dataset/shards/00001/"
    assert world.get_json("runs/new/run.json")["resume_from"] == old_arn
    assert RunConfig.model_validate(config).resume is not None  # later tasks parse it back


def test_resume_reads_success_markers_with_one_listing_not_one_head_per_shard(
    world: AwsWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resume, "LIST_PAGE_SIZE", 3)
    uris = put_parquet(world, *(f"datasets/p{i:02d}.parquet" for i in range(8)))
    validate(document(uris), "old")
    finish_shards(world, "old", *range(8))
    old_arn = ended_execution(world, "old")
    heads, lists = count_calls("HeadObject"), count_calls("ListObjectsV2")

    config = validate(document(uris, resume_from=old_arn), "new")

    assert config["resume"]["shards_reused"] == 8
    assert not [key for key in heads if key.endswith("_SUCCESS")]
    assert set(lists) == {"runs/old/dataset/shards/"}


def test_resume_with_changed_download_option_downloads_everything_again(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/a.parquet", "datasets/b.parquet")
    validate(document(uris), "old")
    finish_shards(world, "old", 0, 1)
    old_arn = ended_execution(world, "old")

    config = validate(document(uris, resume_from=old_arn, download={"image_size": 512}), "new")

    assert config["resume"]["shards_reused"] == 0
    assert not any(s["cached"] for s in shards_of(world, config))


def test_resume_after_parquet_overwrite_downloads_that_shard_again(world: AwsWorld) -> None:
    world.s3.put_bucket_versioning(Bucket=DATA_BUCKET, VersioningConfiguration={"Status": "Enabled"})
    uris = put_parquet(world, "datasets/a.parquet", "datasets/b.parquet")
    validate(document(uris), "old")
    finish_shards(world, "old", 0, 1)
    old_arn = ended_execution(world, "old")
    put_parquet(world, "datasets/b.parquet")

    config = validate(document(uris, resume_from=old_arn), "new")

    assert [s["cached"] for s in shards_of(world, config)] == [True, False]


def test_resume_chain_points_at_the_run_that_downloaded_each_shard(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/a.parquet", "datasets/b.parquet", "datasets/c.parquet")
    validate(document(uris), "first")
    finish_shards(world, "first", 0)
    first = ended_execution(world, "first")
    validate(document(uris, resume_from=first), "second")
    finish_shards(world, "second", 1)  # shard 0 was reused from "first"; shard 2 failed again
    second = ended_execution(world, "second")

    config = validate(document(uris, resume_from=second), "third")

    outputs = [(s["cached"], s["output_uri"]) for s in shards_of(world, config)]
    assert outputs == [
        (True, f"s3://{DATA_BUCKET}/runs/first/dataset/shards/00000/"),
        (True, f"s3://{DATA_BUCKET}/runs/second/dataset/shards/00001/"),
        (False, f"s3://{DATA_BUCKET}/runs/third/dataset/shards/00002/"),
    ]


def test_resume_from_run_that_failed_before_listing_shards_reuses_nothing(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    old_arn = ended_execution(world, "old")  # its Validate run never wrote shards.json

    config = validate(document(uris, resume_from=old_arn), "new")

    assert config["resume"] == {
        "from_execution_arn": old_arn,
        "shards_reused": 0,
        "shards_total": 1,
        "training_reused": False,
    }


# ------------------------------------------------------------------------------ model reuse


def trained_old_run(
    world: AwsWorld,
    histories: dict[str, list[dict[str, Any]]],
    uris: list[str],
    training: dict[str, Any] = TRAINING,
    key: str = MODEL_KEY,
) -> str:
    validate(document(uris), "old")
    finish_shards(world, "old", *range(len(uris)))
    old_arn = ended_execution(world, "old")
    world.s3.put_object(Bucket=DATA_BUCKET, Key=key, Body=b"model")
    histories[old_arn] = [training_exit(training)]
    return old_arn


def test_resume_reuses_trained_model_when_only_deploy_failed(
    world: AwsWorld, histories: dict[str, list[dict[str, Any]]]
) -> None:
    uris = put_parquet(world, "datasets/a.parquet", "datasets/b.parquet")
    old_arn = trained_old_run(world, histories, uris)

    config = validate(document(uris, resume_from=old_arn, endpoint={"name": "sdflow-other"}), "new")

    assert config["resume"] == {
        "from_execution_arn": old_arn,
        "shards_reused": 2,
        "shards_total": 2,
        "training_reused": True,
        "training": TRAINING,
    }


@pytest.mark.parametrize(
    "change",
    [
        {"training": {"learning_rate": 0.001}},
        {"training": {"seed": 7}},
        {"base_model_uri": f"s3://{DATA_BUCKET}/models/tiny-sd-2/"},
    ],
)
def test_resume_trains_again_when_training_inputs_changed(
    world: AwsWorld, histories: dict[str, list[dict[str, Any]]], change: dict[str, Any]
) -> None:
    world.put_json("models/tiny-sd-2/model_index.json", {"_class_name": "StableDiffusionPipeline"})
    uris = put_parquet(world, "datasets/a.parquet")
    old_arn = trained_old_run(world, histories, uris)

    config = validate({**document(uris, resume_from=old_arn), **change}, "new")

    assert config["resume"]["shards_reused"] == 1
    assert config["resume"]["training_reused"] is False
    assert "training" not in config["resume"]


def test_resume_trains_again_when_model_artifact_is_gone(
    world: AwsWorld, histories: dict[str, list[dict[str, Any]]]
) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    old_arn = trained_old_run(world, histories, uris)
    world.s3.delete_object(Bucket=DATA_BUCKET, Key=MODEL_KEY)

    assert validate(document(uris, resume_from=old_arn), "new")["resume"]["training_reused"] is False


def test_resume_reuses_older_model_tar_gz_while_it_exists(
    world: AwsWorld, histories: dict[str, list[dict[str, Any]]]
) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    training = {**TRAINING, "model_data_url": f"s3://{DATA_BUCKET}/{ARCHIVE_KEY}"}
    old_arn = trained_old_run(world, histories, uris, training, ARCHIVE_KEY)

    assert validate(document(uris, resume_from=old_arn), "new")["resume"]["training"] == training
    world.s3.delete_object(Bucket=DATA_BUCKET, Key=ARCHIVE_KEY)
    assert validate(document(uris, resume_from=old_arn), "new-2")["resume"]["training_reused"] is False


def test_resume_trains_again_when_dataset_grew(world: AwsWorld, histories: dict[str, list[dict[str, Any]]]) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    old_arn = trained_old_run(world, histories, uris)
    more = [*uris, *put_parquet(world, "datasets/b.parquet")]

    config = validate(document(more, resume_from=old_arn), "new")

    assert (config["resume"]["shards_reused"], config["resume"]["training_reused"]) == (1, False)


def test_resume_trains_again_when_earlier_training_never_finished(
    world: AwsWorld, histories: dict[str, list[dict[str, Any]]]
) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    old_arn = trained_old_run(world, histories, uris)
    histories[old_arn] = [training_exit(None, state="Build dataset index")]

    assert validate(document(uris, resume_from=old_arn), "new")["resume"]["training_reused"] is False


def test_resume_chain_reuses_model_a_resumed_run_reused(
    world: AwsWorld, histories: dict[str, list[dict[str, Any]]]
) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    old_arn = trained_old_run(world, histories, uris)
    validate(document(uris, resume_from=old_arn), "second")
    second = ended_execution(world, "second")
    histories[second] = [training_exit(TRAINING, state="Reuse trained model")]

    assert validate(document(uris, resume_from=second), "third")["resume"]["training"] == TRAINING


def test_previous_training_reads_history_newest_first_and_stops_at_the_match(mocked_aws: AwsWorld) -> None:
    sfn = aws.client("stepfunctions")
    arn = execution_arn("old")
    newest = {**TRAINING, "job_name": "sdf-tr-old-0123456789-r1-a0"}
    noise = [{"timestamp": datetime(2025, 6, 2, tzinfo=UTC), "type": "TaskStateEntered", "id": 99}]
    with Stubber(sfn) as stub:
        request = {"executionArn": arn, "reverseOrder": True, "includeExecutionData": True, "maxResults": 1000}
        stub.add_response("get_execution_history", {"events": noise, "nextToken": "t1"}, request)
        stub.add_response(
            "get_execution_history",
            {"events": [training_exit(newest, event_id=80), training_exit(TRAINING)], "nextToken": "t2"},
            {**request, "nextToken": "t1"},
        )
        assert resume.previous_training(arn) == newest
        stub.assert_no_pending_responses()


# ------------------------------------------------------------------------------ runs prefix


def test_run_prefix_of_reused_execution_name_is_invalid(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    validate(document(uris), "cats-v1", start_time="2025-01-01T00:00:00.000Z")
    before = world.get_json("runs/cats-v1/shards.json")

    with pytest.raises(InvalidRunDocument) as caught:
        validate(document(uris), "cats-v1", start_time="2025-06-02T09:15:43.512Z")

    message = problems(caught)["(execution name)"]
    assert "'cats-v1' was used before" in message
    assert "2025-01-01T00:00:00.000Z" in message
    assert "new name" in message
    assert world.get_json("runs/cats-v1/shards.json") == before


def test_run_prefix_of_redriven_execution_passes(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    validate(document(uris), "cats-v1", start_time="2025-06-02T09:15:43.512Z")
    # The same instant spelled with microseconds and an offset: the same execution.
    config = validate(document(uris), "cats-v1", start_time="2025-06-02T09:15:43.512000+00:00")
    assert config["run_id"] == "cats-v1"


def test_run_prefix_with_run_json_of_older_format_is_invalid(world: AwsWorld) -> None:
    uris = put_parquet(world, "datasets/a.parquet")
    world.put_json("runs/cats-v1/run.json", document(uris))  # before run.json named its execution
    with pytest.raises(InvalidRunDocument) as caught:
        validate(document(uris), "cats-v1")
    assert "an earlier execution" in problems(caught)["(execution name)"]


def test_template_lets_validate_run_read_earlier_executions_of_its_pipeline_only() -> None:
    template = load_template(Path(__file__).resolve().parents[2] / "template.yaml")
    policies = template["Resources"]["ValidateRunFunction"]["Properties"]["Policies"]
    statements = [s for policy in policies if isinstance(policy, dict) for s in policy.get("Statement", [])]

    def granted(action: str) -> list[Any]:
        actions = [(s["Action"] if isinstance(s["Action"], list) else [s["Action"]], s["Resource"]) for s in statements]
        return [resource for names, resource in actions if action in names]

    for action in ("states:DescribeExecution", "states:GetExecutionHistory"):
        [resource] = granted(action)
        assert json.dumps(resource).endswith(':execution:${AWS::StackName}-pipeline:*"}'), resource
    assert granted("s3:ListBucketVersions") == granted("s3:ListBucket")
