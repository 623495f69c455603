"""template.yaml and statemachines/pipeline.asl.json checked together (the linters and SAM: test_template_tools.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis.strategies import from_regex

from sdflow.local.template import load_template
from tests.unit.template_policies import (
    ENDPOINT_PREFIX,
    PIPELINE,
    STACK,
    all_states,
    allows,
    policy_statements,
    resolve_sub,
    template_resources,
)

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "template.yaml"
ASL = ROOT / "statemachines" / "pipeline.asl.json"
TOOLS = ROOT / ".tools"
# Actions that AWS offers on "*" only; everything else must name its resources.
STAR_ONLY_ACTIONS = {
    "ecr:GetAuthorizationToken",
    "cloudwatch:PutMetricData",
    "logs:CreateLogDelivery",
    "logs:GetLogDelivery",
    "logs:UpdateLogDelivery",
    "logs:DeleteLogDelivery",
    "logs:ListLogDeliveries",
    "logs:PutResourcePolicy",
    "logs:DescribeResourcePolicies",
    "logs:DescribeLogGroups",
}
READ_ONLY_PREFIXES = ("Describe", "Get", "List")
# sagemaker 3.27.0: sagemaker.core.helper.iam_role_resolver._get_smoke_test_actions("training"), what the
# SDK simulates on '*' before it lets a role run a training job (docs/notebooks).
SDK_TRAINING_ROLE_CHECK = (
    "ecr:GetAuthorizationToken",
    "cloudwatch:PutMetricData",
    "ec2:CreateNetworkInterface",
    "ec2:CreateNetworkInterfacePermission",
    "ec2:DeleteNetworkInterface",
    "ec2:DeleteNetworkInterfacePermission",
    "ec2:DescribeNetworkInterfaces",
    "ec2:DescribeVpcs",
    "ec2:DescribeDhcpOptions",
    "ec2:DescribeSubnets",
    "ec2:DescribeSecurityGroups",
)


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    return load_template(TEMPLATE)


@pytest.fixture(scope="module")
def definition() -> dict[str, Any]:
    return json.loads(ASL.read_text())


def test_template_definition_substitutions_cover_every_placeholder(
    template: dict[str, Any], definition: dict[str, Any]
) -> None:
    [machine] = template_resources(template, "AWS::Serverless::StateMachine").values()
    substitutions = set(machine["Properties"]["DefinitionSubstitutions"])
    placeholders = set(re.findall(r"\$\{(\w+)\}", ASL.read_text()))
    assert placeholders == substitutions
    for key in substitutions:
        assert re.fullmatch(r"[A-Z][A-Za-z]+(Arn|Name)", key), key


def test_template_definition_hard_codes_no_arn_and_avoids_sync_and_jsonata(definition: dict[str, Any]) -> None:
    text = ASL.read_text()
    assert not re.search(r"arn:aws:(lambda|sagemaker|sns|s3):", text)
    assert ".sync" not in text
    assert definition.get("QueryLanguage", "JSONPath") == "JSONPath"


def test_template_callback_tasks_time_out_and_carry_the_execution_identity(definition: dict[str, Any]) -> None:
    states = all_states(definition["States"])
    callbacks = {n: s for n, s in states.items() if str(s.get("Resource", "")).endswith(".waitForTaskToken")}
    assert set(callbacks) == {
        "Download shard",
        "Find duplicates",
        "Train model",
        "Evaluate model",
        "Wait for approval",
        "Deploy endpoint",
    }
    for name, state in callbacks.items():
        assert "TimeoutSecondsPath" in state or "TimeoutSeconds" in state, name
        payload = state["Parameters"]["Payload"]
        assert payload["token.$"] == "$$.Task.Token", name
        assert payload["attempt.$"] == "$$.State.RetryCount", name
        # Job names hash the execution ARN and start time, and carry the redrive count.
        assert {"execution_arn.$", "start_time.$", "redrive_count.$", "timeout_seconds.$"} <= set(payload), name


def test_template_no_state_catches_so_a_failed_step_can_be_redriven(definition: dict[str, Any]) -> None:
    """A caught failure ends its state successfully, and redrive-execution re-runs only the
    unsuccessful states: notifications and cleanup come from the execution's status event."""
    states = all_states(definition["States"])
    assert {name for name, state in states.items() if state.get("Catch")} == set()
    assert not [name for name, state in states.items() if state["Type"] == "Fail"]
    assert definition["States"]["Download shards"]["ToleratedFailurePercentagePath"] == (
        "$.config.run.download.tolerated_failure_percent"
    )


@pytest.mark.parametrize(
    "state",
    [
        "Validate run",
        "Download shard",
        "Find duplicates",
        "Build dataset index",
        "Train model",
        "Evaluate model",
        "Register model",
        "Wait for approval",
        "Deploy endpoint",
    ],
)
def test_template_every_lambda_task_retries_a_crashed_runtime(definition: dict[str, Any], state: str) -> None:
    retried = {error for r in all_states(definition["States"])[state]["Retry"] for error in r["ErrorEquals"]}
    assert {"Runtime.ExitError", "Lambda.Unknown", "Lambda.ServiceException"} <= retried


def test_template_execution_status_rule_notifies_and_cleans_up(template: dict[str, Any]) -> None:
    events = template["Resources"]["NotifyFunction"]["Properties"]["Events"]
    [rule] = [e["Properties"] for e in events.values() if e["Type"] == "EventBridgeRule"]
    pattern = rule["Pattern"]
    assert pattern["source"] == ["aws.states"]
    assert pattern["detail-type"] == ["Step Functions Execution Status Change"]
    assert set(pattern["detail"]["status"]) == {"SUCCEEDED", "FAILED", "TIMED_OUT", "ABORTED"}


def test_template_distributed_map_reads_shards_from_s3_and_discards_results(definition: dict[str, Any]) -> None:
    download = definition["States"]["Download shards"]
    assert download["ItemProcessor"]["ProcessorConfig"]["Mode"] == "DISTRIBUTED"
    assert download["ItemReader"]["Resource"] == "arn:aws:states:::s3:getObject"
    assert download["ResultPath"] is None
    assert download["MaxConcurrencyPath"] == "$.config.run.download.max_concurrency"


def test_template_distributed_map_writes_child_results_to_the_runs_prefix(definition: dict[str, Any]) -> None:
    # Without a ResultWriter every child's output is collected into the Map's result, even with
    # ResultPath null, and past 256 KiB the run fails with States.DataLimitExceeded.
    writer = definition["States"]["Download shards"]["ResultWriter"]
    assert writer["Resource"] == "arn:aws:states:::s3:putObject"
    assert writer["Parameters"]["Bucket"] == "${DataBucketName}"
    assert writer["Parameters"]["Prefix.$"] == "States.Format('runs/{}/download-results', $$.Execution.Name)"


def test_template_map_children_return_empty_objects(definition: dict[str, Any]) -> None:
    children = definition["States"]["Download shards"]["ItemProcessor"]["States"]
    ends = {name: state for name, state in children.items() if state.get("End")}
    assert set(ends) == {"Download shard", "Reuse downloaded shard"}
    for name, state in ends.items():
        assert "OutputPath" in state, f"{name} must return {{}}"
        assert state["OutputPath"] is None, f"{name} must return {{}}"


def test_template_max_shards_fit_even_an_inline_map_result(template: dict[str, Any]) -> None:
    max_shards = template["Parameters"]["MaxShards"]
    assert max_shards["MinValue"] <= max_shards["Default"] == 10_000 <= max_shards["MaxValue"]
    # {} per child, ", " between them (the roomier of the two JSON spellings)
    inline_result = json.dumps([{}] * max_shards["MaxValue"])
    assert len(inline_result.encode()) < 256 * 1024


@pytest.mark.parametrize("state", ["Download shard", "Find duplicates", "Train model", "Deploy endpoint"])
def test_template_quota_errors_retry_for_hours_apart_from_throttling(definition: dict[str, Any], state: str) -> None:
    retriers = all_states(definition["States"])[state]["Retry"]
    [quota] = [r for r in retriers if "SageMakerQuotaExceeded" in r["ErrorEquals"]]
    [throttle] = [r for r in retriers if "SageMakerThrottled" in r["ErrorEquals"]]
    assert quota["ErrorEquals"] == ["SageMakerQuotaExceeded"]
    assert quota["JitterStrategy"] == "FULL"
    waits = [
        min(quota["MaxDelaySeconds"], quota["IntervalSeconds"] * quota["BackoffRate"] ** attempt)
        for attempt in range(quota["MaxAttempts"])
    ]
    assert sum(waits) / 2 >= 4 * 3600, "full jitter halves the mean wait: still hours for a held quota"
    assert sum(waits) >= 8 * 3600
    assert quota["IntervalSeconds"] >= 30, "a quota frees when jobs end, not within seconds"
    throttle_waits = [
        min(throttle["MaxDelaySeconds"], throttle["IntervalSeconds"] * throttle["BackoffRate"] ** attempt)
        for attempt in range(throttle["MaxAttempts"])
    ]
    assert sum(throttle_waits) < sum(waits) / 4


def test_template_retried_and_caught_error_names_exist(definition: dict[str, Any]) -> None:
    from sdflow_common import errors

    named = {
        error
        for state in all_states(definition["States"]).values()
        for handler in state.get("Retry", []) + state.get("Catch", [])
        for error in handler["ErrorEquals"]
        if not error.startswith(("States.", "Lambda.", "Runtime."))
    }
    assert named
    assert all(isinstance(getattr(errors, name, None), type) for name in named), named


def test_template_functions_have_code_and_thin_handlers(template: dict[str, Any]) -> None:
    functions = template_resources(template, "AWS::Serverless::Function")
    assert len(functions) == 13
    for name, function in functions.items():
        code = ROOT / function["Properties"]["CodeUri"]
        handler = code / "app.py"
        assert handler.exists(), f"{name}: {handler} is missing"
        assert (code / "requirements.txt").exists(), name
        body = [line for line in handler.read_text().splitlines() if line.strip()]
        assert len(body) < 80, f"{name}: keep the handler thin, logic belongs in the layer"
        assert "POWERTOOLS_SERVICE_NAME" in function["Properties"]["Environment"]["Variables"], name


def test_template_state_machine_logs_and_traces(template: dict[str, Any]) -> None:
    [machine] = template_resources(template, "AWS::Serverless::StateMachine").values()
    props = machine["Properties"]
    assert props["Tracing"]["Enabled"] is True
    assert props["Logging"]["Level"] == "ALL"


def test_template_bucket_is_private_encrypted_versioned_and_emits_events(template: dict[str, Any]) -> None:
    bucket = template["Resources"]["DataBucket"]["Properties"]
    assert bucket["NotificationConfiguration"]["EventBridgeConfiguration"]["EventBridgeEnabled"] is True
    assert all(bucket["PublicAccessBlockConfiguration"].values())
    assert bucket["VersioningConfiguration"]["Status"] == "Enabled"
    assert bucket["BucketEncryption"]["ServerSideEncryptionConfiguration"]
    [deny] = template["Resources"]["DataBucketPolicy"]["Properties"]["PolicyDocument"]["Statement"]
    assert deny["Effect"] == "Deny"
    assert deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}


def test_template_manifest_rule_matches_only_json_under_manifests(template: dict[str, Any]) -> None:
    event = template["Resources"]["StartPipelineFunction"]["Properties"]["Events"]["ManifestUploaded"]
    pattern = event["Properties"]["Pattern"]
    assert pattern["detail-type"] == ["Object Created"]
    assert pattern["detail"]["object"]["key"] == [{"wildcard": "manifests/*.json"}]


def test_template_pass_role_only_for_sagemaker_role_to_sagemaker(template: dict[str, Any]) -> None:
    pass_role = [(n, s) for n, s in policy_statements(template) if "iam:PassRole" in json.dumps(s.get("Action"))]
    assert {n for n, _ in pass_role} == {
        "StartDownloadFunction",
        "FindDuplicatesFunction",
        "StartTrainingFunction",
        "StartEvaluationFunction",
        "DeployEndpointFunction",
    }
    for name, statement in pass_role:
        assert statement["Resource"] == {"Fn::GetAtt": ["SageMakerExecutionRole", "Arn"]}, name
        assert statement["Condition"] == {"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}}


@pytest.mark.parametrize("function", ["JobEventsFunction", "ReconcilerFunction"])
@pytest.mark.parametrize("action", ["states:SendTaskSuccess", "states:SendTaskFailure"])
def test_template_task_tokens_of_map_children_can_be_answered(
    template: dict[str, Any], function: str, action: str
) -> None:
    assert allows(template, function, action, PIPELINE)
    # A Distributed Map child runs as an execution of "<state machine>/<Map Run label>".
    assert allows(template, function, action, f"{PIPELINE}/Download-shards")
    assert allows(template, function, action, f"{PIPELINE}/3f1c2a9e-0000-4000-8000-000000000000")
    for other in (f"{PIPELINE}-v2", f"{PIPELINE}2/Download-shards", PIPELINE.replace(STACK, "other")):
        assert not allows(template, function, action, other), other


def test_template_only_token_resolvers_may_send_task_results(template: dict[str, Any]) -> None:
    senders = {n for n, s in policy_statements(template) if "states:SendTask" in json.dumps(s.get("Action"))}
    # Wait for approval answers at once a package decided before its token was parked.
    assert senders == {"JobEventsFunction", "ReconcilerFunction", "AwaitApprovalFunction"}


def test_template_state_machine_may_write_map_results_under_runs(template: dict[str, Any]) -> None:
    manifest = "arn:aws:s3:::sdflow-data/runs/run-1/download-results/4c3a/manifest.json"
    for action in ("s3:PutObject", "s3:GetObject", "s3:ListMultipartUploadParts", "s3:AbortMultipartUpload"):
        assert allows(template, "PipelineStateMachine", action, manifest), action
    assert not allows(template, "PipelineStateMachine", "s3:PutObject", "arn:aws:s3:::sdflow-data/manifests/x.json")


def test_template_validate_run_may_read_service_quotas(template: dict[str, Any]) -> None:
    for action in ("servicequotas:ListServiceQuotas", "servicequotas:ListAWSDefaultServiceQuotas"):
        assert allows(template, "ValidateRunFunction", action, "*"), action


@pytest.mark.parametrize(
    ("function", "resource_type", "noun"),
    [
        ("StartDownloadFunction", "processing-job", "ProcessingJob"),
        ("StartTrainingFunction", "training-job", "TrainingJob"),
        ("StartEvaluationFunction", "processing-job", "ProcessingJob"),
    ],
)
def test_template_starters_may_find_stop_and_check_their_jobs(
    template: dict[str, Any], function: str, resource_type: str, noun: str
) -> None:
    job = f"arn:aws:sagemaker:us-east-1:123456789012:{resource_type}/sdf-x-0123456789-r0-a1"
    for action in (f"sagemaker:Describe{noun}", f"sagemaker:Stop{noun}", "sagemaker:ListTags"):
        assert allows(template, function, action, job), action
        assert not allows(template, function, action, job.replace("/sdf-", "/other-")), action
    # Earlier attempts are found by name (Describe), never by listing: no List*Jobs on "*".
    assert not allows(template, function, f"sagemaker:List{noun}s", "*")
    execution = f"arn:aws:states:us-east-1:123456789012:execution:{STACK}-pipeline:run-1"
    assert allows(template, function, "states:DescribeExecution", execution)
    assert not allows(template, function, "states:DescribeExecution", execution.replace(STACK, "other"))


def test_template_reconciler_may_stop_only_sdflow_jobs(template: dict[str, Any]) -> None:
    for resource_type, noun in (("processing-job", "ProcessingJob"), ("training-job", "TrainingJob")):
        job = f"arn:aws:sagemaker:us-east-1:123456789012:{resource_type}/sdf-dl-x-0123456789-00001-r0-a0"
        assert allows(template, "ReconcilerFunction", f"sagemaker:Stop{noun}", job)
        assert not allows(template, "ReconcilerFunction", f"sagemaker:Stop{noun}", job.replace("/sdf-", "/team-"))


def test_template_no_mutating_action_on_star_resource(template: dict[str, Any]) -> None:
    for name, statement in policy_statements(template):
        if statement.get("Effect") != "Allow" or statement.get("Resource") != "*":
            continue
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        for action in actions:
            verb = action.split(":", 1)[1]
            sdk_checked = name == "NotebookExecutionRole" and action in SDK_TRAINING_ROLE_CHECK
            assert action in STAR_ONLY_ACTIONS or verb.startswith(READ_ONLY_PREFIXES) or sdk_checked, (
                f"{name}: {action} on *"
            )


def test_template_notebook_role_passes_the_sdk_role_check_and_pipeline_role_does_not_widen(
    template: dict[str, Any],
) -> None:
    for action in SDK_TRAINING_ROLE_CHECK:
        assert allows(template, "NotebookExecutionRole", action, "*"), action
    assert not allows(template, "SageMakerExecutionRole", "ec2:CreateNetworkInterface", "*")
    bucket = "arn:aws:s3:::sdflow-data"
    assert allows(template, "NotebookExecutionRole", "s3:PutObject", f"{bucket}/notebooks/job/output/model.tar.gz")
    assert not allows(template, "NotebookExecutionRole", "s3:PutObject", f"{bucket}/runs/r/dataset/index.json")


# ------------------------------------------------------------------ external linters
def test_template_job_event_rules_match_the_names_sdflow_gives_jobs(template: dict[str, Any]) -> None:
    from sdflow_common import names

    events = template["Resources"]["JobEventsFunction"]["Properties"]["Events"]
    processing = events["ProcessingJobEnded"]["Properties"]["Pattern"]["detail"]
    training = events["TrainingJobEnded"]["Properties"]["Pattern"]["detail"]
    run_hash = names.run_hash("arn:aws:states:us-east-1:1:execution:p:r", "2026-11-23T16:48:03.123Z")
    download_name = names.download_job_name(run_hash, "r", "00001", 0, 0)
    training_name = names.training_job_name(run_hash, "r", 0, 0)
    assert download_name.startswith(processing["ProcessingJobName"][0]["prefix"])
    assert training_name.startswith(training["TrainingJobName"][0]["prefix"])
    assert (
        set(processing["ProcessingJobStatus"])
        == set(training["TrainingJobStatus"])
        == {
            "Completed",
            "Failed",
            "Stopped",
        }
    )


# ------------------------------------------------------------------ issue 8: log retention, endpoint prefix, redrive
def test_template_every_function_logs_to_its_own_group_kept_log_retention_days(template: dict[str, Any]) -> None:
    functions = template_resources(template, "AWS::Serverless::Function")
    groups = template_resources(template, "AWS::Logs::LogGroup")
    used = []
    for name, function in functions.items():
        ref = function["Properties"].get("LoggingConfig", {}).get("LogGroup")
        assert isinstance(ref, dict), f"{name} has no LoggingConfig.LogGroup"
        assert ref.get("Ref") in groups, f"{name} logs to a group the stack does not create"
        group = groups[ref["Ref"]]["Properties"]
        # Named without the function's own name: the group must exist before the function, or
        # Lambda may create it first (first invocation) and the stack fails with "already exists".
        assert "Fn::Sub" in group["LogGroupName"], name
        assert resolve_sub(group["LogGroupName"]).startswith(f"/aws/lambda/{STACK}-"), name
        assert "${" + name not in group["LogGroupName"]["Fn::Sub"], name
        used.append(ref["Ref"])
    assert len(set(used)) == len(functions), "each function has a group of its own"
    for name, group in groups.items():
        assert group["Properties"]["RetentionInDays"] == {"Ref": "LogRetentionDays"}, name


def test_template_deployed_functions_log_to_the_groups_with_retention(tmp_path: Path) -> None:
    """The template as the local cloud translates it (aws-sam-translator, as `sam deploy` does):
    LoggingConfig reaches AWS::Lambda::Function and each group gets the parameter's retention."""
    from sdflow.local.template import parameter_values, translate

    raw = load_template(TEMPLATE)
    for resource in raw["Resources"].values():  # what packaging does: code in S3, not in folders
        for uri in ("CodeUri", "ContentUri", "DefinitionUri"):
            if uri in resource.get("Properties", {}):
                resource["Properties"][uri] = "s3://artifacts/code.zip"
    values = parameter_values(raw, {"LogRetentionDays": "14"})
    translated = translate(raw, values, region="us-east-1", account_id="123456789012", stack_name=STACK)
    resources = translated["Resources"]
    functions = {n: r for n, r in resources.items() if r["Type"] == "AWS::Lambda::Function"}
    assert functions
    for name, function in functions.items():
        ref = function["Properties"]["LoggingConfig"]["LogGroup"]["Ref"]
        assert resources[ref]["Type"] == "AWS::Logs::LogGroup", name
        assert resources[ref]["Properties"]["RetentionInDays"] == {"Ref": "LogRetentionDays"}
    assert values["LogRetentionDays"] == "14"


ENDPOINT_ARN = "arn:aws:sagemaker:us-east-1:123456789012:{kind}/{name}"
DEPLOY_ACTIONS = {
    "endpoint": ["sagemaker:CreateEndpoint", "sagemaker:UpdateEndpoint", "sagemaker:DescribeEndpoint"],
    "endpoint-config": ["sagemaker:CreateEndpointConfig", "sagemaker:DescribeEndpointConfig"],
    "model": ["sagemaker:CreateModel", "sagemaker:DescribeModel"],
}


@pytest.mark.parametrize("kind", sorted(DEPLOY_ACTIONS))
def test_template_deploy_role_may_touch_only_endpoints_under_the_prefix(template: dict[str, Any], kind: str) -> None:
    for action in DEPLOY_ACTIONS[kind]:
        ours = ENDPOINT_ARN.format(kind=kind, name=f"{ENDPOINT_PREFIX}cats-3f1c2a9e01-r0-a0")
        assert allows(template, "DeployEndpointFunction", action, ours), action
        for other in ("other-team-cats", "cats", f"x{ENDPOINT_PREFIX}cats"):
            assert not allows(template, "DeployEndpointFunction", action, ENDPOINT_ARN.format(kind=kind, name=other))


def test_template_every_endpoint_model_and_config_resource_is_under_the_prefix(template: dict[str, Any]) -> None:
    scoped = 0
    for name, statement in policy_statements(template):
        resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
        for resource in resources:
            text = json.dumps(resource)
            for kind in (":endpoint/", ":endpoint-config/", ":model/"):
                if ":sagemaker:" in text and kind in text:
                    assert kind + "${EndpointNamePrefix}*" in text, f"{name}: {text}"
                    scoped += 1
    assert scoped >= 4  # the deploy role's three and job_events' DescribeEndpoint at least
    assert allows(template, "JobEventsFunction", "sagemaker:DescribeEndpoint", ENDPOINT_ARN.format(
        kind="endpoint", name=f"{ENDPOINT_PREFIX}cats"))  # fmt: skip
    assert not allows(template, "JobEventsFunction", "sagemaker:DescribeEndpoint", ENDPOINT_ARN.format(
        kind="endpoint", name="cats"))  # fmt: skip


def test_template_endpoint_rule_wakes_job_events_only_for_endpoints_under_the_prefix(template: dict[str, Any]) -> None:
    events = template["Resources"]["JobEventsFunction"]["Properties"]["Events"]
    pattern = events["EndpointChanged"]["Properties"]["Pattern"]
    assert pattern["detail"]["EndpointName"] == [{"prefix": {"Ref": "EndpointNamePrefix"}}]


def test_template_endpoint_name_prefix_reaches_every_function_and_settings(
    template: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from sdflow_common.settings import Settings

    variables = template["Globals"]["Function"]["Environment"]["Variables"]
    assert variables["ENDPOINT_NAME_PREFIX"] == {"Ref": "EndpointNamePrefix"}
    monkeypatch.setenv("ENDPOINT_NAME_PREFIX", "team-a-")
    assert Settings.from_env().endpoint_name_prefix == "team-a-"
    monkeypatch.delenv("ENDPOINT_NAME_PREFIX")
    assert Settings.from_env().endpoint_name_prefix == template["Parameters"]["EndpointNamePrefix"]["Default"]


@pytest.mark.parametrize("prefix", ["sdflow", "team-a-", "a", "ml-2024", "x" * 20])
def test_template_endpoint_name_prefix_accepts_lower_case_single_hyphen_prefixes(
    template: dict[str, Any], prefix: str
) -> None:
    parameter = template["Parameters"]["EndpointNamePrefix"]
    assert re.fullmatch(parameter["AllowedPattern"], prefix)
    assert parameter["MinLength"] <= len(prefix) <= parameter["MaxLength"]


@pytest.mark.parametrize("prefix", ["Sdflow", "team--a", "-team", "team_a", "team.a", "", "team a"])
def test_template_endpoint_name_prefix_refuses_what_could_escape_the_iam_scope(
    template: dict[str, Any], prefix: str
) -> None:
    assert not re.fullmatch(template["Parameters"]["EndpointNamePrefix"]["AllowedPattern"], prefix)


PREFIX_PATTERN = load_template(TEMPLATE)["Parameters"]["EndpointNamePrefix"]["AllowedPattern"]


@settings(max_examples=100, deadline=None)
@given(
    prefix=from_regex(r"\A[a-z0-9]{1,8}(-[a-z0-9]{1,5}){0,2}-?\Z"),
    rest=from_regex(r"\A[a-zA-Z0-9](-*[a-zA-Z0-9]){0,25}\Z"),
)
def test_template_names_derived_from_an_endpoint_under_the_prefix_stay_under_it(prefix: str, rest: str) -> None:
    """Model and endpoint-config names are `slug(endpoint name)-<tail>` (sdflow_common.names), and
    SageMaker's ARNs carry names lower-cased: both must still start with the prefix the IAM
    resources name, for every prefix the parameter allows."""
    from sdflow_common import names
    from sdflow_common.run_document import ENDPOINT_NAME

    pattern = PREFIX_PATTERN
    assume(re.fullmatch(pattern, prefix) and len(prefix) <= 20)
    endpoint = prefix + rest
    assume(ENDPOINT_NAME.fullmatch(endpoint) and len(endpoint) <= 48)
    assert names.slug(endpoint, 40).startswith(prefix)
    assert endpoint.lower().startswith(prefix)


def test_template_state_machine_may_redrive_its_map_run_children(template: dict[str, Any]) -> None:
    # "IAM permission to redrive a Map Run" (Step Functions developer guide, "Redriving Map Runs"):
    # states:RedriveExecution on execution:<state machine>/<Map Run label>:<child id>.
    execution = PIPELINE.replace(":stateMachine:", ":execution:")
    child = f"{execution}/Download-shards:5e0d1c2b-0000-4000-8000-000000000000"
    assert allows(template, "PipelineStateMachine", "states:RedriveExecution", child)
    for other in (
        f"{execution}:run-1",  # the parent: redriven by the user, not by the state machine's role
        f"{execution}-v2/Download-shards:5e0d1c2b",
        child.replace(STACK, "other"),
    ):
        assert not allows(template, "PipelineStateMachine", "states:RedriveExecution", other), other


def test_template_jobs_may_delete_only_checkpoints(template: dict[str, Any]) -> None:
    # The trainer prunes its old checkpoints in S3 (SageMaker's checkpoint sync only adds files).
    checkpoint = "arn:aws:s3:::sdflow-data/runs/run-1/checkpoints/sdf-x-r0-a1/checkpoint-00000500/unet/a.safetensors"
    assert allows(template, "SageMakerExecutionRole", "s3:DeleteObject", checkpoint)
    for other in (
        "arn:aws:s3:::sdflow-data/runs/run-1/dataset/shards/00000/00000.tar",
        "arn:aws:s3:::sdflow-data/runs/run-1/model/model.tar.gz",
        "arn:aws:s3:::sdflow-data/manifests/run.json",
    ):
        assert not allows(template, "SageMakerExecutionRole", "s3:DeleteObject", other), other


@pytest.mark.parametrize("role", ["DeployEndpointFunction", "SageMakerExecutionRole"])
def test_template_rollback_alarms_of_an_update_can_be_described(template: dict[str, Any], role: str) -> None:
    # UpdateEndpoint with AutoRollbackConfiguration: SageMaker reads the alarms (cloudwatch:DescribeAlarms).
    alarm = "arn:aws:cloudwatch:us-east-1:123456789012:alarm:sdflow-5xx"
    assert allows(template, role, "cloudwatch:DescribeAlarms", alarm)
