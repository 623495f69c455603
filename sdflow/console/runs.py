"""The pipeline's executions as the console shows them: the list, one run's graph and states,
one state's input and output, a Distributed Map's counts and child executions.

Calls (Step Functions API reference): ListExecutions for the list; per run DescribeExecution,
GetExecutionHistory (newest first, only the events not seen yet), DescribeStateMachineForExecution
(once per execution), DescribeMapRun for the Map Run named by its MapRunStarted event; for the
children ListExecutions(mapRunArn) a page at a time, DescribeExecution once per child (its shard),
ListProcessingJobs(NameContains=<run hash>) for the jobs, and the shard's _SUCCESS object for its
sample count. A finished execution's history, definition and children are kept for good."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

from sdflow import history
from sdflow.console import dataset as datasets
from sdflow.console import graph, maps
from sdflow.console.aws import Clients, ConsoleError, Recent, TtlCache
from sdflow_common import causes, names
from sdflow_common.run_document import parse_s3_uri
from sdflow_common.start_pipeline import source_key

UNFINISHED = {"RUNNING", "PENDING_REDRIVE"}
# StartExecution's name: 1-80 characters, none of whitespace, brackets, wildcards, quotes or controls.
EXECUTION_NAME = re.compile(r"^[^\s<>{}\[\]?*\"#%\\^|~`$&,;:/\x00-\x1f\x7f-\x9f]{1,80}$")
LIST_LIMIT = 100
CHILD_PAGE = 50


def iso(value: datetime | None) -> str | None:
    return value.astimezone(UTC).isoformat() if value else None


def _duration(start: datetime, stop: datetime | None) -> float:
    return max(0.0, ((stop or datetime.now(UTC)) - start).total_seconds())


def state_end(run: history.StateRun, read: history.ExecutionHistory, finished: bool) -> datetime | None:
    """When the state's newest entry ended, from its own events: its exit; for a failure that
    ended the run (no exit follows a TaskFailed the run died of), its last event. None while it
    still runs (a failed attempt waiting for its retry runs on)."""
    if run.exited is not None:
        return run.exited
    if not finished:
        return None
    for event_id in reversed(run.event_ids):
        event = read.event(event_id)
        if event is not None and event.get("timestamp"):
            return event["timestamp"]
    return run.entered


def _state_duration(run: history.StateRun, end: datetime | None, now: datetime) -> float:
    return max(0.0, ((end or now) - run.entered).total_seconds())


def _execution_fields(item: dict[str, Any]) -> dict[str, Any]:
    """What ListExecutions and DescribeExecution both give about an execution."""
    return {
        "name": item["name"],
        "arn": item["executionArn"],
        "status": item["status"],
        "start": iso(item["startDate"]),
        "stop": iso(item.get("stopDate")),
        "duration_s": _duration(item["startDate"], item.get("stopDate")),
    }


def _with_empty_shards(map_runs: dict[str, Any], read: history.ExecutionHistory) -> dict[str, Any]:
    """A child that succeeded but fetched no image counts as succeeded in the Map Run (as on AWS);
    its box says so beside the counts (`counts.empty`), as the notification and `sdflow status` do."""
    empty = datasets.shards_empty(read)
    for entry in map_runs.values():
        entry["counts"]["empty"] = empty
    return map_runs


class RunReader:
    def __init__(self, clients: Clients, bucket: str | None, state_machine_arn: str | None) -> None:
        self.clients = clients
        self.bucket = bucket
        self.state_machine_arn = state_machine_arn
        self._list_cache = TtlCache(2.0)
        self._describe_cache = TtlCache(1.0)
        self._final = TtlCache(1.0, max_entries=20_000)  # definitions, sources, children's shards
        self._histories: Recent[list[dict[str, Any]]] = Recent(64)
        self._inner_cache = TtlCache(5.0)  # a Map's inner states: a page of children at most every 5 s

    # ------------------------------------------------------------------ executions

    def pipeline_arn(self) -> str:
        if not self.state_machine_arn:
            raise ConsoleError(
                409, "NoPipeline", "the pipeline's state machine is unknown",
                "start `sdflow local up`, or pass --state-machine-arn and --bucket",
            )  # fmt: skip
        return self.state_machine_arn

    def execution_arn(self, name: str) -> str:
        """The pipeline's execution called `name`; an execution ARN is taken for its name when it
        is one of this pipeline's (a link pasted from the CLI or a notification)."""
        prefix = self.pipeline_arn().replace(":stateMachine:", ":execution:", 1) + ":"
        if name.startswith("arn:"):
            if not name.startswith(prefix):
                raise ConsoleError(
                    404, "NotThisPipeline", f"{name[:200]} is not an execution of {self.pipeline_arn()}",
                    "open the console of the stack that ran it (--state-machine-arn)",
                )  # fmt: skip
            name = name.removeprefix(prefix)
        if not EXECUTION_NAME.match(name):
            raise ConsoleError(400, "BadExecutionName", f"{name[:100]!r} is not an execution name")
        return self.pipeline_arn().replace(":stateMachine:", ":execution:", 1) + f":{name}"

    def runs(self) -> list[dict[str, Any]]:
        def compute() -> tuple[list[dict[str, Any]], bool]:
            page = self.clients("stepfunctions").list_executions(
                stateMachineArn=self.pipeline_arn(), maxResults=LIST_LIMIT
            )
            items = sorted(page["executions"], key=lambda e: e["startDate"], reverse=True)
            return [self._summary(item) for item in items], False

        return self._list_cache.get("runs", compute)

    def run_deploying(self, resource_name: str) -> str | None:
        """The run among the listed ones whose deployment `resource_name` is (its name carries
        the run hash, names.deployment_name)."""
        for summary in self.runs():
            try:
                run_hash = names.run_hash(summary["arn"], summary["start"])
            except names.InvalidNameInput:
                continue
            if f"-{run_hash}-r" in resource_name:
                return str(summary["name"])
        return None

    def _summary(self, item: dict[str, Any]) -> dict[str, Any]:
        source = self.source(item["name"])
        return {
            **_execution_fields(item),
            "started_by": "upload" if source else "api",
            "manifest": (source or {}).get("manifest"),
            "redrive_count": int(item.get("redriveCount") or 0),
            "redrive_date": iso(item.get("redriveDate")),
            "url": f"#/runs/{item['name']}",
        }

    def source(self, name: str) -> dict[str, Any] | None:
        """The marker StartPipeline writes before it starts a run from an upload (absent: the API)."""
        if not self.bucket:
            return None
        bucket = self.bucket

        def compute() -> tuple[dict[str, Any] | None, bool]:
            s3 = self.clients("s3")
            try:
                body = s3.get_object(Bucket=bucket, Key=source_key(name))["Body"].read()
            except s3.exceptions.NoSuchKey:
                return None, True  # written before StartExecution: absent now means absent for good
            try:
                found = json.loads(body)
            except ValueError:
                return None, True
            return (found if isinstance(found, dict) else None), True

        return self._final.get(("source", name), compute)

    def describe(self, name: str) -> dict[str, Any]:
        arn = self.execution_arn(name)
        return self._describe_cache.get(
            ("describe", arn), lambda: (self.clients("stepfunctions").describe_execution(executionArn=arn), False)
        )

    def definition(self, execution_arn: str) -> dict[str, Any]:
        return self._asl(execution_arn)[0]

    def _asl(self, execution_arn: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """The run's graph and its Maps' ItemProcessors, from the definition it started with."""

        def compute() -> tuple[tuple[dict[str, Any], dict[str, dict[str, Any]]], bool]:
            described = self.clients("stepfunctions").describe_state_machine_for_execution(executionArn=execution_arn)
            try:
                return (graph.build(described["definition"]), maps.processors(described["definition"])), True
            except graph.UnreadableDefinition as exc:
                raise ConsoleError(
                    422, "UnreadableDefinition", f"cannot draw this run's state machine: {exc}",
                    "it was started by a state machine this console cannot read",
                ) from None  # fmt: skip

        return self._final.get(("definition", execution_arn), compute)

    def events(self, description: dict[str, Any]) -> list[dict[str, Any]]:
        """The execution's history, oldest first; only events newer than those held are fetched."""
        arn = description["executionArn"]
        key = ("history", arn, description["status"], description.get("redriveCount", 0))

        def compute() -> tuple[list[dict[str, Any]], bool]:
            held = self._histories.get(arn, [])
            newest = held[-1]["id"] if held else 0
            fresh: list[dict[str, Any]] = []
            kwargs: dict[str, Any] = {"executionArn": arn, "maxResults": history.PAGE_SIZE, "reverseOrder": True}
            while True:
                page = self.clients("stepfunctions").get_execution_history(**kwargs)
                batch = [event for event in page["events"] if event["id"] > newest]
                fresh.extend(batch)
                if len(batch) < len(page["events"]) or not page.get("nextToken"):
                    break
                kwargs["nextToken"] = page["nextToken"]
            events = held + sorted(fresh, key=lambda event: event["id"])
            self._histories[arn] = events
            return events, description["status"] not in UNFINISHED

        return self._describe_cache.get(key, compute)

    # ------------------------------------------------------------------ one run

    def run(self, name: str) -> dict[str, Any]:
        description = self.describe(name)
        read = history.read(self.events(description))
        now = datetime.now(UTC)
        finished = description["status"] not in UNFINISHED
        error, cause = description.get("error"), description.get("cause")
        summary = self._summary(description) | {"error": error, "cause": cause, "reason": causes.read(error, cause)}
        ends = {state: state_end(run, read, finished) for state, run in read.states.items()}
        return {
            "run": summary,
            "description": description,
            "history": read,
            "graph": self.definition(description["executionArn"]),
            "states": {
                state: {
                    "status": run.status,
                    "entered": iso(run.entered),
                    "exited": iso(run.exited),
                    "ended": iso(ends[state]),
                    "duration_s": _state_duration(run, ends[state], now),
                    "attempts": run.attempts,
                    "error": run.error,
                    "cause": run.cause,
                }
                for state, run in read.states.items()
            },
            "map_runs": _with_empty_shards(self.map_runs(read, description["executionArn"]), read),
            "dataset": datasets.dataset_view(read),
            "finished": finished,
        }

    def state(self, name: str, state: str) -> dict[str, Any]:
        description = self.describe(name)
        read = history.read(self.events(description))
        nodes = {node["name"]: node for node in self.definition(description["executionArn"])["states"]}
        if state not in nodes:
            raise ConsoleError(404, "NoSuchState", f"run {name} has no state {state[:100]!r}")
        run = read.states.get(state)
        if run is None:
            fields = ("entered", "exited", "ended", "duration_s", "input", "output", "error", "cause", "reason")
            empty = dict.fromkeys(fields)
            return {"name": state, "type": nodes[state]["type"], "status": "not_reached", "events": [], **empty}
        events = [read.event(event_id) for event_id in run.event_ids]
        end = state_end(run, read, description["status"] not in UNFINISHED)
        return {
            "name": state,
            "type": nodes[state]["type"],
            "status": run.status,
            "entered": iso(run.entered),
            "exited": iso(run.exited),
            "ended": iso(end),
            "duration_s": _state_duration(run, end, datetime.now(UTC)),
            "input": history.decode(run.input),
            "output": history.decode(run.output),
            "error": run.error,
            "cause": run.cause,
            "reason": causes.read(run.error, run.cause),
            "events": [
                {"id": e["id"], "type": e["type"], "timestamp": iso(e["timestamp"])} for e in events if e is not None
            ],
        }

    # ------------------------------------------------------------------ Distributed Map

    @staticmethod
    def _map_run_arns(read: history.ExecutionHistory) -> dict[str, str]:
        arns: dict[str, str] = {}
        for state, run in read.states.items():
            for event_id in run.event_ids:
                event = read.event(event_id) or {}
                arn = (event.get("mapRunStartedEventDetails") or {}).get("mapRunArn")
                if arn:
                    arns[state] = arn  # the newest Map Run of the state's newest entry
        return arns

    def map_runs(self, read: history.ExecutionHistory, execution_arn: str) -> dict[str, Any]:
        result = {}
        for state, arn in self._map_run_arns(read).items():
            described = self._describe_cache.get(("maprun", arn), self._map_run_describer(arn))
            counts = described.get("executionCounts") or {}
            processor = self._asl(execution_arn)[1].get(state)
            result[state] = {
                "arn": arn,
                "status": described.get("status"),
                "start": iso(described.get("startDate")),
                "stop": iso(described.get("stopDate")),
                "counts": {
                    "pending": counts.get("pending", 0),
                    "running": counts.get("running", 0),
                    "succeeded": counts.get("succeeded", 0),
                    "failed": counts.get("failed", 0),
                    "timed_out": counts.get("timedOut", 0),
                    "aborted": counts.get("aborted", 0),
                    "total": counts.get("total", 0),
                    "results_written": counts.get("resultsWritten", 0),
                },
                "tolerated_failure_percentage": described.get("toleratedFailurePercentage", 0.0),
                "max_concurrency": described.get("maxConcurrency", 0),
                "inner": self._inner(arn, described, processor) if processor else None,
            }
        return result

    def _inner(self, arn: str, described: dict[str, Any], processor: dict[str, Any]) -> dict[str, Any]:
        """The Map's inner states as its children ran them (maps.py): a page of children, and
        the failed ones besides when there are failures."""
        counts = described.get("executionCounts") or {}
        status = described.get("status")

        def compute() -> tuple[dict[str, Any], bool]:
            sfn = self.clients("stepfunctions")
            listed = sfn.list_executions(mapRunArn=arn, maxResults=maps.SAMPLE)["executions"]
            if (counts.get("failed") or counts.get("timedOut")) and not any(c["status"] != "SUCCEEDED" for c in listed):
                failed = sfn.list_executions(mapRunArn=arn, statusFilter="FAILED", maxResults=maps.FAILED_SAMPLE)
                listed = failed["executions"] + listed
            seen: set[str] = set()
            children = []
            for child in listed:
                if child["executionArn"] not in seen:
                    seen.add(child["executionArn"])
                    document = self._child_input(child["executionArn"], child["status"] != "RUNNING")
                    children.append((child["status"], document))
            return maps.colour(processor, children, int(counts.get("total") or 0)), status != "RUNNING"

        return self._inner_cache.get(("inner", arn, status), compute)

    def _map_run_describer(self, arn: str) -> Any:
        return lambda: (self.clients("stepfunctions").describe_map_run(mapRunArn=arn), False)

    def children(self, name: str, state: str, status: str | None, token: str | None) -> dict[str, Any]:
        description = self.describe(name)
        read = history.read(self.events(description))
        arn = self._map_run_arns(read).get(state)
        if arn is None:
            raise ConsoleError(404, "NoMapRun", f"state {state[:100]!r} of run {name} has started no Map Run")
        kwargs: dict[str, Any] = {"mapRunArn": arn, "maxResults": CHILD_PAGE}
        if status:
            kwargs["statusFilter"] = status
        if token:
            kwargs["nextToken"] = token
        page = self.clients("stepfunctions").list_executions(**kwargs)
        run_hash = names.run_hash(description["executionArn"], description["startDate"])
        jobs = self._download_jobs(run_hash) if page["executions"] else {}
        indexed = self._index_counts(description["name"]) if page["executions"] else {}
        items = [self._child(child, run_hash, jobs, indexed) for child in page["executions"]]
        return {"map_run_arn": arn, "next_token": page.get("nextToken"), "items": items}

    def _child(
        self, child: dict[str, Any], run_hash: str, jobs: dict[str, Any], indexed: dict[str, dict[str, Any]]
    ) -> dict[str, Any]:
        shard_id, output_uri = self._child_shard(child["executionArn"], child["status"] != "RUNNING")
        attempts: list[dict[str, Any]] = []  # the shard's download jobs, newest first
        if shard_id:
            try:
                key = names.download_job_key(run_hash, shard_id)
            except names.InvalidNameInput:
                key = None
            attempts = [j for j in jobs.values() if key and key in j["ProcessingJobName"]]
        job = attempts[0] if attempts else None
        job_name = job["ProcessingJobName"] if job else None
        marker = self._samples(output_uri, shard_id) if child["status"] == "SUCCEEDED" and output_uri else None
        return {
            **_execution_fields(child),
            "shard_id": shard_id,
            "job_name": job_name,
            "job_status": job["ProcessingJobStatus"] if job else None,
            "samples": marker["samples"] if marker else None,
            "images": marker["images"] if marker else None,
            # What was kept and why: the index's entry (with the duplicates) once it exists, else the _SUCCESS's.
            "counts": indexed.get(shard_id or "") or (marker["counts"] if marker else None),
            "failure_reason": (job or {}).get("FailureReason"),
            "earlier_attempts": [
                {
                    "job_name": j["ProcessingJobName"],
                    "status": j.get("ProcessingJobStatus"),
                    "failure_reason": j.get("FailureReason"),
                }
                for j in attempts[1:]
            ],
            "log_url": f"#/logs?group=/aws/sagemaker/ProcessingJobs&stream={job_name}/" if job_name else None,
        }

    def _child_input(self, child_arn: str, ended: bool) -> Any:
        """The child's input (the Map's ItemSelector applied), kept for good once the child ended
        (the local cloud records the selected input only when the child ends)."""

        def compute() -> tuple[Any, bool]:
            described = self.clients("stepfunctions").describe_execution(executionArn=child_arn)
            return history.decode(described.get("input")), ended

        return self._final.get(("child-input", child_arn), compute)

    def _child_shard(self, child_arn: str, ended: bool) -> tuple[str | None, str | None]:
        """The child's shard id and output folder, from its input (the Map's ItemSelector)."""
        document = self._child_input(child_arn, ended)
        shard = document.get("shard") if isinstance(document, dict) else None
        if not isinstance(shard, dict):
            return None, None
        shard_id, output_uri = shard.get("shard_id"), shard.get("output_uri")
        return (
            str(shard_id) if shard_id is not None else None,
            output_uri if isinstance(output_uri, str) else None,
        )

    def _download_jobs(self, run_hash: str) -> dict[str, Any]:
        """The run's download jobs, newest attempt first: ListProcessingJobs pages of 100."""

        def compute() -> tuple[dict[str, Any], bool]:
            found: dict[str, Any] = {}
            kwargs: dict[str, Any] = {
                "NameContains": run_hash,
                "SortBy": "CreationTime",
                "SortOrder": "Descending",
                "MaxResults": 100,
            }
            while True:
                page = self.clients("sagemaker").list_processing_jobs(**kwargs)
                for job in page.get("ProcessingJobSummaries", []):
                    if job["ProcessingJobName"].startswith(names.DOWNLOAD_PREFIX):
                        found.setdefault(job["ProcessingJobName"], job)
                if not page.get("NextToken"):
                    return found, False
                kwargs["NextToken"] = page["NextToken"]

        return self._describe_cache.get(("jobs", run_hash), compute)

    def _index_counts(self, run_name: str) -> dict[str, dict[str, Any]]:
        """Each indexed shard's counts (index.json), kept for good once the index exists."""
        if not self.bucket:
            return {}
        bucket = self.bucket
        return self._final.get(
            ("index-counts", run_name), lambda: datasets.index_counts(self.clients("s3"), bucket, run_name)
        )

    def _samples(self, output_uri: str, shard_id: str | None) -> dict[str, Any] | None:
        """What the shard's download job wrote into its _SUCCESS marker: the samples it stored and
        the rows it read (`samples` + `failed`): a shard of 0 of its 102 images is no download;
        and its counts (rows read, filtered, failed; sdflow.console.dataset)."""
        try:
            bucket, key = parse_s3_uri(output_uri)
        except ValueError:
            return None

        def compute() -> tuple[dict[str, Any] | None, bool]:
            s3 = self.clients("s3")
            try:
                body = s3.get_object(Bucket=bucket, Key=f"{key.rstrip('/')}/_SUCCESS")["Body"]
                record = json.loads(body.read())
            except (s3.exceptions.NoSuchKey, ValueError):
                return None, False
            if not isinstance(record, dict) or not isinstance(record.get("samples"), int | float):
                return None, True
            samples, failed = int(record["samples"]), record.get("failed")
            images = samples + int(failed) if isinstance(failed, int | float) else None
            return {"samples": samples, "images": images, "counts": datasets.success_counts(record, shard_id)}, True

        return self._final.get(("samples", output_uri), compute)
