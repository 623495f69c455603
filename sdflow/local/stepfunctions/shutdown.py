"""Step Functions when the local cloud stops: every run still going ends ABORTED, saying why.

Stopping `sdflow local up` closes the cloud's clock, which ends every wait at once "as if its time
had come" (sdflow/local/clock.py): a task waiting for its job's token then ended as a task timeout,
and the run FAILED with States.Timeout and no cause, its notification reading "Cause: (no cause
given)" and recommending a redrive. On AWS nothing stops the service under a run; what stops a
run from outside is StopExecution, which ends it ABORTED with an error and a cause of the caller's
(API reference, StopExecution: error 0-256 characters, cause 0-32,768; "not supported by EXPRESS
state machines"). So before the clock closes, each running standard execution is stopped that way
(stepfunctions/api.py stop_execution), with an error and a cause that say the local cloud stopped,
and the deliveries of those ends (the notification, its cleanup) are given a moment to finish
while the Lambda workers still run."""

from __future__ import annotations

import logging
import time
from typing import Any

from sdflow.local.runtime import Runtime
from sdflow.local.stepfunctions.api import stop_execution
from sdflow.local.stepfunctions.executions import is_express
from sdflow_common.notify import LOCAL_CLOUD_STOPPED

LOG = logging.getLogger("sdflow.local")

STOPPED_ERROR = LOCAL_CLOUD_STOPPED
STOPPED_CAUSE = (
    "The local cloud stopped (`sdflow local up` ended, or the program that ran it) while this run was "
    "running: the run was interrupted, not failed, and its jobs and endpoint deployments were stopped with "
    "the cloud. The local cloud keeps no state between starts: start it again and start the run anew."
)
# Time for the ends' deliveries (an asynchronous invocation each) to start on their own threads.
DELIVERY_START_S = 0.3
DELIVERY_WAIT_S = 30.0


def _backend(account: str, region: str) -> Any:
    from moto.stepfunctions.parser.models import stepfunctions_parser_backends

    return stepfunctions_parser_backends[account][region]


def end_running_executions(runtime: Runtime, account: str, region: str) -> list[str]:
    """StopExecution, with STOPPED_ERROR and STOPPED_CAUSE, of every running standard execution
    (a Map Run's children go with their parent; an express workflow has no StopExecution); then wait,
    up to DELIVERY_WAIT_S, for the asynchronous invocations their ends started. Returns their ARNs."""
    from moto.stepfunctions.parser.api import ExecutionStatus

    backend = _backend(account, region)
    stopped = []
    for execution in backend._get_executions(ExecutionStatus.RUNNING):
        if is_express(execution):
            continue
        stop_execution(backend, execution.execution_arn, STOPPED_ERROR, STOPPED_CAUSE)
        stopped.append(str(execution.execution_arn))
    if stopped:
        time.sleep(DELIVERY_START_S)
        if not runtime.wait_idle(DELIVERY_WAIT_S):
            LOG.warning(
                "the ends of %d interrupted runs were still being delivered after %.0f s", len(stopped), DELIVERY_WAIT_S
            )
        LOG.info("the local cloud stopped %d running executions: %s", len(stopped), ", ".join(stopped))
    return stopped
