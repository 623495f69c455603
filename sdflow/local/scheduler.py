"""Scheduled rules and EventBridge Scheduler schedules, fired on their schedule.

moto records rules with a ScheduleExpression and Scheduler schedules but never fires them.
`ScheduleRunner` does, from a clock: `fire_due(now)` delivers every occurrence due by `now`, and
`start()` runs it in a background thread on the local cloud's clock (sdflow/local/clock.py), so a
scaled clock compresses `rate(10 minutes)` into seconds and `Clock.advance` brings the next
occurrence at once.

What a target receives, as AWS sends it:
- A scheduled rule (events:PutRule ScheduleExpression): the target's Input / InputPath /
  InputTransformer applied to {"version": "0", "id": <uuid>, "detail-type": "Scheduled Event",
  "source": "aws.events", "account", "time", "region", "resources": [<rule ARN>], "detail": {}}
  (EventBridge user guide, "Creating a rule that runs on a schedule").
- A Scheduler schedule: its Target.Input exactly; with no Input, Scheduler's "default
  notification" (API reference, Target.Input): {"version": "0", "id", "detail-type": "Scheduled
  Event", "source": "aws.scheduler", "account", "time", "region", "resources": [<schedule ARN>],
  "detail": "{}"} - detail is the string "{}" (as Powertools' EventBridgeModel and
  tests/events/eventBridgeSchedulerEvent.json record it). Lambda targets are invoked
  asynchronously, state machines get a StartExecution, SQS queues a message.

Expressions: rate(N minute|minutes|hour|hours|day|days), cron(min hour dom month dow year) with
AWS's fields (dow 1-7 = SUN-SAT, `?`, L, W, #; evaluated by croniter, the year field filtered
here) in ScheduleExpressionTimezone, and at(yyyy-mm-ddThh:mm:ss). A rate's first occurrence is
one period after the runner first sees it."""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from zoneinfo import ZoneInfo

from sdflow.local.clock import REAL_TIME, Clock

log = logging.getLogger(__name__)

RATE_UNITS = {"minute": 60, "minutes": 60, "hour": 3600, "hours": 3600, "day": 86400, "days": 86400}


class ScheduleExpressionError(ValueError):
    """The ScheduleExpression is not a rate(), cron() or at() expression AWS accepts."""


@dataclass(frozen=True)
class Expression:
    text: str
    timezone: str = "UTC"

    def next_after(self, moment: dt.datetime, first_seen: dt.datetime) -> dt.datetime | None:
        """The first occurrence strictly after `moment` (None: no more occurrences)."""
        kind, body = _split(self.text)
        if kind == "rate":
            period = dt.timedelta(seconds=_rate_seconds(body, self.text))
            elapsed = max(moment - first_seen, dt.timedelta(0))
            return first_seen + period * (elapsed // period + 1)
        if kind == "at":
            at = dt.datetime.fromisoformat(body).replace(tzinfo=ZoneInfo(self.timezone))
            return at if at > moment else None
        return _cron_next(body, moment.astimezone(ZoneInfo(self.timezone)), self.text)


def _split(text: str) -> tuple[str, str]:
    match = re.fullmatch(r"\s*(rate|cron|at)\((.*)\)\s*", text or "")
    if not match:
        raise ScheduleExpressionError(
            f"ScheduleExpression {text!r} is not valid: use rate(10 minutes), cron(0 12 * * ? *) or "
            "at(2030-01-01T00:00:00)"
        )
    return match.group(1), match.group(2).strip()


def _rate_seconds(body: str, text: str) -> int:
    match = re.fullmatch(r"(\d+)\s+([a-z]+)", body)
    if not match or match.group(2) not in RATE_UNITS or int(match.group(1)) < 1:
        raise ScheduleExpressionError(f"ScheduleExpression {text!r} is not valid: rate(<positive number> <unit>)")
    value, unit = int(match.group(1)), match.group(2)
    if (value == 1) != (not unit.endswith("s")):  # AWS: rate(1 minute), rate(5 minutes)
        raise ScheduleExpressionError(f"ScheduleExpression {text!r} is not valid: say 1 {unit.rstrip('s')}")
    return value * RATE_UNITS[unit]


def _cron_next(body: str, moment: dt.datetime, text: str) -> dt.datetime | None:
    from croniter import croniter

    fields = body.split()
    if len(fields) != 6:
        raise ScheduleExpressionError(f"ScheduleExpression {text!r} is not valid: cron() takes 6 fields")
    minute, hour, dom, month, dow, year = fields
    # AWS numbers days of the week 1-7 from Sunday; croniter 0-6.
    dow = re.sub(r"(?<![#\d])([1-7])(?![\d])", lambda m: str(int(m.group(1)) - 1), dow)
    expr = " ".join("*" if f == "?" else f for f in (minute, hour, dom, month, dow))
    if not croniter.is_valid(expr):
        raise ScheduleExpressionError(f"ScheduleExpression {text!r} is not valid")
    years = _years(year, text)
    it = croniter(expr, moment)
    for _ in range(10_000):
        candidate: dt.datetime = it.get_next(dt.datetime)
        if years is None or candidate.year in years:
            return candidate
        if years and candidate.year > max(years):
            return None
    return None


def _years(field: str, text: str) -> set[int] | None:
    if field in ("*", "?"):
        return None
    years: set[int] = set()
    for part in field.split(","):
        match = re.fullmatch(r"(\d{4})(?:-(\d{4}))?", part)
        if not match:
            raise ScheduleExpressionError(f"ScheduleExpression {text!r} is not valid: year field {field!r}")
        years.update(range(int(match.group(1)), int(match.group(2) or match.group(1)) + 1))
    return years


def _iso(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Due:
    expression: Expression
    first_seen: dt.datetime
    next_at: dt.datetime | None


class ScheduleRunner:
    """Fires due scheduled rules and schedules of one account and region (thread-safe)."""

    def __init__(self, account: str, region: str, *, clock: Clock = REAL_TIME) -> None:
        self.account, self.region, self.clock = account, region, clock
        self.fired: list[tuple[str, str]] = []  # (ARN, time) of each delivery, for tests and diagnostics
        self._due: dict[str, _Due] = {}
        self._invalid: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def now(self) -> dt.datetime:
        """The local cloud's clock."""
        return self.clock.now()

    def fire_due(self, now: dt.datetime) -> list[str]:
        """Deliver every occurrence due by `now`; the ARNs delivered, in order."""
        delivered = []
        with self._lock:
            for arn, expression, deliver in self._enabled():
                try:
                    delivered += self._fire_one(arn, expression, deliver, now)
                except ScheduleExpressionError as exc:
                    if arn not in self._invalid:  # moto accepted it; say so once, not every tick
                        self._invalid.add(arn)
                        log.error("schedule %s never fires: %s", arn, exc)
        return delivered

    def _fire_one(
        self, arn: str, expression: Expression, deliver: Callable[[dt.datetime], None], now: dt.datetime
    ) -> list[str]:
        due = self._due.get(arn)
        if due is None or due.expression != expression:
            due = self._due[arn] = _Due(expression, now, expression.next_after(now, now))
        if due.next_at is None or due.next_at > now:
            return []
        # A clock advanced past several occurrences delivers the latest one once: replaying a day
        # of a 10-minute schedule would only repeat the same work 144 times.
        latest = due.next_at
        while (following := expression.next_after(latest, due.first_seen)) is not None and following <= now:
            latest = following
        self._deliver(arn, deliver, latest)
        due.next_at = expression.next_after(latest, due.first_seen)
        return [arn]

    def fire_all(self) -> list[str]:
        """Deliver every enabled rule and schedule once, now (a manual trigger)."""
        with self._lock:
            targets = list(self._enabled())
        now = self.now()
        for arn, _expression, deliver in targets:
            self._deliver(arn, deliver, now)
        return [arn for arn, _expression, _deliver in targets]

    def start(self, tick_s: float = 0.25) -> None:
        """Look for due occurrences every `tick_s` of real time (a scaled clock may have moved
        further: the latest occurrence due is delivered once)."""

        def loop() -> None:
            while not self._stop.wait(tick_s):
                try:
                    self.fire_due(self.now())
                except Exception:  # one bad schedule must not stop the others' clock
                    log.exception("scheduled delivery failed")

        self._thread = threading.Thread(target=loop, name="sdflow-schedules", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _deliver(self, arn: str, deliver: Callable[[dt.datetime], None], at: dt.datetime) -> None:
        self.fired.append((arn, _iso(at)))
        try:
            deliver(at)
        except Exception:  # delivery is asynchronous on AWS: log, keep the schedule going
            log.exception("scheduled delivery of %s failed", arn)

    def _enabled(self) -> Iterator[tuple[str, Expression, Callable[[dt.datetime], None]]]:
        from moto.events.models import events_backends
        from moto.scheduler.models import scheduler_backends

        for bus in list(events_backends[self.account][self.region].event_buses.values()):
            for rule in list(bus.rules.values()):
                if rule.scheduled_expression and rule.state == "ENABLED":
                    yield rule.arn, Expression(rule.scheduled_expression), self._rule_delivery(rule)
        for group in list(scheduler_backends[self.account][self.region].schedule_groups.values()):
            for schedule in list(group.schedules.values()):
                if schedule.state == "ENABLED":
                    expression = Expression(schedule.schedule_expression, schedule.schedule_expression_timezone)
                    yield schedule.arn, expression, self._schedule_delivery(schedule)

    def _rule_delivery(self, rule: Any) -> Callable[[dt.datetime], None]:
        def deliver(at: dt.datetime) -> None:
            event = self._event("aws.events", rule.arn, at, {})
            # In moto's internal form (epoch `time`, `ingestion-time`): its own targets (SQS, logs)
            # need it, and events.rule_send_to_targets shapes it as AWS sends it for Lambda/States.
            event["time"] = event["ingestion-time"] = at.timestamp()
            rule.send_to_targets(event)

        return deliver

    def _schedule_delivery(self, schedule: Any) -> Callable[[dt.datetime], None]:
        def deliver(at: dt.datetime) -> None:
            target = schedule.target
            if "Input" in target:
                payload = str(target["Input"])
            else:
                payload = json.dumps(self._event("aws.scheduler", schedule.arn, at, "{}"))
            _send(str(target["Arn"]), payload)

        return deliver

    def _event(self, source: str, arn: str, at: dt.datetime, detail: Any) -> dict[str, Any]:
        return {
            "version": "0",
            "id": str(uuid.uuid4()),
            "detail-type": "Scheduled Event",
            "source": source,
            "account": self.account,
            "time": _iso(at),
            "region": self.region,
            "resources": [arn],
            "detail": detail,
        }


def _send(arn: str, payload: str) -> None:
    """A Scheduler templated target: Lambda (asynchronous Invoke), Step Functions, SQS."""
    _, _, service, region, account, rest = arn.split(":", 5)
    if service == "lambda":
        from moto.awslambda.utils import get_backend

        from sdflow.local.services.awslambda import invoke_function_async

        invoke_function_async(get_backend(account, region).get_function(arn), payload.encode())
    elif service == "states":
        from moto.stepfunctions.responses import get_backend as sfn_backend

        sfn_backend(account, region).start_execution(arn, name=str(uuid.uuid4()), execution_input=payload)
    elif service == "sqs":
        from moto.sqs.models import sqs_backends

        sqs_backends[account][region].send_message(rest, payload)
    else:
        log.warning("schedule target %s: only Lambda, Step Functions and SQS targets run locally", arn)
