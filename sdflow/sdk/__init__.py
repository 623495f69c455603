"""sdflow from Python (a notebook, a script): the same run document and AWS calls as the CLI.

    from sdflow import sdk
    pipeline = sdk.Pipeline.connect()           # the running `sdflow local up`, or the stack on AWS
    run = pipeline.start("run.json")            # or a dict; via="api" for StartExecution
    summary = run.wait()                        # a progress bar; RunFailed if the run fails
    png = run.predictor().predict("a red circle on a blue background")

Works against AWS and the local cloud alike (boto3 only). Every problem the caller can fix is an
`SdflowError` subclass whose message says what to do."""

from sdflow.errors import (
    EndpointError,
    ManifestRejected,
    NoEndpoint,
    NotConnected,
    RunFailed,
    RunNotFound,
    SdflowError,
    WaitTimeout,
)
from sdflow.sdk.pipeline import Pipeline, Run
from sdflow.sdk.predictor import Predictor
from sdflow.sdk.summary import RunSummary
from sdflow.session import Session

__all__ = [
    "EndpointError",
    "ManifestRejected",
    "NoEndpoint",
    "NotConnected",
    "Pipeline",
    "Predictor",
    "Run",
    "RunFailed",
    "RunNotFound",
    "RunSummary",
    "SdflowError",
    "Session",
    "WaitTimeout",
]
