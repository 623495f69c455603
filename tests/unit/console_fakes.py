"""Fakes for the console's API tests: Step Functions, SageMaker and SageMaker Runtime clients
that record their calls, a history builder, a clock for the console's caches, and a harness
that serves create_app through FastAPI's TestClient (in process, no socket).

S3 and CloudWatch Logs are moto's (tests/unit/conftest.py `mocked_aws`); Step Functions is
faked because moto 5.2.5 has no DescribeStateMachineForExecution, DescribeMapRun or Map Run
events. Every fake fires its `before-call` handlers as a botocore client does, so the console's
Clients counts fake and moto calls alike."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
from botocore.exceptions import ClientError
from fastapi.testclient import TestClient

from sdflow.console import aws as console_aws
from sdflow.console.server import ConsoleConfig, create_app
from tests.constants import ACCOUNT, REGION
from tests.unit.helpers import DATA_BUCKET, STATE_MACHINE_ARN, STATE_MACHINE_NAME

ASL_PATH = Path(__file__).resolve().parents[2] / "statemachines" / "pipeline.asl.json"
ENDPOINT_URL = "http://127.0.0.1:4566"
NOTIFY_LOG_GROUP = "/aws/lambda/sdflow-notify-test"
T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)


def execution_arn(name: str) -> str:
    return f"arn:aws:states:{REGION}:{ACCOUNT}:execution:{STATE_MACHINE_NAME}:{name}"


def map_run_arn(name: str) -> str:
    return f"arn:aws:states:{REGION}:{ACCOUNT}:mapRun:{STATE_MACHINE_NAME}/{name}:0f1e2d3c"


def client_error(code: str, message: str, operation: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message}}, operation)


class _Events:
    def __init__(self) -> None:
        self.handlers: list[Callable[..., Any]] = []

    def register(self, _event_name: str, handler: Callable[..., Any]) -> None:
        self.handlers.append(handler)


class FakeClient:
    """A client whose calls are recorded in `calls` and announced to `meta.events` handlers."""

    service = "fake"

    def __init__(self) -> None:
        self.meta = type("Meta", (), {"events": _Events()})()
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail_with: dict[str, BaseException] = {}  # operation -> what its calls raise

    def _call(self, operation: str, params: dict[str, Any]) -> None:
        for handler in self.meta.events.handlers:
            handler(event_name=f"before-call.{self.service}.{operation}", params=params, model=None)
        self.calls.append((operation, params))
        if operation in self.fail_with:
            raise self.fail_with[operation]

    def called(self, operation: str) -> list[dict[str, Any]]:
        return [params for name, params in self.calls if name == operation]


class History:
    """Events as GetExecutionHistory returns them: ids 1..n, previousEventId chaining a state's events."""

    def __init__(self, start: datetime = T0) -> None:
        self.start = start
        self.events: list[dict[str, Any]] = []

    def add(self, kind: str, previous: int | None = None, **details: Any) -> int:
        event_id = len(self.events) + 1
        event = {"id": event_id, "type": kind, "timestamp": self.start + timedelta(seconds=event_id)}
        event["previousEventId"] = event_id - 1 if previous is None else previous
        event.update(details)
        self.events.append(event)
        return event_id

    def enter(self, name: str, kind: str = "Task", state_input: str = "{}") -> int:
        return self.add(f"{kind}StateEntered", stateEnteredEventDetails={"name": name, "input": state_input})

    def exit(self, name: str, kind: str = "Task", output: str = "{}") -> int:
        return self.add(f"{kind}StateExited", stateExitedEventDetails={"name": name, "output": output})

    def task(self, name: str, state_input: str = "{}", output: str = "{}") -> None:
        self.enter(name, "Task", state_input)
        self.add("TaskScheduled")
        self.add("TaskStarted")
        self.add("TaskSucceeded")
        self.exit(name, "Task", output)


class FakeStepFunctions(FakeClient):
    service = "sfn"

    def __init__(self) -> None:
        super().__init__()
        self.executions: dict[str, dict[str, Any]] = {}
        self.histories: dict[str, list[dict[str, Any]]] = {}
        self.definitions: dict[str, str] = {}
        self.map_runs: dict[str, dict[str, Any]] = {}
        self.children: dict[str, list[dict[str, Any]]] = {}  # Map Run ARN -> its child executions
        self.page_size = 1000  # the most events one GetExecutionHistory page holds

    def add_execution(
        self,
        name: str,
        status: str = "RUNNING",
        start: datetime = T0,
        history: History | None = None,
        definition: str | None = None,
        **extra: Any,
    ) -> str:
        arn = execution_arn(name)
        self.executions[arn] = {
            "executionArn": arn,
            "stateMachineArn": STATE_MACHINE_ARN,
            "name": name,
            "status": status,
            "startDate": start,
            "input": "{}",
            "redriveCount": 0,
            **({"stopDate": start + timedelta(minutes=30)} if status != "RUNNING" else {}),
            **extra,
        }
        self.histories[arn] = (history or History(start)).events
        self.definitions[arn] = definition if definition is not None else ASL_PATH.read_text()
        return arn

    def _execution(self, arn: str, operation: str) -> dict[str, Any]:
        if arn not in self.executions:
            raise client_error("ExecutionDoesNotExist", f"Execution Does Not Exist: '{arn}'", operation)
        return self.executions[arn]

    def add_child(self, map_run: str, name: str, status: str, child_input: Any) -> str:
        """A child execution of the Map Run, as DescribeExecution and ListExecutions(mapRunArn) show it."""
        arn = f"{map_run.replace(':mapRun:', ':execution:', 1)}:{name}"
        start = T0 + timedelta(seconds=20 + len(self.children.get(map_run, [])))
        child = {"executionArn": arn, "mapRunArn": map_run, "name": name, "status": status, "startDate": start,
                 "input": json.dumps(child_input)}  # fmt: skip
        if status != "RUNNING":
            child["stopDate"] = start + timedelta(seconds=3)
        self.children.setdefault(map_run, []).append(child)
        return arn

    def list_executions(self, **params: Any) -> dict[str, Any]:
        self._call("ListExecutions", params)
        if "mapRunArn" in params:
            children = [c for c in self.children.get(params["mapRunArn"], [])
                        if params.get("statusFilter") in (None, c["status"])]  # fmt: skip
            listed = [{k: v for k, v in c.items() if k != "input"} for c in children]
            return {"executions": listed[: params.get("maxResults", 100)]}
        keys = ("executionArn", "stateMachineArn", "name", "status", "startDate", "stopDate", "redriveCount")
        found = [{k: e[k] for k in keys if k in e} for e in self.executions.values()]
        return {"executions": found[: params.get("maxResults", 100)]}

    def describe_execution(self, **params: Any) -> dict[str, Any]:
        self._call("DescribeExecution", params)
        for children in self.children.values():
            found = next((c for c in children if c["executionArn"] == params["executionArn"]), None)
            if found is not None:
                return dict(found)
        return dict(self._execution(params["executionArn"], "DescribeExecution"))

    def describe_state_machine_for_execution(self, **params: Any) -> dict[str, Any]:
        self._call("DescribeStateMachineForExecution", params)
        self._execution(params["executionArn"], "DescribeStateMachineForExecution")
        return {"stateMachineArn": STATE_MACHINE_ARN, "definition": self.definitions[params["executionArn"]]}

    def get_execution_history(self, **params: Any) -> dict[str, Any]:
        self._call("GetExecutionHistory", params)
        self._execution(params["executionArn"], "GetExecutionHistory")
        events = list(self.histories[params["executionArn"]])
        if params.get("reverseOrder"):
            events.reverse()
        offset = int(params.get("nextToken") or 0)
        size = min(params.get("maxResults") or 1000, self.page_size)
        page: dict[str, Any] = {"events": events[offset : offset + size]}
        if offset + size < len(events):
            page["nextToken"] = str(offset + size)
        return page

    def describe_map_run(self, **params: Any) -> dict[str, Any]:
        self._call("DescribeMapRun", params)
        if params["mapRunArn"] not in self.map_runs:
            raise client_error("ResourceNotFound", "Map Run does not exist", "DescribeMapRun")
        return dict(self.map_runs[params["mapRunArn"]])


class FakeSageMaker(FakeClient):
    service = "sagemaker"

    def __init__(self) -> None:
        super().__init__()
        self.training_jobs: dict[str, dict[str, Any]] = {}
        self.processing_jobs: list[dict[str, Any]] = []  # ProcessingJobSummaries, newest first
        self.endpoints: dict[str, dict[str, Any]] = {}
        self.endpoint_configs: dict[str, dict[str, Any]] = {}

    def list_training_jobs(self, **params: Any) -> dict[str, Any]:
        self._call("ListTrainingJobs", params)
        found = [{"TrainingJobName": n} for n in reversed(self.training_jobs) if params.get("NameContains", "") in n]
        return {"TrainingJobSummaries": found}

    def list_processing_jobs(self, **params: Any) -> dict[str, Any]:
        self._call("ListProcessingJobs", params)
        found = [j for j in self.processing_jobs if params.get("NameContains", "") in j["ProcessingJobName"]]
        return {"ProcessingJobSummaries": found}

    def describe_endpoint(self, **params: Any) -> dict[str, Any]:
        self._call("DescribeEndpoint", params)
        if params["EndpointName"] not in self.endpoints:
            raise client_error("ValidationException", "Could not find endpoint.", "DescribeEndpoint")
        return dict(self.endpoints[params["EndpointName"]])

    def describe_endpoint_config(self, **params: Any) -> dict[str, Any]:
        self._call("DescribeEndpointConfig", params)
        return dict(self.endpoint_configs[params["EndpointConfigName"]])

    def describe_training_job(self, **params: Any) -> dict[str, Any]:
        self._call("DescribeTrainingJob", params)
        if params["TrainingJobName"] not in self.training_jobs:
            raise client_error("ValidationException", "Requested resource not found.", "DescribeTrainingJob")
        return dict(self.training_jobs[params["TrainingJobName"]])


class FakeRuntime(FakeClient):
    service = "sagemaker-runtime"

    def __init__(self, image: bytes = b"\x89PNG\r\n\x1a\nfake") -> None:
        super().__init__()
        self.image = image

    def invoke_endpoint(self, **params: Any) -> dict[str, Any]:
        self._call("InvokeEndpoint", params)
        body = json.dumps({"images": [base64.b64encode(self.image).decode()]}).encode()
        return {"Body": io.BytesIO(body), "ContentType": "application/json"}


class Clock:
    """time.monotonic for the console's caches: moves only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Console:
    """The app over fakes (Step Functions, SageMaker, Runtime) and moto (S3, Logs)."""

    sfn: FakeStepFunctions = field(default_factory=FakeStepFunctions)
    sagemaker: FakeSageMaker = field(default_factory=FakeSageMaker)
    runtime: FakeRuntime = field(default_factory=FakeRuntime)
    clock: Clock = field(default_factory=Clock)
    boto_calls: list[str] = field(default_factory=list)  # S3 and Logs operations, as moto got them
    built: dict[str, int] = field(default_factory=dict)  # service -> clients the factory built

    def factory(self, service: str, config: Any = None) -> Any:
        self.built[service] = self.built.get(service, 0) + 1
        fakes = {"stepfunctions": self.sfn, "sagemaker": self.sagemaker, "sagemaker-runtime": self.runtime}
        if service in fakes:
            return fakes[service]
        client = boto3.client(service, region_name=REGION, config=config)  # moto's, under mocked_aws
        client.meta.events.register("before-call.*.*", lambda model, **_: self.boto_calls.append(model.name))
        return client

    def config(self, **overrides: Any) -> ConsoleConfig:
        values: dict[str, Any] = {
            "client": self.factory,
            "endpoint_url": ENDPOINT_URL,
            "region": REGION,
            "bucket": DATA_BUCKET,
            "state_machine_arn": STATE_MACHINE_ARN,
            "notify_log_group": NOTIFY_LOG_GROUP,
        }
        return ConsoleConfig(**(values | overrides))

    def client(self, raise_server_exceptions: bool = True, **overrides: Any) -> TestClient:
        app = create_app(self.config(**overrides))
        self.app = app
        return TestClient(app, raise_server_exceptions=raise_server_exceptions)

    @property
    def api_calls(self) -> int:
        return int(self.app.state.clients.calls)

    def recorded_calls(self) -> int:
        fakes = (self.sfn, self.sagemaker, self.runtime)
        return sum(len(f.calls) for f in fakes) + len(self.boto_calls)


def install_clock(monkeypatch: Any, clock: Clock) -> None:
    """The console's TtlCache reads `time.monotonic` through sdflow.console.aws's `time`."""
    monkeypatch.setattr(console_aws, "time", clock)


# ---------------------------------------------------------------------- the pipeline's run

RUN = "pokemon-sd15-7f3a9c2e41"
MAP = "Download shards"
COUNTS = {"pending": 0, "running": 1, "succeeded": 8, "failed": 1, "timedOut": 0, "aborted": 0,
          "total": 10, "resultsWritten": 9}  # fmt: skip


def pipeline_history(name: str = RUN) -> History:
    """Start run, Validate run and the Map succeeded; Build dataset index failed and was caught;
    Check trained model is running."""
    h = History()
    h.add("ExecutionStarted", 0, executionStartedEventDetails={"input": "{}"})
    h.enter("Start run", "Pass")
    h.exit("Start run", "Pass")
    h.task("Validate run", '{"config": {"run_id": "r1"}}', '{"config": {"run_id": "r1"}, "validated": true}')
    h.enter(MAP, "Map")
    h.add("MapStateStarted")
    h.add("MapRunStarted", mapRunStartedEventDetails={"mapRunArn": map_run_arn(name)})
    h.add("MapRunSucceeded")
    h.add("MapStateSucceeded")
    h.exit(MAP, "Map")
    h.enter("Build dataset index")
    h.add("TaskScheduled")
    h.add("TaskStarted")
    h.add("TaskFailed", taskFailedEventDetails={"error": "Index.TooFewShards", "cause": "2 of 10 shards"})
    h.exit("Build dataset index")
    h.enter("Check trained model", "Choice")
    return h


def add_run(console: Console, name: str = RUN, status: str = "RUNNING", history: History | None = None) -> History:
    """The run in the fake Step Functions, with its Map Run; a finished run's history ends as
    Step Functions ends it (the last state exited, then Execution<Status>)."""
    h = history or pipeline_history(name)
    if history is None and status != "RUNNING":
        h.exit("Check trained model", "Choice")
        h.add(f"Execution{status.title().replace('_', '')}")
    console.sfn.add_execution(name, status=status, history=h)
    console.sfn.map_runs[map_run_arn(name)] = {
        "mapRunArn": map_run_arn(name),
        "executionArn": execution_arn(name),
        "status": "SUCCEEDED",
        "startDate": T0 + timedelta(seconds=10),
        "stopDate": T0 + timedelta(seconds=12),
        "maxConcurrency": 8,
        "toleratedFailurePercentage": 10.0,
        "executionCounts": COUNTS,
    }
    return h


# ---------------------------------------------------------------------- CloudWatch Logs (moto)


def logs_client() -> Any:
    return boto3.client("logs", region_name=REGION)


def put_logs(group: str, stream: str, messages: list[str]) -> None:
    """Lines in a moto log group and stream, created when missing, stamped now."""
    logs = logs_client()
    with contextlib.suppress(logs.exceptions.ResourceAlreadyExistsException):
        logs.create_log_group(logGroupName=group)
    with contextlib.suppress(logs.exceptions.ResourceAlreadyExistsException):
        logs.create_log_stream(logGroupName=group, logStreamName=stream)
    now = int(time.time() * 1000)
    events = [{"timestamp": now + i, "message": message} for i, message in enumerate(messages)]
    logs.put_log_events(logGroupName=group, logStreamName=stream, logEvents=events)
