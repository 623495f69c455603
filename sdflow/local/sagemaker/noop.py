"""A SageMaker stand-in whose jobs do no work: for benchmarks and tests of the orchestration.

Everything around it stays real (the patched SageMaker API with its quotas and rate limits, the status events,
job_events resolving each token); only the job's content is skipped. A download job writes the `_SUCCESS` marker
build_index reads, a dedup job a `summary.json` that found no duplicate, an evaluation job the `evaluation.json`
Register model reads (a perfect score, so any gate passes), a training job reports artifacts and a loss and
leaves a few-pixel samples.png and loss.png and a training_summary.json where the real job's go (so a console
shows a no-op run's outputs): `output/output.tar.gz`, or uncompressed (OutputDataConfig CompressionType NONE)
under the model's `output/model/` prefix and `output/data/`; an endpoint goes InService. `job_seconds` holds each
job that long on the local cloud's clock, so concurrency and quotas are exercised; `peak_running` records the
most processing jobs ever running at once.
StopProcessingJob / StopTrainingJob end a held job at once as Stopped (no `_SUCCESS`, no
artifacts); the fault `kill_job` ends it at once as Failed, as a killed container would."""

from __future__ import annotations

import base64
import io
import json
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

import boto3

from sdflow.local.account import ACCOUNT_ID, REGION
from sdflow.local.runtime import current_clock
from sdflow.local.sagemaker.host import utc_now
from sdflow.local.sagemaker.job_logs import JobLogs, metric_definitions, metric_values
from sdflow_common.dedup_job import DEDUP_ENTRYPOINT, SUMMARY_FILE
from sdflow_common.evaluation import EVALUATION_FILE, GRID_FILE
from sdflow_common.run_document import parse_s3_uri

MAX_LOG_STEPS = 50


class NoOpSageMaker:
    """Finishes every job (after `job_seconds`), reporting through the same listener as LocalSageMaker."""

    def __init__(
        self,
        endpoint_url: str,
        listener: Any,
        *,
        job_seconds: float = 0.0,
        max_threads: int = 8,
        direct_s3: bool = False,
        account_id: str = ACCOUNT_ID,
    ) -> None:
        self.listener = listener
        self.direct_s3 = direct_s3
        self.account_id = account_id
        self.job_seconds = job_seconds
        # Per kind ("processing", "training"), overriding job_seconds: a test holds training long
        # enough to stop it while downloads stay quick.
        self.seconds_by_kind: dict[str, float] = {}
        self.s3 = boto3.client(
            "s3", endpoint_url=endpoint_url, region_name=REGION,
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )  # fmt: skip
        self.pool = ThreadPoolExecutor(max_workers=max_threads)
        self._lock = threading.Lock()
        self.running = 0
        self.peak_running = 0
        self.processing_jobs: list[str] = []
        # (kind, name) -> the job's end request: "stopped" (StopJob) or "killed" (kill_job).
        self._ends: dict[tuple[str, str], str] = {}
        self._logs: JobLogs | None = None
        self._wakeups: dict[tuple[str, str], threading.Event] = {}
        self._queued: set[tuple[str, str]] = set()  # submitted, waiting for a pool thread

    def _hold(self, kind: str, name: str) -> str | None:
        """Hold the job `job_seconds`, or less when it is stopped or killed; returns why it ended early."""
        key = (kind, name)
        with self._lock:
            self._queued.discard(key)
            wakeup = self._wakeups.setdefault(key, threading.Event())
            if key in self._ends:
                wakeup.set()  # stopped while it waited for a pool thread
        # On the local cloud's clock: a scaled clock shortens the hold, as it does every wait.
        current_clock().wait(wakeup, self.seconds_by_kind.get(kind, self.job_seconds), what=f"no-op {kind} job {name}")
        with self._lock:
            self._wakeups.pop(key, None)
            return self._ends.pop(key, None)

    def _end_early(self, kind: str, name: str, why: str) -> bool:
        key = (kind, name)
        with self._lock:
            wakeup = self._wakeups.get(key)
            if wakeup is None and (key not in self._queued or why != "stopped"):
                return False
            self._ends[key] = why
        if wakeup is not None:
            wakeup.set()
        return True

    def _report_early_end(self, kind: str, name: str, why: str) -> None:
        if why == "stopped":
            fields: dict[str, Any] = {"SecondaryStatus": "Stopped"} if kind == "training" else {}
            self.listener.job_status_changed(kind, name, "Stopped", fields)
            return
        reason = f"AlgorithmError: exit code 137 (killed by SIGKILL) on {name}/algo-1; the no-op job was killed"
        fields = {"FailureReason": reason}
        if kind == "training":
            fields["SecondaryStatus"] = "Failed"
        self.listener.job_status_changed(kind, name, "Failed", fields)

    def _processing(self, request: dict[str, Any]) -> None:
        name = request["ProcessingJobName"]
        with self._lock:
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
            self.processing_jobs.append(name)
        try:
            why = self._hold("processing", name)
            if why is not None:
                self._report_early_end("processing", name, why)
                return
            entrypoint = request["AppSpecification"].get("ContainerEntrypoint")
            if entrypoint == ["evaluate"]:
                self._evaluation_output(request)
            elif entrypoint == DEDUP_ENTRYPOINT:
                self._dedup_output(request)
            else:
                output = _argument(request["AppSpecification"].get("ContainerArguments") or [], "--output_uri")
                bucket, key = parse_s3_uri(output)
                marker = {"samples": 1, "failed": 0, "tar_files": ["00000.tar"]}
                self._put(bucket, key.rstrip("/") + "/_SUCCESS", json.dumps(marker).encode())
        finally:
            with self._lock:
                self.running -= 1
        self.listener.job_status_changed("processing", request["ProcessingJobName"], "Completed", {})

    def _evaluation_output(self, request: dict[str, Any]) -> None:
        """evaluation.json and a 4x4 adherence.png where the job's ProcessingOutput goes (SageMaker's
        upload at the job's end)."""
        [output] = request["ProcessingOutputConfig"]["Outputs"]
        bucket, key = parse_s3_uri(output["S3Output"]["S3Uri"])
        scores = {"prompt_adherence": 1.0, "base_prompt_adherence": 0.125, "prompts": 48, "grid": GRID_FILE}
        self._put(bucket, key.rstrip("/") + "/" + EVALUATION_FILE, json.dumps(scores).encode())
        self._put(bucket, key.rstrip("/") + "/" + GRID_FILE, _png("green"))

    def _dedup_output(self, request: dict[str, Any]) -> None:
        """summary.json (docs/contracts.md "The dedup job") of a pass that found no duplicate: no shard
        has drops, so no dropped/ file either."""
        arguments = request["AppSpecification"].get("ContainerArguments") or []
        bucket, key = parse_s3_uri(_argument(arguments, "--output_uri"))
        summary = {
            "version": 1,
            "partitions": int(_argument(arguments, "--partitions")),
            "shards": {},
            "url_duplicates": 0,
            "image_duplicates": 0,
            "hashed_samples": 0,
            "unhashed_shards": [],
            "duration_s": 0.0,
            "peak_rss_mb": 0,
        }
        self._put(bucket, key.rstrip("/") + "/" + SUMMARY_FILE, json.dumps(summary).encode())

    def _put(self, bucket: str, key: str, body: bytes) -> None:
        """The job's output, written straight into the local S3 backend: a real job writes from its
        own process, so its HTTP cost is not the orchestration's and would only blur the measure."""
        if self.direct_s3:
            from moto.s3.models import s3_backends

            s3_backends[self.account_id]["aws"].put_object(bucket, key, body)
        else:
            self.s3.put_object(Bucket=bucket, Key=key, Body=body)

    def _training(self, request: dict[str, Any]) -> None:
        name = request["TrainingJobName"]
        started = utc_now()  # DescribeTrainingJob gives TrainingStartTime/EndTime once it ran (the console's duration)
        steps = str((request.get("HyperParameters") or {}).get("max_train_steps", ""))
        steps_count = int(steps) if steps.isdigit() else 1
        self._training_log(name, request, steps_count)
        why = self._hold("training", name)
        if why is not None:
            self._report_early_end("training", name, why)
            return
        output = f"{request['OutputDataConfig']['S3OutputPath'].rstrip('/')}/{name}/output"
        if str(request["OutputDataConfig"].get("CompressionType") or "GZIP") == "NONE":
            # Uncompressed, as LocalSageMaker uploads it: the report files under the model's prefix (the
            # trainer writes them into /opt/ml/model too) and under output/data/.
            artifacts = f"{output}/model/"
            for key, body in report_files(steps_count, 0.1).items():
                self._put(*parse_s3_uri(f"{artifacts}{key}"), body)
                self._put(*parse_s3_uri(f"{output}/data/{key}"), body)
        else:
            artifacts = f"{output}/model.tar.gz"
            self._put(*parse_s3_uri(f"{output}/output.tar.gz"), output_archive(steps_count, 0.1))
        ended = utc_now()
        fields = {
            "ModelArtifacts": {"S3ModelArtifacts": artifacts},
            "FinalMetricDataList": [{"MetricName": "train:loss", "Value": 0.1}],
            "TrainingStartTime": started,
            "TrainingEndTime": ended,
            "TrainingTimeInSeconds": max(1, int((ended - started).total_seconds())),
        }
        self.listener.job_status_changed("training", name, "Completed", fields)

    def _training_log(self, name: str, request: dict[str, Any], steps: int) -> None:
        """A falling loss, one line a step, in the job's CloudWatch log stream (as the trainer
        prints it), read with the request's MetricDefinitions as the local SageMaker reads a real
        job's, so that a console reads a no-op run's loss curve where it reads a real one's."""
        try:
            definitions = metric_definitions(request)
        except ValueError:
            definitions = []  # a no-op job does not judge its request; its log lines still go out

        def loss_of(line: str, _at: datetime) -> dict[str, float]:
            return metric_values(definitions, line)

        with self._lock:
            if self._logs is None:
                self._logs = JobLogs(self.account_id, REGION)
        write = self._logs.host_lines("training", name, "algo-1", loss_of)
        for step in range(1, min(steps, MAX_LOG_STEPS) + 1):
            write(f"step={step} loss={0.1 + 0.9 / step:.4f}")
        self._logs.flush()

    def run_processing_job(self, request: dict[str, Any]) -> None:
        with self._lock:
            self._queued.add(("processing", request["ProcessingJobName"]))
        self.pool.submit(self._processing, request)

    def run_training_job(self, request: dict[str, Any]) -> None:
        with self._lock:
            self._queued.add(("training", request["TrainingJobName"]))
        self.pool.submit(self._training, request)

    def deploy_endpoint(self, endpoint_name: str, endpoint_config: dict[str, Any], model: dict[str, Any]) -> None:
        config = endpoint_config["EndpointConfigName"]
        self.pool.submit(
            self.listener.job_status_changed, "endpoint", endpoint_name, "InService", {"EndpointConfigName": config}
        )

    def invoke_endpoint(self, endpoint_name: str, body: bytes, content_type: str, accept: str) -> tuple[bytes, str]:
        """The serving container's answer shape ({"images": [base64 PNG]}), with a 4x4 image."""
        return json.dumps({"images": [base64.b64encode(_png("blue")).decode()]}).encode(), "application/json"

    def stop_job(self, kind: str, name: str) -> None:
        """StopProcessingJob / StopTrainingJob: a held job ends now as Stopped; one that already
        ended is left as it is (its end status is already reported)."""
        if kind != "endpoint":
            self._end_early(kind, name, "stopped")

    def kill_job(self, kind: str, name: str, host: str = "algo-1", timeout_s: float = 60.0) -> int:
        """Fault injection, as LocalSageMaker.kill_job: the held job ends now as Failed. Returns 0
        (there is no process). Waits up to `timeout_s` for the job to be submitted to the pool."""
        deadline = time.monotonic() + timeout_s
        while not self._end_early(kind, name, "killed"):
            if time.monotonic() > deadline:
                raise LookupError(f"no running no-op {kind} job named {name}")
            time.sleep(0.02)
        return 0

    def job_wall_times(self) -> dict[str, float]:
        return {}

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)
        if self._logs is not None:
            self._logs.close()


def report_files(steps: int, final_loss: float) -> dict[str, bytes]:
    """The report files as the trainer leaves them (training_image/sdflow_image/training/outputs.py),
    in miniature: 4x4-pixel PNGs and a summary that says it is a no-op's."""
    members = {"training_summary.json": json.dumps({"final_loss": final_loss, "steps": steps, "noop": True}).encode()}
    for name, colour in (("loss.png", "white"), ("samples.png", "red")):
        members[name] = _png(colour)
    return members


def output_archive(steps: int, final_loss: float) -> bytes:
    """output.tar.gz of the report files (report_files)."""
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        for name, data in report_files(steps, final_loss).items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return archive.getvalue()


def _png(colour: str) -> bytes:
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (4, 4), colour).save(png, format="PNG")
    return png.getvalue()


def _argument(arguments: list[str], flag: str) -> str:
    """A flag's value in a download or dedup job's ContainerArguments: the container uploads its files to
    `--output_uri` itself (there is no ProcessingOutput), so that is where `_SUCCESS` and summary.json go."""
    try:
        return arguments[arguments.index(flag) + 1]
    except (ValueError, IndexError):
        raise ValueError(f"ContainerArguments has no {flag} value: {arguments}") from None
