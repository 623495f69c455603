"""SageMaker's capacity failure of a training job, injected on demand (sdflow/local/faults.py).

On AWS a CreateTrainingJob call succeeds, the job sits InProgress / Starting while SageMaker looks
for instances, and when none can be had the job ends Failed with

    CapacityError: Unable to provision requested ML compute capacity. Please retry using a
    different ML instance type.

(the FailureReason SageMaker gives, quoted in DIAGNijmegen/rse-grand-challenge#2631 and
aws/sagemaker-pytorch-training-toolkit#171). No container ever runs and nothing is billed. Here
the job is created as usual (ARN, tags, instance quota held), no local process starts, and after
`CAPACITY_DELAY_S` its Failed status is reported through the same listener as a real job's, so
DescribeTrainingJob, ListTrainingJobs and the "SageMaker Training Job State Change" event all
show it."""

from __future__ import annotations

from typing import Any

from sdflow.local.clock import Clock, Timer
from sdflow.local.runtime import Runtime
from sdflow.local.sagemaker.host import utc_now

CAPACITY_FAILURE_REASON = (
    "CapacityError: Unable to provision requested ML compute capacity. Please retry using a different ML instance type."
)
# How long the job stays InProgress / Starting before it fails (minutes on AWS).
CAPACITY_DELAY_S = 0.5


def take_capacity_failure(runtime: Runtime) -> bool:
    """True (and one fewer left) when this CreateTrainingJob is to fail for capacity."""
    with runtime.faults_lock:
        if runtime.training_capacity_failures <= 0:
            return False
        runtime.training_capacity_failures -= 1
        return True


def fail_for_capacity(listener: Any, name: str, clock: Clock, delay_s: float = CAPACITY_DELAY_S) -> Timer:
    """Report the training job Failed for capacity after `delay_s` on the clock, as SageMaker would."""

    def report() -> None:
        fields = {
            "SecondaryStatus": "Failed",
            "FailureReason": CAPACITY_FAILURE_REASON,
            "TrainingEndTime": utc_now(),
            "BillableTimeInSeconds": 0,
        }
        listener.job_status_changed("training", name, "Failed", fields)

    return clock.call_later(delay_s, report, what=f"capacity failure of {name}")
