"""Container processes of the local SageMaker: their log, their members, their end, and stopping them.

SageMaker runs a job's image as `docker run IMAGE train` (or the processing job's entrypoint, or
`serve`): the container's main process is PID 1 of its own PID namespace, and "if the 'init'
process of a PID namespace terminates, the kernel terminates all of the processes in the namespace
via a SIGKILL signal" (pid_namespaces(7)). So when a host's main process dies (the OOM killer, a
crash), nothing it started outlives it: torchrun's workers stop training at once and write no more
checkpoints. Here a container is a process in its own process group, and that is not enough: a
container's helpers may leave the group (torchrun starts each worker with start_new_session;
img2dataset's runner calls setsid), and a worker whose launcher died is reparented to init. What
every process of a container keeps is its environment, so each container's processes carry
`SDFLOW_LOCAL_CONTAINER=<id>` from the main process on, and the container ends as a PID namespace
does: a thread waits for the main process and SIGKILLs, at once, every process carrying its id
(Linux's /proc; elsewhere its process group and the descendants it had)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

LOG = logging.getLogger("sdflow.local.sagemaker")

LOG_TAIL_LINES = 40
CONTAINER_ID_ENV = "SDFLOW_LOCAL_CONTAINER"
# A container's processes are killed, looked for again and killed again: one may have forked in between.
KILL_ROUNDS = 3
# How long poll() waits for a container whose main process ended to be gone.
END_WAIT_S = 10.0


def signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


def container_members(container_id: str) -> set[int]:
    """Every live process whose environment carries this container id (Linux /proc; empty elsewhere)."""
    entry = f"{CONTAINER_ID_ENV}={container_id}".encode()
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for proc in os.scandir("/proc"):
            if not proc.name.isdigit():
                continue
            try:
                environ = Path(proc.path, "environ").read_bytes()
            except OSError:  # gone meanwhile, or another user's
                continue
            if entry in environ.split(b"\0"):
                found.add(int(proc.name))
    return found


def descendants(pids: Iterable[int]) -> set[int]:
    """Every live descendant of these processes (Linux /proc; empty elsewhere). A container's
    helper may leave the process group (img2dataset's runner calls setsid), and on SageMaker
    the end of the container takes it along all the same."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path("/proc", entry.name, "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _kill(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


class ContainerProcess:
    """A container's main process in its own process group, its output copied line by line to a
    log file (and to `on_line`: CloudWatch Logs and training metrics) by a reader thread, and the
    container ended with it (module docstring) by a watcher thread."""

    def __init__(
        self,
        label: str,
        command: list[str],
        env: dict[str, str],
        cwd: Path,
        log_path: Path,
        on_line: Callable[[str], None] | None = None,
    ) -> None:
        self.label = label
        self.log_path = log_path
        self.tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self._on_line = on_line
        self.container_id = uuid.uuid4().hex
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.ended: float | None = None
        self._gone = threading.Event()  # the main process ended and the container with it
        self.popen = subprocess.Popen(
            command,
            env={**env, CONTAINER_ID_ENV: self.container_id},
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: a signal to the group reaches its children
        )
        self._reader = threading.Thread(target=self._read, name=f"sdflow-log-{label}", daemon=True)
        self._reader.start()
        self._watcher = threading.Thread(target=self._watch, name=f"sdflow-container-{label}", daemon=True)
        self._watcher.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        with self.log_path.open("ab") as log:
            for raw in self.popen.stdout:
                log.write(raw)
                log.flush()
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                self.tail.append(line)
                if self._on_line is not None:
                    try:
                        self._on_line(line)
                    except Exception:  # a metrics or log-sink bug must not stop the log copy (and block the child)
                        LOG.exception("log line handler failed for %s", self.label)

    def _watch(self) -> None:
        try:
            self.popen.wait()
            self.ended = time.monotonic()
            self.end_container()
        finally:
            self._gone.set()

    def end_container(self) -> None:
        """SIGKILL every process of the container, as the kernel ends a PID namespace whose init died."""
        signal_group(self.pid, signal.SIGKILL)
        for _ in range(KILL_ROUNDS):
            members = container_members(self.container_id)
            if not members:
                return
            _kill(members)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        """The main process's exit status once the container is gone; None while it runs."""
        code = self.popen.poll()
        if code is None:
            return None
        self._gone.wait(END_WAIT_S)  # the watcher reaped it: its container goes with it
        return code

    def alive(self) -> bool:
        return self.poll() is None

    def finish_log(self, timeout: float = 10.0) -> None:
        self._reader.join(timeout)

    def tail_text(self) -> str:
        return "\n".join(self.tail)

    def wall_s(self) -> float:
        return (self.ended if self.ended is not None else time.monotonic()) - self.started


def terminate(processes: Iterable[ContainerProcess], grace_s: float) -> None:
    """SIGTERM every live process group, SIGKILL what is left after `grace_s` (processes that left
    the group included), as SageMaker stops a container: `docker stop` signals the main process
    and the container's end takes the rest."""
    live = [p for p in processes if p.alive()]
    strays = descendants(p.pid for p in live)
    for process in live:
        signal_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(p.alive() for p in live) and time.monotonic() < deadline:
        time.sleep(0.05)
    for process in live:
        if process.alive():
            LOG.warning("%s ignored SIGTERM for %.0f s; killing it", process.label, grace_s)
            signal_group(process.pid, signal.SIGKILL)
            process.popen.wait()
        process.poll()
        process.end_container()
    _kill(strays)
    for process in live:
        process.finish_log()
