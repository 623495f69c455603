"""Find duplicates in template.yaml and statemachines/pipeline.asl.json: its states, its function's least
privilege, the job events and the cleanup that reach its jobs (issue 33)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sdflow.local.template import load_template
from sdflow_common import names
from tests.unit.template_policies import PIPELINE, STACK, allows, template_resources

ROOT = Path(__file__).resolve().parents[2]
ACCOUNT_ARN = "arn:aws:sagemaker:us-east-1:123456789012"
RUN_HASH = names.run_hash("arn:aws:states:us-east-1:1:execution:p:r", "2026-11-23T16:48:03.123Z")
DEDUP_JOB = f"{ACCOUNT_ARN}:processing-job/{names.dedup_job_name(RUN_HASH, 'r', 0, 1)}"
OTHER_PROCESSING_JOBS = (
    f"{ACCOUNT_ARN}:processing-job/{names.download_job_name(RUN_HASH, 'r', '00001', 0, 0)}",
    f"{ACCOUNT_ARN}:processing-job/{names.evaluation_job_name(RUN_HASH, 'r', 0, 0)}",
    f"{ACCOUNT_ARN}:processing-job/team-dd-r-{RUN_HASH}-r0-a0",
)


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    return load_template(ROOT / "template.yaml")


@pytest.fixture(scope="module")
def states() -> dict[str, Any]:
    return dict(json.loads((ROOT / "statemachines" / "pipeline.asl.json").read_text())["States"])


def test_template_dedup_states_sit_between_download_and_index(states: dict[str, Any]) -> None:
    assert states["Download shards"]["Next"] == "Check deduplication"
    check = states["Check deduplication"]
    assert check["Type"] == "Choice"
    assert check["Choices"] == [
        {"Variable": "$.config.run.deduplication", "IsPresent": False, "Next": "Build dataset index"},
        {"Variable": "$.config.run.deduplication.enabled", "BooleanEquals": True, "Next": "Find duplicates"},
    ]
    assert check["Default"] == "Build dataset index", "disabled: straight to the index"
    assert states["Find duplicates"]["Next"] == "Build dataset index"


def test_template_find_duplicates_waits_for_its_token_like_evaluate_model(states: dict[str, Any]) -> None:
    find, evaluate = states["Find duplicates"], states["Evaluate model"]
    assert find["Resource"] == "arn:aws:states:::lambda:invoke.waitForTaskToken"
    assert find["Parameters"]["FunctionName"] == "${FindDuplicatesFunctionArn}"
    payload = find["Parameters"]["Payload"]
    assert payload["config.$"] == "$.config"
    assert payload["timeout_seconds.$"] == find["TimeoutSecondsPath"] == "$.config.timeouts.dedup"
    assert find["ResultPath"] == "$.dedup"
    assert find["Retry"] == evaluate["Retry"]
    assert "Catch" not in find, "a failed dedup fails the run, which a redrive resumes at Find duplicates"


def test_template_build_dataset_index_gets_dedup_only_when_the_state_has_it(states: dict[str, Any]) -> None:
    # The whole state ({config} or {config, dedup}): a "dedup.$": "$.dedup" would fail a run that skipped it.
    assert states["Build dataset index"]["Parameters"] == {
        "FunctionName": "${BuildIndexFunctionArn}",
        "Payload.$": "$",
    }
    before = [name for name, state in states.items() if state.get("Next") == "Build dataset index"]
    assert before == ["Find duplicates"], "or the Choice's skip"
    assert states["Validate run"]["ResultPath"] == "$", "the state holds only what the pipeline wrote"


def test_template_state_machine_may_invoke_find_duplicates(template: dict[str, Any]) -> None:
    [machine] = template_resources(template, "AWS::Serverless::StateMachine").values()
    props = machine["Properties"]
    assert props["DefinitionSubstitutions"]["FindDuplicatesFunctionArn"] == {
        "Fn::GetAtt": ["FindDuplicatesFunction", "Arn"]
    }
    invoked = [
        policy["LambdaInvokePolicy"]["FunctionName"] for policy in props["Policies"] if "LambdaInvokePolicy" in policy
    ]
    assert {"Ref": "FindDuplicatesFunction"} in invoked


def test_template_find_duplicates_may_start_and_stop_only_dedup_jobs(template: dict[str, Any]) -> None:
    actions = ["Create", "Describe", "Stop"]
    for action in [f"sagemaker:{verb}ProcessingJob" for verb in actions] + ["sagemaker:AddTags", "sagemaker:ListTags"]:
        assert allows(template, "FindDuplicatesFunction", action, DEDUP_JOB), action
        for other in OTHER_PROCESSING_JOBS:
            assert not allows(template, "FindDuplicatesFunction", action, other), (action, other)
    assert not allows(template, "FindDuplicatesFunction", "sagemaker:ListProcessingJobs", "*")
    assert not allows(template, "FindDuplicatesFunction", "sagemaker:CreateTrainingJob", DEDUP_JOB)
    execution = f"arn:aws:states:us-east-1:123456789012:execution:{STACK}-pipeline:run-1"
    assert allows(template, "FindDuplicatesFunction", "states:DescribeExecution", execution)
    assert not allows(template, "FindDuplicatesFunction", "states:SendTaskSuccess", PIPELINE)


def test_template_find_duplicates_runs_the_download_jobs_image(template: dict[str, Any]) -> None:
    functions = template["Resources"]
    variables = functions["FindDuplicatesFunction"]["Properties"]["Environment"]["Variables"]
    download = functions["StartDownloadFunction"]["Properties"]["Environment"]["Variables"]
    assert variables["TRAINING_IMAGE_URI"] == download["TRAINING_IMAGE_URI"]
    assert "ACCELERATE_IMAGE_URI" not in variables
    assert variables["SAGEMAKER_ROLE_ARN"] == {"Fn::GetAtt": ["SageMakerExecutionRole", "Arn"]}
    policies = functions["FindDuplicatesFunction"]["Properties"]["Policies"]
    assert {"DynamoDBCrudPolicy": {"TableName": {"Ref": "TokenTable"}}} in policies


def test_template_job_role_may_read_shards_and_write_the_dedup_folder(template: dict[str, Any]) -> None:
    bucket = "arn:aws:s3:::sdflow-data"
    for key in ("runs/r/shards.json", "runs/r/dataset/shards/00001/hashes.parquet"):
        assert allows(template, "SageMakerExecutionRole", "s3:GetObject", f"{bucket}/{key}"), key
    for key in ("runs/r/dataset/dedup/summary.json", "runs/r/dataset/dedup/dropped/00001.json"):
        assert allows(template, "SageMakerExecutionRole", "s3:PutObject", f"{bucket}/{key}"), key


def test_template_dedup_job_events_wake_job_events(template: dict[str, Any]) -> None:
    events = template["Resources"]["JobEventsFunction"]["Properties"]["Events"]
    prefixes = [
        p["prefix"] for p in events["ProcessingJobEnded"]["Properties"]["Pattern"]["detail"]["ProcessingJobName"]
    ]
    assert any(DEDUP_JOB.rsplit("/", 1)[1].startswith(prefix) for prefix in prefixes)
    assert f"{names.DEDUP_PREFIX}-" in prefixes


def test_template_run_cleanup_and_reconciler_may_stop_dedup_jobs(template: dict[str, Any]) -> None:
    assert allows(template, "NotifyFunction", "sagemaker:StopProcessingJob", DEDUP_JOB)
    assert allows(template, "ReconcilerFunction", "sagemaker:StopProcessingJob", DEDUP_JOB)
    assert allows(template, "ReconcilerFunction", "sagemaker:DescribeProcessingJob", DEDUP_JOB)
    assert not allows(template, "NotifyFunction", "sagemaker:StopProcessingJob", OTHER_PROCESSING_JOBS[-1])
