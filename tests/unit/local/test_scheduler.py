"""Scheduled rules and EventBridge Scheduler schedules fire on schedule and deliver what AWS sends."""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

import pytest

from sdflow.local import runtime as runtime_module
from sdflow.local import scheduler
from sdflow.local.clock import Clock
from tests.constants import ACCOUNT, REGION
from tests.unit.local.helpers import ROLE, client, records, wait_for

T0 = dt.datetime(2030, 1, 7, 12, 0, 30, tzinfo=dt.UTC)  # a Monday


def _queue(name: str) -> tuple[str, str]:
    url = str(client("sqs").create_queue(QueueName=name)["QueueUrl"])
    return url, f"arn:aws:sqs:{REGION}:{ACCOUNT}:{name}"


def _bodies(url: str) -> list[Any]:
    messages = client("sqs").receive_message(QueueUrl=url, MaxNumberOfMessages=10).get("Messages", [])
    return [json.loads(m["Body"]) for m in messages]


def test_rate_fires_each_period_after_first_seen() -> None:
    expression = scheduler.Expression("rate(10 minutes)")
    assert expression.next_after(T0, T0) == T0 + dt.timedelta(minutes=10)
    later = T0 + dt.timedelta(minutes=25)
    assert expression.next_after(later, T0) == T0 + dt.timedelta(minutes=30)


def test_cron_uses_aws_fields_days_and_years() -> None:
    weekdays_noon = scheduler.Expression("cron(0 12 ? * 2-6 *)")  # AWS: 2-6 = MON-FRI
    assert weekdays_noon.next_after(T0, T0) == dt.datetime(2030, 1, 8, 12, 0, tzinfo=dt.UTC)
    sundays = scheduler.Expression("cron(0 8 ? * 1 *)")  # AWS: 1 = SUN
    assert sundays.next_after(T0, T0) == dt.datetime(2030, 1, 13, 8, 0, tzinfo=dt.UTC)
    assert scheduler.Expression("cron(0 8 * * ? 2029)").next_after(T0, T0) is None
    local = scheduler.Expression("cron(0 9 * * ? *)", "Europe/Paris").next_after(T0, T0)
    assert local is not None
    assert local.astimezone(dt.UTC) == dt.datetime(2030, 1, 8, 8, 0, tzinfo=dt.UTC)


@pytest.mark.parametrize("text", ["rate(0 minutes)", "rate(1 minutes)", "rate(5 minute)", "cron(0 12 * * ?)", "daily"])
def test_invalid_expression_names_the_fix(text: str) -> None:
    with pytest.raises(scheduler.ScheduleExpressionError, match=r"ScheduleExpression .* is not valid"):
        scheduler.Expression(text).next_after(T0, T0)


def test_schedule_without_input_delivers_scheduler_default_notification(runtime: runtime_module.Runtime) -> None:
    url, arn = _queue("reconcile")
    client("scheduler").create_schedule(
        Name="every10",
        ScheduleExpression="rate(10 minutes)",
        FlexibleTimeWindow={"Mode": "OFF"},
        Target={"Arn": arn, "RoleArn": ROLE},
    )
    runner = scheduler.ScheduleRunner(ACCOUNT, REGION)
    assert runner.fire_due(T0) == []
    assert runner.fire_due(T0 + dt.timedelta(minutes=9)) == []
    schedule_arn = f"arn:aws:scheduler:{REGION}:{ACCOUNT}:schedule/default/every10"
    assert runner.fire_due(T0 + dt.timedelta(minutes=10)) == [schedule_arn]
    # A clock that jumps past several occurrences delivers the latest one once, not each of them.
    assert runner.fire_due(T0 + dt.timedelta(minutes=45)) == [schedule_arn]
    assert runner.fire_due(T0 + dt.timedelta(minutes=49)) == []
    assert runner.fire_due(T0 + dt.timedelta(minutes=50)) == [schedule_arn]
    first, second, third = _bodies(url)
    assert len({first["id"], second["id"], third["id"]}) == 3
    assert [second["time"], third["time"]] == ["2030-01-07T12:40:30Z", "2030-01-07T12:50:30Z"]
    assert {k: v for k, v in first.items() if k != "id"} == {
        "version": "0",
        "detail-type": "Scheduled Event",
        "source": "aws.scheduler",
        "account": ACCOUNT,
        "time": "2030-01-07T12:10:30Z",
        "region": REGION,
        "resources": [schedule_arn],
        "detail": "{}",
    }
    from aws_lambda_powertools.utilities.parser.models import EventBridgeModel

    assert EventBridgeModel.model_validate(first).detail == {}, "what the reconciler's handler parses"


def test_schedule_input_reaches_lambda_exactly(
    runtime: runtime_module.Runtime, function_arn: str, tmp_path: Path
) -> None:
    client("scheduler").create_schedule(
        Name="with-input",
        ScheduleExpression="cron(* * * * ? *)",
        FlexibleTimeWindow={"Mode": "OFF"},
        Target={"Arn": function_arn, "RoleArn": ROLE, "Input": json.dumps({"record": True, "older_than": 900})},
    )
    runner = scheduler.ScheduleRunner(ACCOUNT, REGION)
    runner.fire_due(T0)
    assert runner.fire_due(T0 + dt.timedelta(seconds=31)) == [
        f"arn:aws:scheduler:{REGION}:{ACCOUNT}:schedule/default/with-input"
    ]
    recorded = wait_for(lambda: records(tmp_path / "events.jsonl"), what="the scheduled invocation")
    assert recorded == [{"record": True, "older_than": 900}]


def test_scheduled_rule_delivers_scheduled_event(runtime: runtime_module.Runtime) -> None:
    url, arn = _queue("rule-target")
    events = client("events")
    rule_arn = events.put_rule(Name="hourly", ScheduleExpression="rate(1 hour)")["RuleArn"]
    events.put_targets(Rule="hourly", Targets=[{"Id": "q", "Arn": arn}])
    runner = scheduler.ScheduleRunner(ACCOUNT, REGION)
    runner.fire_due(T0)
    assert runner.fire_due(T0 + dt.timedelta(hours=1)) == [rule_arn]
    [event] = _bodies(url)
    assert (event["source"], event["detail-type"], event["resources"], event["detail"]) == (
        "aws.events",
        "Scheduled Event",
        [rule_arn],
        {},
    )


def test_disabled_rule_does_not_fire(runtime: runtime_module.Runtime) -> None:
    client("events").put_rule(Name="off", ScheduleExpression="rate(1 minute)", State="DISABLED")
    runner = scheduler.ScheduleRunner(ACCOUNT, REGION)
    runner.fire_due(T0)
    assert runner.fire_due(T0 + dt.timedelta(hours=1)) == []


def test_schedules_on_scaled_clock_fire_rate_schedule_in_real_seconds(runtime: runtime_module.Runtime) -> None:
    url, arn = _queue("fast")
    client("scheduler").create_schedule(
        Name="fast",
        ScheduleExpression="rate(10 minutes)",
        FlexibleTimeWindow={"Mode": "OFF"},
        Target={"Arn": arn, "RoleArn": ROLE, "Input": '{"n": 1}'},
    )
    runner = scheduler.ScheduleRunner(ACCOUNT, REGION, clock=Clock(scale=1200.0))  # 10 minutes in 0.5 s
    runner.start(tick_s=0.05)
    try:
        assert wait_for(lambda: _bodies(url), what="the scheduled message") == [{"n": 1}]
    finally:
        runner.stop()


def test_schedules_on_advanced_clock_fire_once_per_period(runtime: runtime_module.Runtime) -> None:
    url, arn = _queue("advanced")
    client("scheduler").create_schedule(
        Name="advanced",
        ScheduleExpression="rate(1 hour)",
        FlexibleTimeWindow={"Mode": "OFF"},
        Target={"Arn": arn, "RoleArn": ROLE, "Input": '{"n": 2}'},
    )
    clock = Clock()  # real speed: only advance() moves it an hour
    runner = scheduler.ScheduleRunner(ACCOUNT, REGION, clock=clock)
    runner.start(tick_s=0.05)
    try:
        time.sleep(0.2)
        assert _bodies(url) == []
        clock.advance(3600)
        assert wait_for(lambda: _bodies(url), what="the scheduled message") == [{"n": 2}]
    finally:
        runner.stop()
