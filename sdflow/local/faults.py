"""Fault injection for the local cloud's tests: real faults, not fakes.

    with LocalCloud(workdir) as cloud:
        cloud.faults.kill_job("processing", job_name)          # SIGKILL its container -> Failed
        cloud.faults.fail_next_training_jobs(1)                 # next CreateTrainingJob -> CapacityError
        cloud.faults.kill_lambda_worker("JobEventsFunction")    # a busy worker dies -> Runtime.ExitError
        cloud.faults.crash_lambda_after("StartDownloadFunction", "sagemaker.CreateProcessingJob")
        cloud.faults.redeliver_sagemaker_event(job_name)        # the same event (same id) again
        cloud.faults.seed_job_history(5000)                     # an account that ran jobs for years
        # A lost event: disable the rule with plain boto3 (events.disable_rule); the local
        # EventBridge delivers nothing through a DISABLED rule (services/events.py).

Each fault acts as the failure it stands for would on AWS:
- kill_job: the job's container process group gets SIGKILL (an instance lost, the OOM killer);
  the job ends Failed with "AlgorithmError: exit code 137 (killed by SIGKILL) …" and its state-change
  event. With NoOpSageMaker the held job ends Failed the same way.
- fail_next_training_jobs: the next N CreateTrainingJob calls succeed, and each job ends Failed
  with SageMaker's capacity reason "CapacityError: Unable to provision requested ML compute
  capacity. …" without running (sagemaker/capacity.py).
- kill_lambda_worker: SIGKILL of a worker process while it runs an invocation of the function;
  that invocation answers Runtime.ExitError, as a crashed Lambda sandbox does.
- crash_lambda_after: the function's next invocation that makes the named boto3 call exits right
  after the call succeeded (its side effect stays), answering Runtime.ExitError; `times` such
  crashes in all, across the function's workers; later invocations run normally.
- seed_job_history: SageMaker keeps every job's record for ever, so an account's ListProcessingJobs
  pages through every job it ever ran; `count` Completed download-job records of earlier runs are
  added (records only: nothing runs, no event is sent).
- redeliver_sagemaker_event: EventBridge delivers at least once; the same event (same id, time and
  detail) goes again to every rule of the default bus that matches it."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import uuid
from pathlib import Path
from typing import Any, Protocol

from sdflow.local import lambda_worker
from sdflow.local.account import ACCOUNT_ID, REGION
from sdflow.local.runtime import Runtime, current_clock
from sdflow.local.sagemaker.service import SageMakerStatusPublisher
from sdflow.local.template import Deployment


class FaultTarget(Protocol):
    """What Faults reaches on its LocalCloud (sdflow/local/cloud.py), which owns it."""

    runtime: Runtime | None
    deployment: Deployment | None
    status_publisher: SageMakerStatusPublisher


EVENT_STATUS_FIELDS = ("ProcessingJobStatus", "TrainingJobStatus", "EndpointStatus")


class FaultError(RuntimeError):
    """A fault cannot be injected as asked (nothing to kill, no such event, cloud not started)."""


class Faults:
    """Fault injection on a started LocalCloud; reached as `cloud.faults`."""

    def __init__(self, cloud: FaultTarget) -> None:
        self.cloud = cloud

    def _runtime(self) -> Any:
        runtime = self.cloud.runtime
        if runtime is None:
            raise FaultError("the local cloud is not started; start it before injecting faults")
        return runtime

    def _function(self, function: str) -> str:
        """A template logical id (e.g. "JobEventsFunction") or a deployed function name."""
        deployment = self.cloud.deployment
        if deployment is not None and function in deployment.functions:
            return deployment.functions[function].name
        return function

    # ------------------------------------------------------------------ SageMaker

    def kill_job(self, kind: str, name: str, *, host: str = "algo-1", timeout_s: float = 60.0) -> int:
        """SIGKILL the container of a running processing or training job (`kind` "processing" |
        "training"); waits up to `timeout_s` for the container to start. Returns its pid (0 for
        NoOpSageMaker, which has no process)."""
        if kind not in ("processing", "training"):
            raise FaultError(f"kind must be 'processing' or 'training', got {kind!r}")
        sagemaker = self._runtime().sagemaker
        if sagemaker is None or not hasattr(sagemaker, "kill_job"):
            raise FaultError("this local cloud runs no SageMaker that can kill a job (sagemaker_factory=None?)")
        try:
            return int(sagemaker.kill_job(kind, name, host=host, timeout_s=timeout_s))
        except LookupError as exc:
            raise FaultError(str(exc)) from None
        except RuntimeError as exc:  # LocalSageMakerError: no such running job, no container in time
            raise FaultError(str(exc)) from None

    def fail_next_training_jobs(self, count: int = 1) -> None:
        """The next `count` training jobs fail for capacity (InsufficientCapacity), as SageMaker
        fails a job it cannot find instances for. Adds to any count still pending."""
        if count < 1:
            raise FaultError(f"count must be >= 1, got {count}")
        runtime = self._runtime()
        with runtime.faults_lock:
            runtime.training_capacity_failures += count

    def pending_capacity_failures(self) -> int:
        return int(self._runtime().training_capacity_failures)

    def redeliver_sagemaker_event(self, name: str, status: str | None = None) -> dict[str, Any]:
        """Deliver again the last state-change event published for the job or endpoint `name`
        (the last one with that status, when given), with its original id. Returns the event."""
        publisher = self.cloud.status_publisher
        with publisher.lock:
            published = list(publisher.published)
        for entry in reversed(published):
            detail = json.loads(entry["Detail"])
            if not any(str(r).endswith(f"/{name}") for r in entry.get("Resources", [])):
                continue
            if status is not None and status not in (detail.get(f) for f in EVENT_STATUS_FIELDS):
                continue
            return self._deliver_again(entry, detail)
        with_status = f" with status {status}" if status else ""
        raise FaultError(f"no SageMaker event was published for {name!r}{with_status}")

    def _deliver_again(self, entry: dict[str, Any], detail: dict[str, Any]) -> dict[str, Any]:
        """What moto's put_events builds for each rule, with the first delivery's id and time."""
        from moto.events.models import _BASE_EVENT_MESSAGE, events_backends

        backend = events_backends[ACCOUNT_ID][REGION]
        message: Any = copy.deepcopy(_BASE_EVENT_MESSAGE)
        message.update(
            {
                "id": entry.get("EventId") or str(uuid.uuid4()),
                "detail-type": entry["DetailType"],
                "source": entry["Source"],
                "account": ACCOUNT_ID,
                "time": entry.get("Time", current_clock().time()),
                "region": REGION,
                "resources": list(entry.get("Resources", [])),
                "detail": detail,
                "ingestion-time": current_clock().time(),
            }
        )
        for rule in list(backend.describe_event_bus("default").rules.values()):
            rule.send_to_targets(copy.deepcopy(message))
        return message

    # ------------------------------------------------------------------ Lambda

    def fail_api_calls(self, operation: str, code: str, message: str, *, times: int = 1, status: int = 400) -> None:
        """Answer the next `times` calls of `operation` ("<IAM service prefix>.<Operation>", e.g.
        "sagemaker.StopTrainingJob"), from any caller, with the error `code` and `message` in the
        service's protocol, as AWS answers a throttled or failing call. Non-S3 services."""
        service, _, op = operation.partition(".")
        if not service or not op or not op[0].isupper():
            raise FaultError(
                f"operation must be '<service>.<Operation>', e.g. 'sagemaker.StopTrainingJob'; got {operation!r}"
            )
        if times < 1:
            raise FaultError(f"times must be >= 1, got {times}")
        runtime = self._runtime()
        with runtime.faults_lock:
            runtime.api_errors[(service, op)] = [code, message, status, times]

    def seed_job_history(self, count: int) -> list[str]:
        """`count` Completed processing-job records of earlier runs (sdflow's names, other run
        hashes), straight into the SageMaker backend: the history a long-used account holds."""
        from moto.sagemaker.models import FakeProcessingJob, sagemaker_backends

        if count < 1:
            raise FaultError(f"count must be >= 1, got {count}")
        self._runtime()
        backend = sagemaker_backends[ACCOUNT_ID][REGION]
        seeded = []
        for i in range(count):
            name = f"sdf-dl-history-{uuid.uuid4().hex[:12]}-{i % 10_000:05d}-r0-a0"
            backend.processing_jobs[name] = FakeProcessingJob(
                app_specification={"ImageUri": "history", "ContainerEntrypoint": ["download"]},
                experiment_config={},
                network_config={},
                processing_inputs=[],
                processing_job_name=name,
                processing_output_config={},
                account_id=ACCOUNT_ID,
                region_name=REGION,
                role_arn=f"arn:aws:iam::{ACCOUNT_ID}:role/history",
                tags=[],
                stopping_condition={"MaxRuntimeInSeconds": 3600},
            )
            seeded.append(name)
        return seeded

    def drop_end_event(self, execution_arn: str) -> None:
        """Never deliver the execution's "Step Functions Execution Status Change" event of its end
        (SUCCEEDED, FAILED, TIMED_OUT, ABORTED): EventBridge carries them best effort."""
        runtime = self._runtime()
        with runtime.faults_lock:
            runtime.dropped_end_events.add(execution_arn)

    def kill_lambda_worker(self, function: str, *, timeout_s: float = 30.0) -> int:
        """SIGKILL a worker process of `function` (logical id or name) while it runs an invocation:
        one busy now, or else the one that takes the next invocation, waiting up to `timeout_s`
        for it. Returns the pid killed."""
        runner = self._runtime().lambda_runner
        name = self._function(function)
        pids = runner.busy_worker_pids(name)
        if pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pids[0], signal.SIGKILL)  # its own session: the group is the worker's
            return int(pids[0])
        armed = runner.arm_kill(name)
        if not armed.wait(timeout_s):
            runner.disarm_kill(name, armed)
            raise FaultError(f"no invocation of {name} came within {timeout_s:g} s")
        return armed.pid

    def crash_lambda_after(self, function: str, operation: str, *, times: int = 1) -> Path:
        """Make `times` invocations of `function` exit (Runtime.ExitError) right after a successful
        boto3 call `operation` ("<service>.<Operation>", e.g. "sagemaker.CreateProcessingJob",
        botocore's service name and operation name). Applies to workers started from now on (the
        function's warm workers are not reused). Returns the folder that records each crash done."""
        service, _, op = operation.partition(".")
        if not service or not op or not op[0].isupper():
            raise FaultError(
                f"operation must be '<service>.<Operation>' as botocore names them, e.g. "
                f"'sagemaker.CreateProcessingJob'; got {operation!r}"
            )
        if times < 1:
            raise FaultError(f"times must be >= 1, got {times}")
        runtime = self._runtime()
        name = self._function(function)
        claims = Path(runtime.workdir) / "faults" / f"{name}-{op}-{uuid.uuid4().hex[:8]}"
        runtime.lambda_runner.fault_env[name] = {
            lambda_worker.EXIT_AFTER_ENV: operation,
            lambda_worker.EXIT_TIMES_ENV: str(times),
            lambda_worker.EXIT_CLAIMS_ENV: str(claims),
        }
        return claims

    def clear_lambda_crash(self, function: str) -> None:
        """Workers of `function` started from now on run without the crash."""
        self._runtime().lambda_runner.fault_env.pop(self._function(function), None)

    @staticmethod
    def crashes_done(claims: Path) -> int:
        """How many crashes of a crash_lambda_after() fault have happened."""
        return len(list(claims.iterdir())) if claims.is_dir() else 0
