"""A recorder of the job status changes LocalSageMaker and NoOpSageMaker report to their listener."""

from __future__ import annotations

import threading
from typing import Any


class Recorder:
    """Every job_status_changed report, in order; `final` is a job's last end status and fields."""

    def __init__(self) -> None:
        self.reports: list[tuple[str, str, str, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def job_status_changed(self, kind: str, name: str, status: str, fields: dict[str, Any]) -> None:
        with self.lock:
            self.reports.append((kind, name, status, fields))

    def final(self, name: str) -> tuple[str, dict[str, Any]] | None:
        with self.lock:
            ends = [(s, f) for _k, n, s, f in self.reports if n == name and s in ("Completed", "Failed", "Stopped")]
        return ends[-1] if ends else None
