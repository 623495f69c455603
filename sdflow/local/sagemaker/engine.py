"""SageMaker processing jobs, training jobs and endpoints, run as local processes of the
training_image code under the SageMaker container contract (docs/contracts.md).

Each job gets a work folder `workdir/jobs/<job name>/` with one `/opt/ml` tree per emulated
host (`algo-1/`, `algo-2/`, …, exported to the container code as `$SDFLOW_OPT_ML`) and the
host's combined stdout/stderr in `algo-N.log`, also sent to the local CloudWatch Logs with the
training metrics (sdflow/local/sagemaker/job_logs.py). Inputs come from the local S3 (the moto server
at `endpoint_url`) before the container starts; outputs go back to it when it ends, as
SageMaker's File mode and EndOfJob upload do. Training jobs run in sdflow/local/sagemaker/training.py
(each host's `/opt/ml` laid out by sdflow/local/sagemaker/training_layout.py). Endpoints
(sdflow/local/sagemaker/endpoints.py) live in `workdir/endpoints/<endpoint>/<endpoint config>/`:
the model artifact extracted to `opt_ml/model` and `serve` listening on a free port of 127.0.0.1.

Every call returns at once; the work happens on a background thread that reports each status
change to the StatusListener, which the local cloud turns into moto's Describe* answers and
the "SageMaker … State Change" events."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sdflow.local.account import ACCOUNT_ID, REGION
from sdflow.local.runtime import current_clock
from sdflow.local.sagemaker.container import ContainerProcess, signal_group, terminate
from sdflow.local.sagemaker.endpoints import INVOKE_TIMEOUT_S, EndpointHosting, EndpointState
from sdflow.local.sagemaker.host import (
    ContainerError,
    DeploymentFailed,
    EndpointNotFound,
    EndpointUnreachable,
    JobAlreadyRunning,
    JobSetupError,
    LocalSageMakerError,
    S3Transfer,
    clip_reason,
    container_path,
    free_port,
    parse_s3_uri,
    read_text_or_none,
    rewrite_container_paths,
    utc_now,
)
from sdflow.local.sagemaker.job_env import WAIT_POLICY, JobEnvironmentMissing, accelerate_python, image_python
from sdflow.local.sagemaker.job_logs import JobLogs
from sdflow.local.sagemaker.job_state import (
    Job,
    Kind,
    Outcome,
    StatusListener,
    failure_reason,
    max_runtime,
    max_runtime_reason,
)
from sdflow.local.sagemaker.training import TrainingJobs
from sdflow.local.services.logs import CloudWatchSink

__all__ = [
    "ContainerError",
    "DeploymentFailed",
    "EndpointNotFound",
    "EndpointUnreachable",
    "JobAlreadyRunning",
    "JobSetupError",
    "LocalSageMaker",
    "LocalSageMakerError",
    "StatusListener",
    "container_path",
    "rewrite_container_paths",
]

LOG = logging.getLogger("sdflow.local.sagemaker")

REPO_ROOT = Path(__file__).resolve().parents[3]
POLL_S = 0.2
# Only these survive from the parent's environment: the container sees no AWS credentials,
# no proxy settings and no virtualenv quirks that the real image would not have.
PASSTHROUGH_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "TZ", "USER", "LOGNAME")


class LocalSageMaker(TrainingJobs, EndpointHosting):
    """SageMaker's job and endpoint runtime, on this machine. Thread-safe. Training jobs are run by
    the TrainingJobs half (sdflow/local/sagemaker/training.py); endpoints are served by
    the EndpointHosting half (sdflow/local/sagemaker/endpoints.py)."""

    def __init__(
        self,
        workdir: Path,
        endpoint_url: str,
        listener: StatusListener,
        training_image_dir: Path | None = None,
        python: str | None = None,
        region: str = REGION,
        *,
        extra_env: Mapping[str, str] | None = None,
        ping_timeout_s: float = 180.0,
        stop_grace_s: float = 20.0,
        invoke_timeout_s: float = INVOKE_TIMEOUT_S,
        account_id: str = ACCOUNT_ID,
        log_sink: CloudWatchSink | None = None,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self.listener = listener
        self.image_dir = Path(training_image_dir or REPO_ROOT / "training_image").resolve()
        self.bin_dir = self.image_dir / "bin"
        if not self.bin_dir.is_dir():
            raise LocalSageMakerError(f"{self.bin_dir} does not exist: training_image_dir must hold bin/ entrypoints")
        # The job environment (.venv-image), not this process's: jobs run the container's stack.
        self.python = python or image_python()
        # Image URIs of the second image (the stack's AccelerateImageUri, told by LocalCloud): their jobs and
        # endpoints run in .venv-accelerate, looked up when one starts (a machine without it runs the rest).
        self.accelerate_images: set[str] = set()
        self.region = region
        self.extra_env = dict(extra_env or {})
        self.ping_timeout_s = ping_timeout_s
        self.stop_grace_s = stop_grace_s
        self.invoke_timeout_s = invoke_timeout_s
        self._s3 = S3Transfer(endpoint_url, region)
        # Jobs' output and training metrics in the local CloudWatch (sdflow/local/sagemaker/job_logs.py); the
        # local cloud's `log_sink` shares its flusher, else this object runs its own.
        self.job_logs = JobLogs(account_id, region, log_sink)
        # SageMaker moves a job's data with the job's RoleArn (a model's ExecutionRoleArn): when set
        # (LocalCloud, IAM enforced), role ARN -> that role's STS credentials as environment variables.
        self.role_credentials: Callable[[str], Mapping[str, str]] | None = None
        self._role_s3: dict[str, S3Transfer] = {}
        self._endpoint_url = endpoint_url
        self._lock = threading.RLock()
        self._jobs: dict[tuple[Kind, str], Job] = {}
        self._endpoints: dict[str, EndpointState] = {}
        self._wall: dict[str, float] = {}
        self._closing = threading.Event()
        # The serve processes are plain 127.0.0.1 HTTP: never through a proxy from the environment.
        self._http = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _job_s3(self, job: Job) -> S3Transfer:
        return self._s3_for(job.request.get("RoleArn"))

    def _s3_for(self, role_arn: str | None) -> S3Transfer:
        if self.role_credentials is None or not role_arn:
            return self._s3
        with self._lock:
            found = self._role_s3.get(role_arn)
            if found is None:
                found = self._role_s3[role_arn] = S3Transfer(
                    self._endpoint_url, self.region, self.role_credentials(role_arn)
                )
        return found

    # -- reporting --------------------------------------------------------------------------

    def _report(self, kind: Kind, name: str, status: str, fields: dict[str, Any]) -> None:
        LOG.info("%s %s: %s %s", kind, name, status, fields.get("SecondaryStatus") or fields.get("FailureReason") or "")
        try:
            self.listener.job_status_changed(kind, name, status, dict(fields))
        except Exception:  # the job goes on (and ends) even if a listener is broken
            LOG.exception("status listener failed for %s %s -> %s", kind, name, status)

    # -- environment and commands -----------------------------------------------------------

    def use_accelerate_image(self, image_uri: str) -> None:
        """Jobs and models of this image run in the accelerate job environment (job_env.accelerate_python)."""
        with self._lock:
            self.accelerate_images.add(image_uri)

    def python_for(self, image_uri: str | None) -> str:
        """The Python that runs an image's code: the accelerate environment for the second image, the job
        environment otherwise. JobSetupError (the job fails, as a missing image fails on SageMaker) naming
        `make setup` when the accelerate environment is not there."""
        if not image_uri or image_uri not in self.accelerate_images:
            return self.python
        try:
            return accelerate_python()
        except JobEnvironmentMissing as exc:
            raise JobSetupError(f"image {image_uri}: {exc}") from None

    def _environment(
        self,
        opt_ml: Path,
        request_env: Mapping[str, str] | None,
        fixed: Mapping[str, str],
        role_arn: str | None = None,
        python: str | None = None,
    ) -> dict[str, str]:
        env = {key: os.environ[key] for key in PASSTHROUGH_ENV if key in os.environ}
        python_bin = str(Path(python or self.python).parent)
        env["PATH"] = os.pathsep.join(p for p in (python_bin, env.get("PATH", "")) if p)
        env.update(
            {
                "PYTHONPATH": str(self.image_dir),
                "PYTHONUNBUFFERED": "1",
                "NO_ALBUMENTATIONS_UPDATE": "1",  # albumentations asks PyPI for updates on import
                "WANDB_MODE": "disabled",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                # The instances share this machine's cores, with each other and the local cloud:
                # torch's OpenMP threads spin while they wait (libgomp's default) and take the cores
                # the others need (job_env.py WAIT_POLICY).
                "OMP_WAIT_POLICY": WAIT_POLICY,
                # Importing Colossal-AI's booster starts torch inductor's pool of compile workers
                # (one more interpreter importing torch, ~1 s of CPU per training process), and
                # nothing in the image compiles: compile in the process instead, if ever.
                "TORCHINDUCTOR_COMPILE_THREADS": "1",
                "AWS_REGION": self.region,
                "AWS_DEFAULT_REGION": self.region,
                # boto3 in the container (training streams its shards from S3, downloads write theirs)
                # must reach the local cloud's S3, as a real container reaches S3 with the job's role.
                "AWS_ENDPOINT_URL": self._endpoint_url,
            }
        )
        env.update(self._role_environment(role_arn))
        env.update(self.extra_env)
        env.update({str(k): str(v) for k, v in (request_env or {}).items()})
        env.update(fixed)
        env["SDFLOW_OPT_ML"] = str(opt_ml)
        return env

    def _role_environment(self, role_arn: str | None) -> Mapping[str, str]:
        """The job role's credentials, as SageMaker hands them to a container: its STS keys when the
        local cloud enforces IAM, else the keys every local client uses."""
        if self.role_credentials is not None and role_arn:
            return self.role_credentials(role_arn)
        return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing"}

    def _entrypoint(self, name: str, field_name: str) -> Path:
        script = self.bin_dir / Path(name).name
        if not script.is_file():
            known = sorted(p.name for p in self.bin_dir.iterdir() if p.is_file())
            raise JobSetupError(f"{field_name} {name!r} is not an entrypoint of the image; use one of {known}")
        return script

    def _processing_command(self, request: dict[str, Any], opt_ml: Path, python: str) -> list[str]:
        app = request.get("AppSpecification") or {}
        argv = [str(a) for a in (app.get("ContainerEntrypoint") or [])]
        if not argv:
            raise JobSetupError(
                'AppSpecification.ContainerEntrypoint is required locally (the image has no default): e.g. ["download"]'
            )
        argv += [str(a) for a in (app.get("ContainerArguments") or [])]
        # ["python3", "/opt/ml/code/bin/download", …] runs the same script as ["download", …].
        if Path(argv[0]).name.startswith("python") and len(argv) > 1:
            argv = argv[1:]
        script = self._entrypoint(argv[0], "AppSpecification.ContainerEntrypoint")
        return [python, str(script), *(rewrite_container_paths(a, opt_ml) for a in argv[1:])]

    # -- public: jobs -----------------------------------------------------------------------

    def _new_job(self, kind: Kind, request: dict[str, Any], name_field: str) -> Job:
        name = request.get(name_field)
        if not isinstance(name, str) or not name:
            raise LocalSageMakerError(f"{name_field} is required")
        if self._closing.is_set():
            raise LocalSageMakerError("the local SageMaker is shut down")
        with self._lock:
            existing = self._jobs.get((kind, name))
            if existing is not None and not existing.done.is_set():
                raise JobAlreadyRunning(f"{kind} job {name} is still running")
            folder = self.workdir / "jobs" / name
            if folder.exists():
                shutil.rmtree(folder)  # a rerun of a finished job starts from a clean slate
            folder.mkdir(parents=True)
            job = Job(kind=kind, name=name, folder=folder, request=request)
            self._jobs[(kind, name)] = job
        return job

    def run_processing_job(self, request: dict[str, Any]) -> None:
        job = self._new_job("processing", request, "ProcessingJobName")
        self._start(job, self._run_processing)

    def run_training_job(self, request: dict[str, Any]) -> None:
        job = self._new_job("training", request, "TrainingJobName")
        self._start(job, self._run_training)

    def _start(self, job: Job, target: Callable[[Job], None]) -> None:
        def run() -> None:
            # A job's containers are work: the local cloud's clock runs at real speed meanwhile,
            # so MaxRuntimeInSeconds and the job's own timings keep their real length.
            try:
                with current_clock().busy():
                    target(job)
            finally:
                job.done.set()

        job.thread = threading.Thread(target=run, name=f"sdflow-{job.kind}-{job.name}", daemon=True)
        job.thread.start()

    def stop_job(self, kind: Kind, name: str) -> None:
        """StopProcessingJob / StopTrainingJob (SIGTERM, then kill after the grace), or for an
        endpoint, stop its serve process (DeleteEndpoint)."""
        if kind == "endpoint":
            self.delete_endpoint(name)
            return
        with self._lock:
            job = self._jobs.get((kind, name))
        if job is None:
            raise LocalSageMakerError(f"no {kind} job named {name}")
        job.stop_requested.set()

    def kill_job(self, kind: Kind, name: str, host: str = "algo-1", timeout_s: float = 60.0) -> int:
        """Fault injection: SIGKILL the container process group of one host of a running job, as
        when its instance dies or the kernel's OOM killer strikes (the container's processes outside
        the group end with its main process: sagemaker/container.py); the job then fails as SageMaker
        reports a killed algorithm (exit code 137). Waits up to `timeout_s` for the container to
        start (inputs are downloaded first). Returns the pid killed."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                job = self._jobs.get((kind, name))
                process = next((p for p in job.processes if p.label == f"{name}/{host}"), None) if job else None
            if job is None or job.done.is_set():
                raise LocalSageMakerError(f"no running {kind} job named {name}")
            if process is not None and process.alive():
                signal_group(process.pid, signal.SIGKILL)
                return process.pid
            if time.monotonic() > deadline:
                raise LocalSageMakerError(f"{kind} job {name} started no container on {host} within {timeout_s:g} s")
            time.sleep(0.05)

    def wait(self, kind: Kind, name: str, timeout: float | None = None) -> str:
        """Block until the job ends; returns its final status (for tests and the CLI)."""
        with self._lock:
            job = self._jobs.get((kind, name))
        if job is None:
            raise LocalSageMakerError(f"no {kind} job named {name}")
        job.done.wait(timeout)
        return job.status

    def job_wall_times(self) -> dict[str, float]:
        """Seconds the container processes ran, per processing/training job name, and per
        endpoint config name the seconds from starting `serve` to its first healthy /ping."""
        with self._lock:
            return dict(self._wall)

    def training_progress(self, name: str) -> dict[str, Any]:
        """The training job's latest `step=N loss=X`, metrics and status; {} for an unknown job."""
        with self._lock:
            job = self._jobs.get(("training", name))
            if job is None:
                return {}
            hyperparameters = job.request.get("HyperParameters") or {}
            max_steps = str(hyperparameters.get("max_train_steps", ""))
            return {
                "status": job.status,
                "secondary_status": job.secondary_status,
                "step": job.step,
                "loss": job.loss,
                "max_steps": int(max_steps) if max_steps.isdigit() else None,
                "metrics": {metric: value for metric, (value, _ts) in job.metrics.items()},
                "log": str(job.folder / "algo-1.log"),
            }

    # -- running containers -----------------------------------------------------------------

    def _master_port(self) -> int:
        # Through this module's `free_port`: the unit tests replace that name, as they open no socket.
        return free_port()

    def _supervise(self, job: Job, hosts: list[tuple[ContainerProcess, Path]], max_runtime_s: float) -> Outcome:
        """Wait for every host to exit 0; stop them all on the first failure, a stop request,
        shutdown, or MaxRuntimeInSeconds."""
        clock = current_clock()
        deadline = clock.monotonic() + max_runtime_s
        processes = [p for p, _ in hosts]
        outcome: Outcome | None = None
        while outcome is None:
            if job.stop_requested.is_set() or self._closing.is_set():
                outcome = Outcome("stopped")
            elif clock.monotonic() > deadline:
                outcome = Outcome("timeout")
            else:
                for process, opt_ml in hosts:
                    code = process.poll()
                    if code not in (None, 0):
                        outcome = Outcome("failed", process, opt_ml)
                        break
                else:
                    if all(p.poll() == 0 for p in processes):
                        outcome = Outcome("completed")
                if outcome is None:
                    time.sleep(POLL_S)
        terminate(processes, self.stop_grace_s)
        for process in processes:
            process.finish_log()
        self.job_logs.flush()  # the job's lines are readable once its status changes
        with self._lock:
            self._wall[job.name] = max(p.wall_s() for p in processes)
        return outcome

    # -- processing -------------------------------------------------------------------------

    def _run_processing(self, job: Job) -> None:
        name = job.name
        started = utc_now()
        times: dict[str, Any] = {"ProcessingStartTime": started}
        self._report("processing", name, "InProgress", times)
        opt_ml = job.folder / "algo-1"
        try:
            status, fields = self._processing(job, opt_ml)
        except JobSetupError as exc:
            status, fields = "Failed", {"FailureReason": clip_reason(f"ClientError: {exc}")}
        except Exception as exc:
            LOG.exception("processing job %s", name)
            status, fields = (
                "Failed",
                {"FailureReason": clip_reason(f"InternalServerError: {type(exc).__name__}: {exc}")},
            )
        job.status = status
        self._report("processing", name, status, times | fields | {"ProcessingEndTime": utc_now()})

    def _processing(self, job: Job, opt_ml: Path) -> tuple[str, dict[str, Any]]:
        request = job.request
        for i, item in enumerate(request.get("ProcessingInputs") or []):
            where = f"ProcessingInputs[{i}] ({item.get('InputName', '?')})"
            s3_input = item.get("S3Input")
            if s3_input is None:
                raise JobSetupError(f"{where}: only S3Input is supported locally, not DatasetDefinition")
            local = container_path(s3_input["LocalPath"], opt_ml, f"{where}.S3Input.LocalPath")
            data_type = s3_input.get("S3DataType", "S3Prefix")
            self._job_s3(job).download_input(data_type, s3_input["S3Uri"], local, f"{where}.S3Input.S3Uri")
        outputs = []
        for i, item in enumerate((request.get("ProcessingOutputConfig") or {}).get("Outputs") or []):
            where = f"ProcessingOutputConfig.Outputs[{i}] ({item.get('OutputName', '?')})"
            s3_output = item.get("S3Output")
            if s3_output is None:
                raise JobSetupError(f"{where}: only S3Output is supported locally")
            local = container_path(s3_output["LocalPath"], opt_ml, f"{where}.S3Output.LocalPath")
            parse_s3_uri(s3_output["S3Uri"], f"{where}.S3Output.S3Uri")
            local.mkdir(parents=True, exist_ok=True)  # SageMaker creates the output folders
            outputs.append((local, s3_output["S3Uri"], f"{where}.S3Output.S3Uri"))
        python = self.python_for((request.get("AppSpecification") or {}).get("ImageUri"))
        command = self._processing_command(request, opt_ml, python)
        env = self._environment(
            opt_ml, request.get("Environment"), {"PROCESSING_JOB_NAME": job.name}, request.get("RoleArn"), python
        )
        runtime_s = max_runtime(request)
        (opt_ml / "output").mkdir(parents=True, exist_ok=True)
        lines = self.job_logs.host_lines("processing", job.name, "algo-1")
        process = ContainerProcess(f"{job.name}/algo-1", command, env, job.folder, job.folder / "algo-1.log", lines)
        job.processes = [process]
        hosts = [(process, opt_ml)]
        outcome = self._supervise(job, hosts, float(runtime_s))
        fields: dict[str, Any] = {}
        exit_message = read_text_or_none(opt_ml / "output" / "message")
        if exit_message:
            fields["ExitMessage"] = clip_reason(exit_message)
        if outcome.result == "completed":
            for local, uri, where in outputs:  # EndOfJob: after the container exits 0
                self._job_s3(job).upload_dir(local, uri, where)
            return "Completed", fields
        if outcome.result == "stopped":
            return "Stopped", fields
        if outcome.result == "timeout":
            return "Failed", fields | {"FailureReason": max_runtime_reason(runtime_s)}
        return "Failed", fields | {"FailureReason": failure_reason(outcome, hosts)}

    # -- shutdown ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every job and serve process this object started (SIGTERM, then SIGKILL after the grace)."""
        self._closing.set()
        with self._lock:
            jobs = list(self._jobs.values())
            endpoints = list(self._endpoints.values())
        for job in jobs:
            job.stop_requested.set()
        processes = [p for job in jobs for p in job.processes]
        for endpoint in endpoints:
            if endpoint.current is not None:
                processes.append(endpoint.current.process)
        terminate(processes, self.stop_grace_s)
        wait_until = time.monotonic() + self.stop_grace_s + 30
        for thread in [j.thread for j in jobs] + [t for e in endpoints for t in e.threads]:
            if thread is not None:
                thread.join(max(0.0, wait_until - time.monotonic()))
        # A deployment that was starting when shutdown began has terminated its own process;
        # anything that slipped through (started after the snapshot) goes now.
        with self._lock:
            late = [e.current.process for e in self._endpoints.values() if e.current is not None]
            late += [p for job in self._jobs.values() for p in job.processes]
        terminate(late, self.stop_grace_s)
        self.job_logs.close()
