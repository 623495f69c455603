"""Training jobs of the local SageMaker: the request's inputs laid out per host
(sdflow/local/sagemaker/training_layout.py), one `train` process per host on this machine with
torch.distributed's rendezvous on 127.0.0.1, the SecondaryStatus steps SageMaker reports
(Starting, Downloading, Training, Uploading), the metrics and `step=N loss=X` progress read from
the hosts' output, and the model artifact uploaded when every host exits 0.

`TrainingJobs` is the training half of LocalSageMaker (sdflow/local/sagemaker/engine.py), which owns
the state and the helpers declared here."""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from sdflow.local.sagemaker.container import ContainerProcess, terminate
from sdflow.local.sagemaker.host import (
    JobSetupError,
    LocalSageMakerHalf,
    S3Transfer,
    clip_reason,
    utc_now,
)
from sdflow.local.sagemaker.job_logs import JobLogs, metric_definitions, metric_values
from sdflow.local.sagemaker.job_state import Job, Outcome, failure_reason, max_runtime, max_runtime_reason
from sdflow.local.sagemaker.training_layout import (
    HostLayout,
    check_training_input_mode,
    download_channels,
    download_checkpoints,
    lay_out_hosts,
    output_compression,
    s3_output_path,
    training_hosts,
    upload_artifacts,
    upload_checkpoints,
)

LOG = logging.getLogger("sdflow.local.sagemaker")

# The CLI's progress view: the trainer prints `step=N loss=X` on rank 0 (docs/contracts.md).
PROGRESS_LINE = re.compile(r"step=(\d+)\s+loss=([-+0-9.eE]+|nan|inf)")


class TrainingJobs(LocalSageMakerHalf):
    """Run training jobs; LocalSageMaker provides the state and helpers."""

    job_logs: JobLogs

    def _job_s3(self, job: Job) -> S3Transfer:
        raise NotImplementedError

    def _supervise(self, job: Job, hosts: list[tuple[ContainerProcess, Path]], max_runtime_s: float) -> Outcome:
        raise NotImplementedError

    def _master_port(self) -> int:
        raise NotImplementedError

    def _run_training(self, job: Job) -> None:
        name = job.name
        started = utc_now()
        base: dict[str, Any] = {"TrainingStartTime": started}
        self._training_status(job, "InProgress", "Starting", base)
        try:
            status, secondary, fields = self._training(job, base)
        except JobSetupError as exc:
            status, secondary, fields = "Failed", "Failed", {"FailureReason": clip_reason(f"ClientError: {exc}")}
        except Exception as exc:
            LOG.exception("training job %s", name)
            status, secondary = "Failed", "Failed"
            fields = {"FailureReason": clip_reason(f"InternalServerError: {type(exc).__name__}: {exc}")}
        ended = utc_now()
        seconds = max(1, int((ended - started).total_seconds()))
        count = int((job.request.get("ResourceConfig") or {}).get("InstanceCount", 1) or 1)
        fields |= {
            "TrainingEndTime": ended,
            "TrainingTimeInSeconds": seconds,
            "BillableTimeInSeconds": seconds * count,
        }
        metrics = self._final_metrics(job)
        if metrics:
            fields["FinalMetricDataList"] = metrics
        self._training_status(job, status, secondary, base | fields)

    def _training_status(self, job: Job, status: str, secondary: str, fields: dict[str, Any]) -> None:
        with self._lock:
            job.status, job.secondary_status = status, secondary
        self._report("training", job.name, status, fields | {"SecondaryStatus": secondary})

    def _final_metrics(self, job: Job) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {"MetricName": metric, "Value": value, "Timestamp": ts} for metric, (value, ts) in job.metrics.items()
            ]

    def _metric_parser(self, job: Job) -> Callable[[str, datetime], dict[str, float]]:
        try:
            definitions = metric_definitions(job.request)
        except ValueError as exc:
            raise JobSetupError(str(exc)) from None

        def on_line(line: str, ts: datetime) -> dict[str, float]:
            progress = PROGRESS_LINE.search(line)
            found = metric_values(definitions, line)
            if not progress and not found:
                return found
            with self._lock:
                if progress:
                    job.step, job.loss = int(progress.group(1)), float(progress.group(2))
                for metric, value in found.items():
                    job.metrics[metric] = (value, ts)
            return found

        return on_line

    def _training(self, job: Job, base: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
        request, name = job.request, job.name
        hosts = training_hosts(request)
        check_training_input_mode(request)
        on_line = self._metric_parser(job)
        output_path = s3_output_path(request)
        runtime_s = max_runtime(request)

        self._training_status(job, "InProgress", "Downloading", base)
        channel_files = download_channels(
            functools.partial(self._job_s3, job), job.folder, request.get("InputDataConfig") or []
        )
        checkpoint = request.get("CheckpointConfig") or None
        checkpoint_cache = job.folder / "_checkpoints"
        if checkpoint:
            download_checkpoints(self._job_s3(job), checkpoint["S3Uri"], checkpoint_cache)
        layouts = lay_out_hosts(job.folder, request, hosts, channel_files, checkpoint_cache)

        self._training_status(job, "InProgress", "Training", base)
        running = self._start_hosts(job, layouts, on_line)
        outcome = self._supervise(job, running, float(runtime_s))

        if checkpoint:
            # Like SageMaker's continuous sync, whatever the outcome: a retry resumes from it.
            upload_checkpoints(self._job_s3(job), layouts, checkpoint["S3Uri"])
        if outcome.result != "completed":
            return _unfinished(outcome, running, runtime_s)

        self._training_status(job, "InProgress", "Uploading", base)
        model_uri = upload_artifacts(
            self._job_s3(job), job.folder, layouts[0].opt_ml, output_path, name, output_compression(request)
        )
        return "Completed", "Completed", {"ModelArtifacts": {"S3ModelArtifacts": model_uri}}

    def _start_hosts(
        self, job: Job, layouts: list[HostLayout], on_line: Callable[[str, datetime], dict[str, float]]
    ) -> list[tuple[ContainerProcess, Path]]:
        """One `train` process per host; if one fails to start, none is left running."""
        request, name = job.request, job.name
        master_port = str(self._master_port())
        script = self._entrypoint("train", "training entrypoint")
        python = self.python_for((request.get("AlgorithmSpecification") or {}).get("TrainingImage"))
        running: list[tuple[ContainerProcess, Path]] = []
        try:
            for layout in layouts:
                host, opt_ml = layout.host, layout.opt_ml
                env = self._environment(
                    opt_ml,
                    request.get("Environment"),
                    {
                        "TRAINING_JOB_NAME": name,
                        "SM_CURRENT_HOST": host,
                        "SDFLOW_MASTER_ADDR": "127.0.0.1",
                        "SDFLOW_MASTER_PORT": master_port,
                        # On AWS each instance has its own cores; here the instances share this
                        # machine's. Each taking all of them oversubscribes the cores, and spinning
                        # OpenMP threads then made the demo's steps about 30x slower (5 s, not 0.16 s).
                        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // len(layouts))),
                    },
                    request.get("RoleArn"),
                    python,
                )
                # `docker run IMAGE train` runs bin/train with no arguments: hyperparameters come from the file.
                command = [python, str(script)]
                lines = self.job_logs.host_lines("training", name, host, on_line)
                process = ContainerProcess(f"{name}/{host}", command, env, opt_ml, job.folder / f"{host}.log", lines)
                running.append((process, opt_ml))
                job.processes.append(process)
        except BaseException:
            terminate([p for p, _ in running], self.stop_grace_s)
            raise
        return running


def _unfinished(
    outcome: Outcome, hosts: list[tuple[ContainerProcess, Path]], runtime_s: Any
) -> tuple[str, str, dict[str, Any]]:
    """Status, SecondaryStatus and fields of a job whose hosts did not all exit 0."""
    if outcome.result == "stopped":
        return "Stopped", "Stopped", {}
    if outcome.result == "timeout":
        return "Failed", "MaxRuntimeExceeded", {"FailureReason": max_runtime_reason(runtime_s)}
    return "Failed", "Failed", {"FailureReason": failure_reason(outcome, hosts)}
