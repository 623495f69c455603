"""template.yaml: how the asynchronously invoked functions retry, and what concurrency they keep
(issue 23 item 9). EventBridge's RetryPolicy retries only a failed delivery; once Lambda has
queued an event, a failing handler gets EventInvokeConfig's retries and a throttled event waits up
to its MaximumEventAgeInSeconds, then the function's dead-letter queue."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sdflow.local.template import load_template

TEMPLATE = Path(__file__).resolve().parents[2] / "template.yaml"
# Lambda's ranges (PutFunctionEventInvokeConfig): retries 0-2, event age 60 s to 6 hours.
MAX_RETRIES = 2
MAX_EVENT_AGE = 21_600
# Invoked asynchronously by their rules or schedule, and notify also by the reconciler.
ASYNC_FUNCTIONS = ("StartPipelineFunction", "JobEventsFunction", "NotifyFunction", "ReconcilerFunction")
EVENT_SOURCES = {"EventBridgeRule", "ScheduleV2", "Schedule", "CloudWatchEvent", "S3", "SNS"}


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    return load_template(TEMPLATE)


def functions(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: resource["Properties"]
        for name, resource in template["Resources"].items()
        if resource["Type"] == "AWS::Serverless::Function"
    }


def test_template_every_asynchronously_invoked_function_is_listed(template: dict[str, Any]) -> None:
    invoked_by_events = {
        name
        for name, properties in functions(template).items()
        if any(event["Type"] in EVENT_SOURCES for event in (properties.get("Events") or {}).values())
    }
    assert invoked_by_events <= set(ASYNC_FUNCTIONS)


@pytest.mark.parametrize("function", ASYNC_FUNCTIONS)
def test_template_async_function_sets_its_retries_event_age_and_dead_letter_queue(
    template: dict[str, Any], function: str
) -> None:
    properties = functions(template)[function]
    config = properties["EventInvokeConfig"]
    assert 0 <= config["MaximumRetryAttempts"] <= MAX_RETRIES
    assert 60 <= config["MaximumEventAgeInSeconds"] <= MAX_EVENT_AGE
    assert properties["DeadLetterQueue"]["Type"] == "SQS"


@pytest.mark.parametrize("function", ["JobEventsFunction", "NotifyFunction"])
def test_template_job_events_and_notify_keep_a_throttled_event_as_long_as_lambda_allows(
    template: dict[str, Any], function: str
) -> None:
    """A burst of download starters may take the account's concurrency for a while: their events
    must wait in Lambda's queue, not be dropped, and a raising handler is retried (both idempotent)."""
    config = functions(template)[function]["EventInvokeConfig"]
    assert config == {"MaximumRetryAttempts": MAX_RETRIES, "MaximumEventAgeInSeconds": MAX_EVENT_AGE}


def test_template_reconciler_pass_is_neither_retried_nor_kept_past_its_period(template: dict[str, Any]) -> None:
    properties = functions(template)["ReconcilerFunction"]
    period_s = 10 * 60
    assert properties["Events"]["Every10Minutes"]["Properties"]["ScheduleExpression"] == "rate(10 minutes)"
    assert properties["EventInvokeConfig"] == {"MaximumRetryAttempts": 0, "MaximumEventAgeInSeconds": period_s}


def test_template_reserved_concurrency_is_off_by_default_so_a_new_account_deploys(template: dict[str, Any]) -> None:
    """Lambda refuses any reservation in an account whose quota is under 100 + the reservation (a new
    account's can be 10): only job_events and notify reserve, and only when the parameter asks."""
    parameter = template["Parameters"]["EventFunctionsReservedConcurrency"]
    assert parameter["Default"] == 0
    assert template["Conditions"]["ReservesEventFunctionsConcurrency"] == {
        "Fn::Not": [{"Fn::Equals": [{"Ref": "EventFunctionsReservedConcurrency"}, 0]}]
    }
    reserving = {
        name: properties["ReservedConcurrentExecutions"]
        for name, properties in functions(template).items()
        if "ReservedConcurrentExecutions" in properties
    }
    expected = {
        "Fn::If": [
            "ReservesEventFunctionsConcurrency",
            {"Ref": "EventFunctionsReservedConcurrency"},
            {"Ref": "AWS::NoValue"},
        ]
    }
    assert reserving == {"JobEventsFunction": expected, "NotifyFunction": expected}
    # A reservation of 0 would throttle every invocation: 0 must mean "none", never reach Lambda.
    assert "ReservedConcurrentExecutions" not in template.get("Globals", {}).get("Function", {})
