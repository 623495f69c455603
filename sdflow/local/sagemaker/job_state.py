"""A local SageMaker job's state, the listener told of its status changes, and how a supervised
run ended: an Outcome, and the FailureReason SageMaker would give for it. Shared by the
processing jobs of LocalSageMaker (sdflow/local/sagemaker/engine.py) and its training half
(sdflow/local/sagemaker/training.py)."""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, Protocol

from sdflow.local.sagemaker.container import ContainerProcess
from sdflow.local.sagemaker.host import (
    REASON_LIMIT,
    clip_reason,
    read_text_or_none,
)

Kind = Literal["processing", "training", "endpoint"]

DEFAULT_MAX_RUNTIME_S = 86_400  # SageMaker's default StoppingCondition


class StatusListener(Protocol):
    def job_status_changed(self, kind: Kind, name: str, status: str, fields: dict[str, Any]) -> None:
        """Called on every status change, from any thread.
        processing: status InProgress | Completed | Failed | Stopped; fields may hold
          FailureReason, ExitMessage, ProcessingStartTime, ProcessingEndTime (datetime).
        training: status InProgress | Completed | Failed | Stopped; fields may hold
          SecondaryStatus, FailureReason, ModelArtifacts={"S3ModelArtifacts": uri},
          FinalMetricDataList=[{"MetricName","Value","Timestamp"}], TrainingStartTime, TrainingEndTime,
          BillableTimeInSeconds.
        endpoint: status Creating | Updating | InService | Failed | RollingBack; fields may hold
          EndpointConfigName (the config now serving), FailureReason."""


@dataclass
class Job:
    kind: Kind
    name: str
    folder: Path
    request: dict[str, Any]
    stop_requested: threading.Event = field(default_factory=threading.Event)
    processes: list[ContainerProcess] = field(default_factory=list)
    thread: threading.Thread | None = None
    status: str = "InProgress"
    secondary_status: str | None = None
    step: int | None = None
    loss: float | None = None
    metrics: dict[str, tuple[float, datetime]] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class Outcome:
    result: Literal["completed", "failed", "stopped", "timeout"]
    failed: ContainerProcess | None = None
    failed_opt_ml: Path | None = None


def max_runtime(request: dict[str, Any]) -> Any:
    return (request.get("StoppingCondition") or {}).get("MaxRuntimeInSeconds", DEFAULT_MAX_RUNTIME_S)


def max_runtime_reason(seconds: Any) -> str:
    return (
        f"MaxRuntimeExceeded: the job ran longer than StoppingCondition.MaxRuntimeInSeconds={seconds} and was stopped"
    )


def failure_reason(outcome: Outcome, hosts: list[tuple[ContainerProcess, Path]]) -> str:
    """The failure file of the failed host (any host's, if it left none), else its output/message,
    else the tail of its log, as SageMaker fills FailureReason."""
    assert outcome.failed is not None
    assert outcome.failed_opt_ml is not None
    candidates = [outcome.failed_opt_ml] + [o for _, o in hosts if o != outcome.failed_opt_ml]
    for opt_ml in candidates:
        text = read_text_or_none(opt_ml / "output" / "failure")
        if text:
            return clip_reason(f"AlgorithmError: {text}")
    message = read_text_or_none(outcome.failed_opt_ml / "output" / "message")
    if message:
        return clip_reason(f"AlgorithmError: {message}")
    code = outcome.failed.popen.returncode
    # A container killed by a signal exits 128 + N under Docker, as on SageMaker.
    code_text = f"exit code {128 - code} (killed by {signal.Signals(-code).name})" if code < 0 else f"exit code {code}"
    tail = outcome.failed.tail_text()[-(REASON_LIMIT - 100) :]
    return clip_reason(f"AlgorithmError: {code_text} on {outcome.failed.label}; last log lines:\n{tail}")
