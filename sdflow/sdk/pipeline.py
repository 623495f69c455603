"""The pipeline and its runs, for notebooks and scripts: the calls the CLI makes (sdflow.runs), as objects."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from sdflow import history
from sdflow import progress as progress_mod
from sdflow import runs as runs_mod
from sdflow.errors import NoEndpoint, RunFailed
from sdflow.sdk.predictor import Predictor
from sdflow.sdk.summary import RunSummary, summarize
from sdflow.session import Session

DocumentLike = Mapping[str, Any] | str | os.PathLike[str]


def _document(document: DocumentLike) -> runs_mod.Document:
    return document if isinstance(document, Mapping) else Path(document)


class Pipeline:
    """The deployed pipeline (on AWS or the local cloud): starts runs and finds them."""

    def __init__(self, session: Session) -> None:
        self.session = session

    @classmethod
    def connect(
        cls,
        *,
        workdir: str | os.PathLike[str] | None = None,
        endpoint_url: str | None = None,
        stack_name: str | None = None,
        bucket: str | None = None,
        state_machine_arn: str | None = None,
        region: str | None = None,
    ) -> Pipeline:
        """The running `sdflow local up` (its state file in `workdir`, default .sdflow/), else the
        stack `stack_name` (CloudFormation outputs) at `endpoint_url` / $AWS_ENDPOINT_URL or on AWS;
        or `bucket` and `state_machine_arn` as given. NotConnected when none is found."""
        return cls(
            Session.connect(
                workdir=Path(workdir) if workdir is not None else None,
                endpoint_url=endpoint_url,
                stack_name=stack_name,
                bucket=bucket,
                state_machine_arn=state_machine_arn,
                region=region,
            )
        )

    @property
    def bucket(self) -> str:
        return self.session.data_bucket()

    @property
    def state_machine_arn(self) -> str:
        return self.session.pipeline_arn()

    def start(
        self, document: DocumentLike, *, via: Literal["upload", "api"] = "upload", name: str | None = None
    ) -> Run:
        """Start a run of `document` (a dict, or the path of a run manifest JSON).

        via="upload": PutObject under manifests/ (StartPipeline validates it and starts the run;
        ManifestRejected with its problems if not); `name` names the manifest file.
        via="api": StartExecution with the document as the input; `name` is the execution's name."""
        if via not in ("upload", "api"):
            raise ValueError(f"via must be 'upload' or 'api', not {via!r}")
        arn = runs_mod.start_run(self.session, _document(document), api=via == "api", name=name)
        return Run(self, arn)

    def run(self, name_or_arn: str) -> Run:
        """An existing run, by execution name or ARN; RunNotFound if there is none."""
        return Run(self, runs_mod.resolve_execution(self.session, name_or_arn))

    def runs(self, limit: int = 10) -> list[Run]:
        """The newest `limit` runs (at most 1,000), newest first."""
        sfn = self.session.client("stepfunctions")
        listed = runs_mod.executions(sfn, self.state_machine_arn, max(1, min(limit, 1000)))
        return [Run(self, str(item["executionArn"])) for item in listed]

    def predictor(self, endpoint_name: str) -> Predictor:
        return Predictor(endpoint_name, self.session)

    def __repr__(self) -> str:
        where = self.session.endpoint_url or f"AWS {self.session.region or ''}".rstrip()
        return f"Pipeline({self.session.state_machine_arn!r} on {where})"


class Run:
    """One execution of the pipeline. Every property and method reads it afresh."""

    def __init__(self, pipeline: Pipeline, execution_arn: str) -> None:
        self.pipeline = pipeline
        self.execution_arn = execution_arn

    @property
    def name(self) -> str:
        return self.execution_arn.rsplit(":", 1)[-1]

    @property
    def status(self) -> str:
        """RUNNING, SUCCEEDED, FAILED, TIMED_OUT, ABORTED or PENDING_REDRIVE (DescribeExecution)."""
        return str(runs_mod.describe(self.pipeline.session, self.execution_arn)["status"])

    def progress(self) -> progress_mod.Progress:
        """Where the run is now: each state's status, shards done, the training step (as `sdflow status`)."""
        session = self.pipeline.session
        return progress_mod.snapshot(
            session.client("stepfunctions"), session.client("s3"), session.data_bucket(), self.execution_arn,
            session.workdir,
        )  # fmt: skip

    def summary(self) -> RunSummary:
        return self._summarize(None)

    def _summarize(self, final: progress_mod.Progress | None) -> RunSummary:
        session = self.pipeline.session
        return summarize(
            session.client("stepfunctions"), session.client("s3"), session.data_bucket(), self.execution_arn,
            session.workdir, final,
        )  # fmt: skip

    def wait(
        self,
        *,
        progress: bool = True,
        timeout_s: float | None = None,
        poll_s: float = 2.0,
        raise_on_failure: bool = True,
    ) -> RunSummary:
        """Until the run ends; its summary. RunFailed if it ends otherwise than SUCCEEDED (unless
        raise_on_failure=False), WaitTimeout after `timeout_s`. progress: a tqdm bar of the shards."""
        bar = None
        if progress:
            from sdflow.sdk.bar import RunBar

            bar = RunBar(self.name)
        snaps = runs_mod.follow(self.pipeline.session, self.execution_arn, interval_s=poll_s, timeout_s=timeout_s)
        final = None
        try:
            for final in snaps:
                if bar is not None:
                    bar.update(final)
        finally:
            if bar is not None:
                bar.close()
        summary = self._summarize(final)  # follow's last snapshot is the ended run's
        if raise_on_failure and not summary.succeeded:
            raise RunFailed(summary)
        return summary

    def predictor(self) -> Predictor:
        """The endpoint this run deployed; NoEndpoint if it deployed none."""
        described = runs_mod.describe(self.pipeline.session, self.execution_arn)
        if described["status"] != "SUCCEEDED":
            why = f" ({described['error']})" if described.get("error") else ""
            raise NoEndpoint(
                f"run {self.name} is {described['status']}{why} and has deployed no endpoint: "
                + (
                    "wait for it (run.wait())"
                    if described["status"] in runs_mod.UNFINISHED
                    else "run.resume() starts a run that reuses what it finished"
                )
            )
        output = history.decode(described.get("output"))
        endpoint = output.get("endpoint") if isinstance(output, dict) else None
        name = endpoint.get("endpoint_name") if isinstance(endpoint, dict) else None
        if not name:
            raise NoEndpoint(f"run {self.name} SUCCEEDED without deploying an endpoint (its output names none)")
        return Predictor(str(name), self.pipeline.session)

    def resume(self, document: DocumentLike | None = None, *, name: str | None = None) -> Run:
        """A new run reusing what this one finished (`sdflow resume`): this run's input, or `document`,
        with resume_from set; named `<name>-resume-<UTC time>` unless `name` is given."""
        new = runs_mod.start_resume(
            self.pipeline.session,
            self.execution_arn,
            manifest=_document(document) if document is not None else None,
            name=name,
        )
        return Run(self.pipeline, new)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Run) and other.execution_arn == self.execution_arn

    def __hash__(self) -> int:
        return hash(self.execution_arn)

    def __repr__(self) -> str:
        return f"Run({self.name!r})"
