"""What a run's jobs, endpoint and notification show: read from SageMaker, CloudWatch Logs and S3.

- training: DescribeTrainingJob; the loss curve from its log stream in /aws/sagemaker/TrainingJobs
  (GetLogEvents, only new events each poll) read with the job's own MetricDefinitions, the regexes
  SageMaker applies to the same lines to make the job's CloudWatch metrics; loss.png, samples.png
  and training_summary.json from output/output.tar.gz (SageMaker's place for a job's small files), or,
  when the job's output is uncompressed (OutputDataConfig.CompressionType NONE), from the model's prefix;
- evaluation: DescribeProcessingJob and the job's evaluation.json / holdout.png / adherence.png
  (sdflow.console.evaluation);
- endpoint: DescribeEndpoint and DescribeEndpointConfig; a prompt through InvokeEndpoint;
- notifications: the notify function's "notification published" log records (FilterLogEvents),
  since SNS has no API that reads a published message back."""

from __future__ import annotations

import base64
import json
import re
import tarfile
import time
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from botocore.exceptions import ClientError

from sdflow import endpoints
from sdflow.console.aws import Clients, ConsoleError, Recent, TtlCache, error_code
from sdflow.console.evaluation import evaluation_view
from sdflow.console.runs import iso
from sdflow_common import evaluation_report, names
from sdflow_common.run_document import parse_s3_uri

TRAINING_LOGS = "/aws/sagemaker/TrainingJobs"
PROCESSING_LOGS = "/aws/sagemaker/ProcessingJobs"
LOSS_METRIC = "train:loss"
STEP = re.compile(r"step=(\d+)")
MAX_LOSS_POINTS = 2000
MAX_ARCHIVE_BYTES = 512 * 1024 * 1024  # read a .tar.gz for one member only below this size
MAX_MEMBER_BYTES = 32 * 1024 * 1024
# The page waits on a busy endpoint's retries (sdflow.endpoints) this long before it shows the refusal.
BUSY_RETRY_BUDGET_S = 30.0
TERMINAL_JOB = {"Completed", "Failed", "Stopped"}
CONTENT_TYPES = {".png": "image/png", ".json": "application/json", ".jpg": "image/jpeg", ".txt": "text/plain"}


def artifact_url(uri: str, member: str | None = None) -> str:
    url = f"/api/artifact?uri={quote(uri, safe='')}"
    return f"{url}&member={quote(member, safe='')}" if member else url


def log_url(group: str, stream_prefix: str) -> str:
    return f"#/logs?group={quote(group, safe='')}&stream={quote(stream_prefix, safe='')}"


class _LossCurve:
    """One job's loss points, extended from where the previous poll stopped."""

    def __init__(self) -> None:
        self.points: list[tuple[int, float]] = []
        self.token: str | None = None
        self.stream: str | None = None
        self.done = False


class JobReader:
    def __init__(self, clients: Clients, bucket: str | None, notify_log_group: str | None) -> None:
        self.clients = clients
        self.bucket = bucket
        self.notify_log_group = notify_log_group
        self._cache = TtlCache(1.0)
        self._final = TtlCache(1.0, max_entries=256)
        self._curves: Recent[_LossCurve] = Recent(32)

    # ------------------------------------------------------------------ discovery

    def _newest_job(self, kind: str, run_hash: str, prefix: str) -> str | None:
        def compute() -> tuple[str | None, bool]:
            sagemaker = self.clients("sagemaker")
            params = {"NameContains": run_hash, "SortBy": "CreationTime", "SortOrder": "Descending", "MaxResults": 20}
            if kind == "training":
                jobs = [j["TrainingJobName"] for j in sagemaker.list_training_jobs(**params)["TrainingJobSummaries"]]
            else:
                page = sagemaker.list_processing_jobs(**params)["ProcessingJobSummaries"]
                jobs = [j["ProcessingJobName"] for j in page]
            return next((job for job in jobs if job.startswith(prefix)), None), False

        return self._cache.get(("newest", kind, run_hash, prefix), compute)

    # ------------------------------------------------------------------ training

    def training(self, run: dict[str, Any]) -> dict[str, Any] | None:
        states, state = run["history"].states, _latest_state(run)
        if "Train model" not in states and "Reuse trained model" not in states:
            return None
        job_name = (state.get("training") or {}).get("job_name")
        if not job_name:
            job_name = self._newest_job("training", _run_hash(run), names.TRAINING_PREFIX)
        if not job_name:
            return {"job_name": None, "status": "Starting", "loss": [], "final_metrics": {}}
        job = self._cache.get(
            ("training", job_name),
            lambda: (self.clients("sagemaker").describe_training_job(TrainingJobName=job_name), False),
        )
        resources = job.get("ResourceConfig") or {}
        start, end = job.get("TrainingStartTime"), job.get("TrainingEndTime")
        if end is None and job.get("TrainingJobStatus") in TERMINAL_JOB:
            end = job.get("LastModifiedTime")  # an ended job's duration is fixed, never "until now"
        outputs = self._training_outputs(job)
        return {
            "job_name": job_name,
            "status": job.get("TrainingJobStatus"),
            "secondary_status": job.get("SecondaryStatus"),
            "instance_type": resources.get("InstanceType"),
            "instance_count": resources.get("InstanceCount"),
            "start": iso(start),
            "end": iso(end),
            "duration_s": ((end or datetime.now(UTC)) - start).total_seconds() if start else None,
            "failure_reason": job.get("FailureReason"),
            "loss": self._loss(job),
            "final_metrics": {m["MetricName"]: m["Value"] for m in job.get("FinalMetricDataList") or []},
            "log_url": log_url(TRAINING_LOGS, f"{job_name}/algo-1-"),
            **outputs,
        }

    def _loss(self, job: dict[str, Any]) -> list[tuple[int, float]]:
        name = job["TrainingJobName"]
        if name not in self._curves:
            self._curves[name] = _LossCurve()
        curve = self._curves[name]
        if curve.done:
            return curve.points
        definitions = (job.get("AlgorithmSpecification") or {}).get("MetricDefinitions") or []
        regex = next((d.get("Regex") for d in definitions if d.get("Name") == LOSS_METRIC), None)
        if not regex:
            return curve.points
        loss = re.compile(regex)
        logs = self.clients("logs")
        if curve.stream is None:
            found = _streams(logs, TRAINING_LOGS, f"{name}/algo-1-")
            if not found:
                return curve.points
            curve.stream = found[-1]["logStreamName"]
        terminal = job.get("TrainingJobStatus") in TERMINAL_JOB
        for _ in range(20):  # 10,000 events a page at most; a long log catches up over polls
            kwargs: dict[str, Any] = {
                "logGroupName": TRAINING_LOGS,
                "logStreamName": curve.stream,
                "startFromHead": True,
            }
            if curve.token:
                kwargs["nextToken"] = curve.token
            page = logs.get_log_events(**kwargs)
            for event in page.get("events", []):
                _take_loss(curve, loss, event["message"])
            same = page.get("nextForwardToken") == curve.token
            curve.token = page.get("nextForwardToken") or curve.token
            if same or not page.get("events"):
                curve.done = terminal
                break
        return curve.points

    def _training_outputs(self, job: dict[str, Any]) -> dict[str, Any]:
        empty = {"summary": None, "samples_url": None, "loss_png_url": None}
        if job.get("TrainingJobStatus") != "Completed":
            return empty
        output_config = job.get("OutputDataConfig") or {}
        model_uri = (job.get("ModelArtifacts") or {}).get("S3ModelArtifacts")
        if output_config.get("CompressionType") == "NONE" and model_uri:
            return self._model_folder_outputs(model_uri if model_uri.endswith("/") else f"{model_uri}/")
        output_path = (output_config.get("S3OutputPath") or "").rstrip("/")
        archive = f"{output_path}/{job['TrainingJobName']}/output/output.tar.gz"

        def compute() -> tuple[dict[str, Any], bool]:
            try:
                summary_bytes = self.member(archive, "training_summary.json")
            except ConsoleError:
                return empty, True  # a job of an image that writes no output data
            try:
                summary = json.loads(summary_bytes)
            except ValueError:
                summary = None
            return {
                "summary": summary,
                "samples_url": artifact_url(archive, "samples.png"),
                "loss_png_url": artifact_url(archive, "loss.png"),
            }, True

        return self._final.get(("outputs", archive), compute)

    def _model_folder_outputs(self, folder: str) -> dict[str, Any]:
        """An uncompressed output's report files, objects of their own under the model's prefix (the
        trainer writes them into /opt/ml/model beside the weights)."""
        summary = self._final.get(
            ("summary", f"{folder}training_summary.json"),
            lambda: (_json_or_none(self, f"{folder}training_summary.json"), True),
        )
        if summary is None:
            return {"summary": None, "samples_url": None, "loss_png_url": None}
        return {
            "summary": summary,
            "samples_url": artifact_url(f"{folder}samples.png"),
            "loss_png_url": artifact_url(f"{folder}loss.png"),
        }

    # ------------------------------------------------------------------ evaluation

    def evaluation(self, run: dict[str, Any]) -> dict[str, Any] | None:
        if "Evaluate model" not in run["history"].states:
            return None
        found = _latest_state(run).get("evaluation") or {}
        job_name = found.get("job_name") or self._newest_job("processing", _run_hash(run), names.EVALUATION_PREFIX)
        if not job_name:
            return {
                "job_name": None,
                "status": "Starting",
                **evaluation_view(None),
                "grid_url": None,
                "holdout_grid_url": None,
                "log_url": None,
            }
        job = self._cache.get(
            ("processing", job_name),
            lambda: (self.clients("sagemaker").describe_processing_job(ProcessingJobName=job_name), False),
        )
        folder = found.get("evaluation_uri") or next(
            (o["S3Output"]["S3Uri"] for o in (job.get("ProcessingOutputConfig") or {}).get("Outputs", [])), None
        )
        document, grid, holdout_grid = None, None, None
        if job.get("ProcessingJobStatus") == "Completed" and folder:
            scores_uri = f"{folder.rstrip('/')}/evaluation.json"
            document = self._final.get(("scores", scores_uri), lambda: (_json_or_none(self, scores_uri), True))
            # The scene-adherence grid only when the job scored scene prompts (an older file: always).
            if "prompt_adherence" in evaluation_report.metrics_of(document):
                grid = artifact_url(f"{folder.rstrip('/')}/adherence.png")
            holdout_name = evaluation_report.holdout_grid_name(document)
            holdout_grid = artifact_url(f"{folder.rstrip('/')}/{holdout_name}") if holdout_name else None
        options = ((_latest_state(run).get("config") or {}).get("run") or {}).get("evaluation")
        return {
            "job_name": job_name,
            "status": job.get("ProcessingJobStatus"),
            **evaluation_view(document, options),
            "grid_url": grid,
            "holdout_grid_url": holdout_grid,
            "failure_reason": job.get("FailureReason"),
            "log_url": log_url(PROCESSING_LOGS, f"{job_name}/algo-1-"),
        }

    # ------------------------------------------------------------------ endpoint

    def endpoint(self, run: dict[str, Any]) -> dict[str, Any] | None:
        if "Deploy endpoint" not in run["history"].states:
            return None
        document = _input(run)
        name = (_latest_state(run).get("endpoint") or {}).get("resource_name") or (
            (document.get("endpoint") or {}).get("name") if isinstance(document.get("endpoint"), dict) else None
        )
        name = name or "sdflow"
        sagemaker = self.clients("sagemaker")
        try:
            endpoint = self._cache.get(
                ("endpoint", name), lambda: (sagemaker.describe_endpoint(EndpointName=name), False)
            )
        except ClientError as exc:
            if error_code(exc) == "ValidationException":  # SageMaker's answer for an endpoint that does not exist
                return {"name": name, "status": "NotFound", "variants": [], "invoke_url": None}
            raise
        config_name = endpoint.get("EndpointConfigName")
        config = self._final.get(
            ("config", config_name),
            lambda: (sagemaker.describe_endpoint_config(EndpointConfigName=config_name), True),
        )
        # Deployment names carry the run hash (names.deployment_name): a config without this
        # run's is another run's, deployed later or rolled back to.
        serves_this_run = bool(config_name) and f"-{_run_hash(run)}-r" in str(config_name)
        return {
            "name": name,
            "serves_this_run": serves_this_run,
            "serving_run": None,  # the run whose model it serves instead, where known (server.py)
            "status": endpoint.get("EndpointStatus"),
            "config_name": config_name,
            "created": iso(endpoint.get("CreationTime")),
            "last_modified": iso(endpoint.get("LastModifiedTime")),
            "failure_reason": endpoint.get("FailureReason"),
            "invoke_url": f"/api/endpoints/{quote(name, safe='')}/invoke",
            "variants": [
                {
                    "name": v.get("VariantName"),
                    "instance_type": v.get("InstanceType"),
                    "instance_count": v.get("InitialInstanceCount"),
                    "model_name": v.get("ModelName"),
                }
                for v in config.get("ProductionVariants", [])
            ],
        }

    def invoke(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        started = time.monotonic()
        answer = endpoints.invoke_json(self.clients("sagemaker-runtime"), endpoint, body, budget_s=BUSY_RETRY_BUDGET_S)
        images = answer.get("images") if isinstance(answer, dict) else None
        if not images:
            raise ConsoleError(502, "NoImage", f"endpoint {endpoint} answered without an image")
        base64.b64decode(images[0], validate=True)
        return {"image": images[0], "seconds": round(time.monotonic() - started, 3)}

    # ------------------------------------------------------------------ notifications

    def notifications(self, run: dict[str, Any]) -> list[dict[str, Any]]:
        group = self.notify_log_group
        if not group or not run["finished"]:
            return []
        description = run["description"]
        arn, start_ms = description["executionArn"], int(description["startDate"].timestamp() * 1000)

        def compute() -> tuple[list[dict[str, Any]], bool]:
            found: list[dict[str, Any]] = []
            kwargs: dict[str, Any] = {
                "logGroupName": group,
                "filterPattern": '"notification published"',
                "startTime": start_ms,
            }
            for _ in range(10):
                try:
                    page = self.clients("logs").filter_log_events(**kwargs)
                except ClientError as exc:
                    if error_code(exc) == "ResourceNotFoundException":
                        return [], False  # the notify function has not logged yet
                    raise
                found += [n for n in map(_notification, page.get("events", [])) if n and n.pop("execution") == arn]
                if not page.get("nextToken"):
                    break
                kwargs["nextToken"] = page["nextToken"]
            return found, False

        return self._cache.get(("notifications", arn, description.get("redriveCount", 0)), compute)

    # ------------------------------------------------------------------ logs and artifacts

    def logs(self, group: str, stream: str, token: str | None) -> dict[str, Any]:
        logs = self.clients("logs")
        if stream.endswith("/") or stream.endswith("-"):  # a job's streams: <job>/algo-1-<epoch>
            streams = _streams(logs, group, stream)
            if not streams:
                raise ConsoleError(404, "NoLogStream", f"no log stream {stream}* in {group} yet")
            stream = streams[-1]["logStreamName"]
        kwargs: dict[str, Any] = {"logGroupName": group, "logStreamName": stream, "startFromHead": True, "limit": 1000}
        if token:
            kwargs["nextToken"] = token
        page = logs.get_log_events(**kwargs)
        events = [{"time": _ms(e["timestamp"]), "message": e["message"]} for e in page.get("events", [])]
        next_token = page.get("nextForwardToken")
        return {"group": group, "stream": stream, "events": events, "next_token": next_token}

    def artifact(self, uri: str, member: str | None) -> tuple[bytes, str]:
        name = member or uri
        suffix = name[name.rfind(".") :].lower() if "." in name else ""
        content_type = CONTENT_TYPES.get(suffix, "application/octet-stream")
        if member:
            return self.member(uri, member), content_type
        bucket, key = self._own(uri)
        s3 = self.clients("s3")
        head = s3.head_object(Bucket=bucket, Key=key)
        if head["ContentLength"] > MAX_MEMBER_BYTES:
            raise ConsoleError(
                413,
                "TooLarge",
                f"{uri} is {head['ContentLength']} bytes; the console shows files up to {MAX_MEMBER_BYTES}",
            )
        return s3.get_object(Bucket=bucket, Key=key)["Body"].read(), content_type

    def member(self, uri: str, member: str) -> bytes:
        """One file out of a .tar.gz object, read as a stream (never the whole archive in memory)."""
        bucket, key = self._own(uri)

        def compute() -> tuple[bytes, bool]:
            s3 = self.clients("s3")
            try:
                head = s3.head_object(Bucket=bucket, Key=key)
            except Exception as exc:
                raise ConsoleError(404, "NoSuchKey", f"{uri} does not exist") from exc
            if head["ContentLength"] > MAX_ARCHIVE_BYTES:
                raise ConsoleError(413, "TooLarge", f"{uri} is too large to open for {member}")
            body = s3.get_object(Bucket=bucket, Key=key)["Body"]
            try:
                with tarfile.open(fileobj=body, mode="r|gz") as archive:
                    for info in archive:
                        if info.isfile() and info.name.lstrip("./") == member and info.size <= MAX_MEMBER_BYTES:
                            extracted = archive.extractfile(info)
                            if extracted is not None:
                                return extracted.read(), True
            except (tarfile.TarError, OSError, EOFError) as exc:
                raise ConsoleError(422, "BadArchive", f"{uri} is not a readable .tar.gz: {exc}") from None
            raise ConsoleError(404, "NoSuchMember", f"{uri} holds no {member}")

        return self._final.get(("member", uri, member), compute)

    def _own(self, uri: str) -> tuple[str, str]:
        try:
            bucket, key = parse_s3_uri(uri)
        except ValueError as exc:
            raise ConsoleError(400, "BadUri", str(exc)) from None
        if bucket != self.bucket:
            raise ConsoleError(
                403, "OtherBucket", f"the console reads only the stack's bucket {self.bucket}, not {bucket}"
            )
        return bucket, key


def _streams(logs: Any, group: str, prefix: str) -> list[dict[str, Any]]:
    """The group's streams starting with `prefix`; none while the group does not exist yet
    (SageMaker creates it with a job's first log line)."""
    try:
        return list(logs.describe_log_streams(logGroupName=group, logStreamNamePrefix=prefix).get("logStreams", []))
    except ClientError as exc:
        if error_code(exc) == "ResourceNotFoundException":
            return []
        raise


def _take_loss(curve: _LossCurve, loss: re.Pattern[str], message: str) -> None:
    match = loss.search(message)
    if not match:
        return
    try:
        value = float(match.group(1))
    except (ValueError, IndexError):
        return
    step = STEP.search(message)
    curve.points.append((int(step.group(1)) if step else len(curve.points) + 1, value))
    if len(curve.points) > MAX_LOSS_POINTS:
        curve.points = curve.points[::2]  # keep the curve's shape over the whole run, not its tail


def _notification(event: dict[str, Any]) -> dict[str, Any] | None:
    try:
        record = json.loads(event["message"])
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("message") != "notification published":
        return None
    return {
        "execution": record.get("correlation_id"),
        "time": _ms(event["timestamp"]),
        "status": record.get("status"),
        "subject": record.get("subject"),
        "message": record.get("notification"),
    }


def _json_or_none(reader: JobReader, uri: str) -> Any:
    try:
        return json.loads(reader.artifact(uri, None)[0])
    except (ConsoleError, ValueError):
        return None


def _ms(timestamp: int) -> str:
    return datetime.fromtimestamp(timestamp / 1000, UTC).isoformat()


def _latest_state(run: dict[str, Any]) -> dict[str, Any]:
    """The newest state output of the run: what the steps wrote so far (training, evaluation, ...)."""
    exits = [r for r in run["history"].states.values() if r.output and r.exited]
    for state_run in sorted(exits, key=lambda r: r.exited, reverse=True):
        try:
            decoded = json.loads(state_run.output or "")
        except ValueError:
            continue
        if isinstance(decoded, dict):
            return decoded
    return {}


def _input(run: dict[str, Any]) -> dict[str, Any]:
    try:
        document = json.loads(run["description"].get("input") or "{}")
    except ValueError:
        return {}
    return document if isinstance(document, dict) else {}


def _run_hash(run: dict[str, Any]) -> str:
    description = run["description"]
    return names.run_hash(description["executionArn"], description["startDate"])
