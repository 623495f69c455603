"""torchrun (`torch.distributed.run`) whose workers get a longer grace after a stop signal.

SageMaker stops a training job by sending SIGTERM and kills the container 120 s later
(StopTrainingJob: "SageMaker sends the algorithm the SIGTERM signal, which delays job
termination for 120 seconds"; spot interruptions use the same path). torchrun's agent, on
SIGTERM, calls `PContext.close(death_sig)` with close's default `timeout=30`, so workers are
SIGKILLed 30 s later, mid-checkpoint. torch 2.5.1 has no option or environment variable for
that wait (run.py, launcher/api.py, agent/server/local_elastic_agent.py and
multiprocessing/api.py read none), so this module runs torchrun's own `main` with an agent
whose `_shutdown` closes the workers with `--stop_grace_s` (default 110 s: SageMaker's 120 s
less room for the agent and the container to exit). The grace is still a bound: a worker
that outlives it is SIGKILLed, as before.

Usage: python -m sdflow_image.training.elastic_run [--stop_grace_s S] -- <torchrun arguments>

Exit status: torchrun's, except after a stop signal, where it is 128 + the signal (143 for
SIGTERM, the status a stopped training process exits with) instead of a traceback's 1.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

DEFAULT_STOP_GRACE_S = 110.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class IncompatibleTorchError(RuntimeError):
    """The installed torch's elastic agent no longer has the shape this module extends."""


# LocalElasticAgent._shutdown's parameters: torch 2.5.1's, and the later one that takes close's
# timeout itself (pytorch/pytorch main, torch/distributed/elastic/agent/server/local_elastic_agent.py).
SHUTDOWN_WITH_RESTART = ["self", "death_sig", "is_restart"]
SHUTDOWN_WITH_TIMEOUT = ["self", "death_sig", "timeout"]
SHUTDOWN_SIGNAL_ONLY = ["self", "death_sig"]  # torch 2.11


def _check_torch(api_module: Any, agent_class: Any, pcontext_class: Any) -> list[str]:
    """Fail at launch, not silently at the first stop, if torch's internals moved; returns the
    shape of `_shutdown` found."""
    import torch

    problems = []
    if getattr(api_module, "LocalElasticAgent", None) is not agent_class:
        problems.append("torch.distributed.launcher.api.LocalElasticAgent is not the local elastic agent class")
    if "timeout" not in inspect.signature(pcontext_class.close).parameters:
        problems.append("PContext.close takes no timeout")
    shutdown = list(inspect.signature(agent_class._shutdown).parameters)
    if shutdown not in (SHUTDOWN_WITH_RESTART, SHUTDOWN_WITH_TIMEOUT, SHUTDOWN_SIGNAL_ONLY):
        problems.append(f"LocalElasticAgent._shutdown{tuple(shutdown[1:])} is none of (death_sig, is_restart), "
                        "(death_sig, timeout), (death_sig)")  # fmt: skip
    if problems:
        raise IncompatibleTorchError(
            f"sdflow_image.training.elastic_run was written against torch 2.5.1's elastic agent; torch "
            f"{torch.__version__}: {'; '.join(problems)}. Re-check how torchrun stops workers."
        )
    return shutdown


def install_stop_grace(grace_s: float) -> None:
    """Make `torch.distributed.launcher.api.launch_agent` build an agent that gives its
    workers `grace_s` seconds between the stop signal and SIGKILL."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext
    from torch.distributed.launcher import api as launcher_api

    installed: Any = launcher_api.LocalElasticAgent
    if getattr(installed, "stop_grace_s", None) is not None:
        installed.stop_grace_s = grace_s  # already installed in this process
        return
    shutdown = _check_torch(launcher_api, LocalElasticAgent, PContext)

    class GracefulStopAgent(LocalElasticAgent):
        stop_grace_s = grace_s

        def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, *args: Any, **kwargs: Any) -> None:
            # close's timeout is annotated int (it is used as float seconds)
            grace = math.ceil(self.stop_grace_s)
            if shutdown == SHUTDOWN_WITH_TIMEOUT:
                with _stop_signals_ignored():
                    super()._shutdown(death_sig, grace)  # type: ignore[arg-type]  # the later torch: (death_sig, timeout)
                return
            if self._pcontext is not None:
                with _stop_signals_ignored():
                    self._pcontext.close(death_sig, timeout=grace)
            # torch's own clean-up (watchdog, health server, rendezvous); its close(death_sig)
            # finds every worker gone and returns at once.
            super()._shutdown(death_sig, *args, **kwargs)

    launcher_api.LocalElasticAgent = GracefulStopAgent  # type: ignore[misc]


@contextlib.contextmanager
def _stop_signals_ignored() -> Iterator[None]:
    """While the workers save: a repeated stop signal (the launcher forwards SIGTERM and a
    process-group signal delivers it too) would raise torch's SignalException in the middle
    of close and cut the wait short."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _grace(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--stop_grace_s must be a number of seconds, got {value!r}") from None
    if not 0 < seconds < 3600:
        raise argparse.ArgumentTypeError(f"--stop_grace_s must be between 0 and 3600 seconds, got {value!r}")
    return seconds


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m sdflow_image.training.elastic_run",
        description="torchrun whose workers get --stop_grace_s seconds to exit after SIGTERM.",
    )
    parser.add_argument(
        "--stop_grace_s",
        type=_grace,
        default=DEFAULT_STOP_GRACE_S,
        help=f"seconds between the stop signal and SIGKILL for the workers (default {DEFAULT_STOP_GRACE_S:.0f})",
    )
    parser.add_argument("torchrun_args", nargs=argparse.REMAINDER, help="'--' then torchrun's own arguments")
    args = parser.parse_args(argv)
    if args.torchrun_args[:1] == ["--"]:
        args.torchrun_args = args.torchrun_args[1:]
    if not args.torchrun_args:
        parser.error("torchrun arguments are required after '--'")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    install_stop_grace(args.stop_grace_s)
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        run.main(args.torchrun_args)
    except SignalException as stop:
        print(f"elastic_run: {stop}; workers were given {args.stop_grace_s:.0f} s to exit", file=sys.stderr)
        return 128 + int(stop.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
