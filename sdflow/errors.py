"""Problems the user can fix: the CLI prints them without a traceback, the SDK raises them.

Each message says what to do next. Catch `SdflowError` for all of them."""

from __future__ import annotations

from typing import Protocol


class EndedRun(Protocol):
    """What RunFailed reports of a run (sdflow.sdk.summary.RunSummary is one)."""

    @property
    def name(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def failed_state(self) -> str | None: ...
    @property
    def error(self) -> str | None: ...
    @property
    def cause(self) -> str | None: ...


class SdflowError(Exception):
    """A problem the user can fix."""


CliError = SdflowError  # the CLI's name for it, older than the SDK


class NotConnected(SdflowError):
    """Neither a running local cloud nor a deployed stack was found."""


class RunNotFound(SdflowError):
    """No execution of the pipeline has that name or ARN."""


class ManifestRejected(SdflowError):
    """StartPipeline rejected an uploaded manifest; `report` is its rejection report."""

    def __init__(self, message: str, report: dict[str, object], report_uri: str) -> None:
        super().__init__(message)
        self.report, self.report_uri = report, report_uri


class NoEndpoint(SdflowError):
    """The run deployed no endpoint."""


class EndpointError(SdflowError):
    """The endpoint refused a request, or answered without an image."""


class WaitTimeout(SdflowError, TimeoutError):
    """A run was still going when the wait's time was up."""


class RunFailed(SdflowError):
    """A run ended FAILED, TIMED_OUT or ABORTED; `summary` says how far it got."""

    def __init__(self, summary: EndedRun) -> None:
        where = f" in {summary.failed_state}" if summary.failed_state else ""
        detail = f": {summary.error}" if summary.error else ""
        detail += f": {summary.cause}" if summary.cause else ""
        super().__init__(
            f"run {summary.name} ended {summary.status}{where}{detail[:600]}; "
            "run.resume() starts a run that reuses what it finished (a new document: run.resume(document))"
        )
        self.summary = summary
        self.error, self.cause = summary.error, summary.cause
