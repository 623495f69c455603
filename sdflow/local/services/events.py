"""EventBridge: rules deliver to Lambda and Step Functions targets, events shaped as AWS sends them."""

from __future__ import annotations

import copy
import datetime as dt
import json
import logging
import re
import uuid
from collections.abc import Mapping
from typing import Any

from sdflow.local.patching import Patch, wrap
from sdflow.local.services.awslambda import invoke_function_async

log = logging.getLogger(__name__)


def _iso(value: Any) -> str:
    """An EventBridge timestamp: moto keeps epoch floats, AWS sends ISO-8601 UTC."""
    if isinstance(value, (int, float)):
        value = dt.datetime.fromtimestamp(value, dt.UTC)
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return str(value)


def aws_shaped_event(event: Mapping[str, Any]) -> dict[str, Any]:
    """The event as AWS delivers it: ISO-8601 `time`, no moto-only keys, S3's `etag` spelling.

    moto/s3/notifications.py _send_event_bridge_message writes `eTag` (AWS: `etag`) and an epoch
    `time`; moto/events/models.py put_events adds `ingestion-time`."""
    shaped = copy.deepcopy(dict(event))
    shaped.pop("ingestion-time", None)
    if "time" in shaped:
        shaped["time"] = _iso(shaped["time"])
    obj = shaped.get("detail", {}).get("object") if shaped.get("source") == "aws.s3" else None
    if isinstance(obj, dict) and "eTag" in obj:
        obj.setdefault("etag", obj.pop("eTag"))
    return shaped


def render_target_input(target: Mapping[str, Any], event: dict[str, Any]) -> Any:
    """What a rule target receives: its Input, InputPath or InputTransformer applied to the event."""
    if "Input" in target:
        return json.loads(target["Input"])
    if "InputPath" in target:
        return _json_path(target["InputPath"], event)
    transformer = target.get("InputTransformer")
    if not transformer:
        return event
    return apply_input_transformer(transformer.get("InputTemplate", ""), transformer.get("InputPathsMap", {}), event)


def apply_input_transformer(template: str, paths_map: Mapping[str, str], event: dict[str, Any]) -> Any:
    """EventBridge's InputTransformer: <name> outside a JSON string becomes the value as JSON
    (a string is quoted), inside a string its text. moto/events/utils.py
    EventTemplateParser.parse pastes strings unquoted, which yields invalid JSON for
    `{"key": <key>}`, so the transformer is implemented here."""
    values: dict[str, Any] = {name: _json_path(path, event) for name, path in paths_map.items()}
    values.setdefault("aws.events.event.json", event)
    values.setdefault("aws.events.event.ingestion-time", event.get("time"))
    rendered = _fill_template(template, values, quote_bare=True)
    try:
        return json.loads(rendered)
    except ValueError:
        return _fill_template(template, values, quote_bare=False)  # a plain-text template: text


def _fill_template(template: str, values: Mapping[str, Any], *, quote_bare: bool) -> str:
    out: list[str] = []
    in_string = False
    i = 0
    while i < len(template):
        char = template[i]
        if char == "\\" and in_string:
            out.append(template[i : i + 2])
            i += 2
            continue
        if char == '"':
            in_string = not in_string
        elif char == "<":
            match = re.match(r"<([A-Za-z0-9_.\-]+)>", template[i:])
            if match and match.group(1) in values:
                value = values[match.group(1)]
                text = value if isinstance(value, str) else json.dumps(value)
                if in_string:  # inside a JSON string: the text, escaped for that string
                    out.append(json.dumps(text)[1:-1])
                elif quote_bare:  # a bare JSON value: strings get their quotes
                    out.append(json.dumps(value))
                else:  # plain-text template
                    out.append(text)
                i += match.end()
                continue
        out.append(char)
        i += 1
    return "".join(out)


def _json_path(path: str, document: Any) -> Any:
    """A JSONPath of the simple form EventBridge allows in InputPath ($.a.b, $.a[0])."""
    node = document
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path.removeprefix("$")):
        if part.startswith("["):
            node = node[int(part[1:-1])]
        elif isinstance(node, dict):
            node = node.get(part)
        else:
            return None
    return node


def rule_send_to_targets(inner: Any, self: Any, original_event: dict[str, Any], transform_input: bool = True) -> None:
    """Wraps moto/events/models.py Rule.send_to_targets.

    moto delivers to logs / SQS / event buses / archives / API destinations only and raises
    NotImplementedError("Expr not defined for <class Rule>") for Lambda and Step Functions
    targets (inside a bare `except: pass` when the event comes from S3). Here Lambda targets
    get an asynchronous invocation and state machines a StartExecution, each with the
    target's Input / InputPath / InputTransformer applied to the AWS-shaped event; other
    targets go to moto's own code. A DISABLED rule delivers nothing."""
    if getattr(self, "state", "ENABLED") == "DISABLED" or not self.event_pattern.matches_event(original_event):
        return
    event = aws_shaped_event(original_event)
    others = []
    for target in self.targets:
        arn = str(target.get("Arn", ""))
        service = arn.split(":")[2] if arn.count(":") >= 5 else ""
        if service not in ("lambda", "states"):
            others.append(target)
            continue
        try:
            payload = render_target_input(target, event)
            if service == "lambda":
                from moto.awslambda.utils import get_backend as lambda_backend

                _, _, _, region, account, _rest = arn.split(":", 5)
                fn = lambda_backend(account, region).get_function(arn)
                invoke_function_async(fn, json.dumps(payload).encode())
            else:
                from moto.stepfunctions.responses import get_backend as sfn_backend

                _, _, _, region, account, _rest = arn.split(":", 5)
                sfn_backend(account, region).start_execution(
                    arn, name=str(uuid.uuid4()), execution_input=json.dumps(payload)
                )
        except Exception:
            # EventBridge delivery is asynchronous on AWS too: log, never fail the caller.
            log.exception("rule %s could not deliver to %s", self.name, arn)
    if others:
        saved, self.targets = self.targets, others
        try:
            inner(self, original_event, transform_input)
        finally:
            self.targets = saved


NOT_AUTHORIZED_FOR_SOURCE = {
    "ErrorCode": "NotAuthorizedForSourceException",
    "ErrorMessage": "Not authorized for the source.",
}


def events_put_events(inner: Any, self: Any) -> str:
    """Wraps moto/events/responses.py EventsHandler.put_events.

    Only AWS services publish events whose source starts with "aws."; a caller's entry with such
    a source fails on its own with NotAuthorizedForSourceException (the call succeeds, counts it
    in FailedEntryCount, and the other entries go through). The local cloud's own publishers
    (SageMaker status, S3, Step Functions status) call the events backend directly, as AWS's
    services do, so they are not refused."""
    entries = self._get_param("Entries") or []
    if len(entries) > 10 or not any(str(entry.get("Source", "")).startswith("aws.") for entry in entries):
        return str(inner(self))  # moto validates the count
    allowed = [entry for entry in entries if not str(entry.get("Source", "")).startswith("aws.")]
    published = iter(self.events_backend.put_events(allowed) if allowed else [])
    results = [
        dict(NOT_AUTHORIZED_FOR_SOURCE) if str(entry.get("Source", "")).startswith("aws.") else next(published)
        for entry in entries
    ]
    return json.dumps({"FailedEntryCount": sum("ErrorCode" in r for r in results), "Entries": results})


def publish_as_service(entries: list[dict[str, Any]], account: str, region: str) -> list[dict[str, Any]]:
    """Put events on the default bus as an AWS service does (aws.* sources allowed): the local
    cloud's own publishers, and tests that redeliver a service's event."""
    from moto.events.models import events_backends

    return list(events_backends[account][region].put_events(entries))


def patches() -> list[Patch]:
    from moto.events.models import Rule
    from moto.events.responses import EventsHandler

    return [wrap(Rule, "send_to_targets", rule_send_to_targets), wrap(EventsHandler, "put_events", events_put_events)]
