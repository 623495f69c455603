"""A SageMaker client with the List / Stop / endpoint behaviours moto 5.2.5 lacks.

moto has no StopTrainingJob and no UpdateEndpoint, keeps no endpoint statuses, and filters
ListProcessingJobs after paging. The cleanup needs each as AWS documents it (the List calls are
kept so that a test can assert the cleanup makes none):
- ListProcessingJobs / ListTrainingJobs: NameContains (substring), StatusEquals, MaxResults
  1..100, NextToken (API reference);
- Stop*Job on a job not InProgress: ValidationException "The request was rejected because the
  training job is in status Stopped." (the answer AWS gives, quoted in awslabs/benchmark-ai#928);
  on an unknown job: ValidationException "Could not find ...";
- UpdateEndpoint on an endpoint that is not InService/Failed: ValidationException "Cannot update
  in-progress endpoint" (as sdflow/local/sagemaker/service.py answers).
`fail_next` makes the next call of an operation on a name raise (throttling and such)."""

from __future__ import annotations

from typing import Any

from botocore.exceptions import ClientError

ARN = "arn:aws:sagemaker:us-east-1:123456789012"


def client_error(code: str, message: str, operation: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message}}, operation)


class FakeSageMakerClient:
    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, str]] = {"processing": {}, "training": {}}
        self.endpoints: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self._failures: dict[tuple[str, str], ClientError] = {}
        # A job listed as InProgress that ends before the stop reaches it.
        self.ends_before_stop: set[str] = set()
        # Training jobs started with a warm pool: name -> [KeepAlivePeriodInSeconds, WarmPoolStatus.Status or None].
        self.warm_pools: dict[str, list[Any]] = {}

    # -- setup ----------------------------------------------------------------------

    def add_job(self, kind: str, name: str, status: str = "InProgress") -> None:
        self.jobs[kind][name] = status

    def add_endpoint(self, name: str, status: str, config: str, pending: str | None = None) -> None:
        self.endpoints[name] = {"EndpointName": name, "EndpointStatus": status, "EndpointConfigName": config}
        if pending:
            self.endpoints[name]["PendingDeploymentSummary"] = {"EndpointConfigName": pending}

    def fail_next(self, operation: str, name: str, error: ClientError) -> None:
        self._failures[(operation, name)] = error

    def _maybe_fail(self, operation: str, name: str) -> None:
        error = self._failures.pop((operation, name), None)
        if error is not None:
            raise error

    def called(self, operation: str) -> list[dict[str, Any]]:
        return [params for op, params in self.calls if op == operation]

    # -- jobs -----------------------------------------------------------------------

    def _list(self, kind: str, summaries: str, name_field: str, status_field: str, **params: Any) -> dict[str, Any]:
        operation = "ListProcessingJobs" if kind == "processing" else "ListTrainingJobs"
        self.calls.append((operation, params))
        limit = params.get("MaxResults", 10)
        if not 1 <= limit <= 100:
            raise client_error("ValidationException", "MaxResults must be between 1 and 100", operation)
        matching = [
            (name, status)
            for name, status in sorted(self.jobs[kind].items())
            if params.get("NameContains", "") in name and params.get("StatusEquals") in (None, status)
        ]
        start = int(params.get("NextToken", "0"))
        page = matching[start : start + limit]
        response: dict[str, Any] = {summaries: [{name_field: n, status_field: s} for n, s in page]}
        if start + limit < len(matching):
            response["NextToken"] = str(start + limit)
        return response

    def list_processing_jobs(self, **params: Any) -> dict[str, Any]:
        return self._list("processing", "ProcessingJobSummaries", "ProcessingJobName", "ProcessingJobStatus", **params)

    def list_training_jobs(self, **params: Any) -> dict[str, Any]:
        return self._list("training", "TrainingJobSummaries", "TrainingJobName", "TrainingJobStatus", **params)

    def _stop(self, kind: str, operation: str, name: str) -> dict[str, Any]:
        self.calls.append((operation, {"name": name}))
        self._maybe_fail(operation, name)
        what = "processing job" if kind == "processing" else "training job"
        if name not in self.jobs[kind]:
            raise client_error(
                "ValidationException", f"Could not find {what} '{ARN}:{what.replace(' ', '-')}/{name}'.", operation
            )
        if name in self.ends_before_stop:
            self.jobs[kind][name] = "Completed"
        status = self.jobs[kind][name]
        if status != "InProgress":
            raise client_error(
                "ValidationException", f"The request was rejected because the {what} is in status {status}.", operation
            )
        self.jobs[kind][name] = "Stopping"
        return {}

    def stop_processing_job(self, ProcessingJobName: str) -> dict[str, Any]:
        return self._stop("processing", "StopProcessingJob", ProcessingJobName)

    def stop_training_job(self, TrainingJobName: str) -> dict[str, Any]:
        return self._stop("training", "StopTrainingJob", TrainingJobName)

    def describe_training_job(self, TrainingJobName: str) -> dict[str, Any]:
        """DescribeTrainingJob's members the warm pool's end reads: ResourceConfig (with
        KeepAlivePeriodInSeconds when the job asked for a warm pool) and WarmPoolStatus."""
        self.calls.append(("DescribeTrainingJob", {"TrainingJobName": TrainingJobName}))
        self._maybe_fail("DescribeTrainingJob", TrainingJobName)
        if TrainingJobName not in self.jobs["training"]:
            raise client_error("ValidationException", "Requested resource not found.", "DescribeTrainingJob")
        described: dict[str, Any] = {
            "TrainingJobName": TrainingJobName,
            "TrainingJobStatus": self.jobs["training"][TrainingJobName],
            "ResourceConfig": {"InstanceType": "ml.g5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 50},
        }
        if TrainingJobName in self.warm_pools:
            keep_alive, status = self.warm_pools[TrainingJobName]
            described["ResourceConfig"]["KeepAlivePeriodInSeconds"] = keep_alive
            if status is not None:
                described["WarmPoolStatus"] = {"Status": status}
        return described

    def update_training_job(self, TrainingJobName: str, ResourceConfig: dict[str, Any]) -> dict[str, Any]:
        """UpdateTrainingJob's warm pool retention: 0 ends an Available warm pool (Terminated)."""
        self.calls.append(("UpdateTrainingJob", {"TrainingJobName": TrainingJobName, "ResourceConfig": ResourceConfig}))
        self._maybe_fail("UpdateTrainingJob", TrainingJobName)
        if TrainingJobName not in self.jobs["training"]:
            raise client_error(
                "ResourceNotFound", f"Could not find training job '{TrainingJobName}'.", "UpdateTrainingJob"
            )
        keep_alive = ResourceConfig["KeepAlivePeriodInSeconds"]
        status = self.warm_pools.get(TrainingJobName, [0, None])[1]
        self.warm_pools[TrainingJobName] = [keep_alive, "Terminated" if keep_alive == 0 and status else status]
        return {"TrainingJobArn": f"{ARN}:training-job/{TrainingJobName}"}

    # -- endpoints ------------------------------------------------------------------

    def _endpoint(self, name: str, operation: str) -> dict[str, Any]:
        if name not in self.endpoints:
            raise client_error("ValidationException", f'Could not find endpoint "{ARN}:endpoint/{name}".', operation)
        return self.endpoints[name]

    def describe_endpoint(self, EndpointName: str) -> dict[str, Any]:
        self.calls.append(("DescribeEndpoint", {"EndpointName": EndpointName}))
        self._maybe_fail("DescribeEndpoint", EndpointName)
        return dict(self._endpoint(EndpointName, "DescribeEndpoint"))

    def delete_endpoint(self, EndpointName: str) -> dict[str, Any]:
        self.calls.append(("DeleteEndpoint", {"EndpointName": EndpointName}))
        self._maybe_fail("DeleteEndpoint", EndpointName)
        self._endpoint(EndpointName, "DeleteEndpoint")
        del self.endpoints[EndpointName]
        return {}

    def update_endpoint(self, EndpointName: str, EndpointConfigName: str) -> dict[str, Any]:
        self.calls.append(("UpdateEndpoint", {"EndpointName": EndpointName, "EndpointConfigName": EndpointConfigName}))
        self._maybe_fail("UpdateEndpoint", EndpointName)
        endpoint = self._endpoint(EndpointName, "UpdateEndpoint")
        if endpoint["EndpointStatus"] not in ("InService", "Failed"):
            raise client_error(
                "ValidationException",
                f"Cannot update in-progress endpoint '{ARN}:endpoint/{EndpointName}'.",
                "UpdateEndpoint",
            )
        endpoint["EndpointStatus"] = "Updating"
        endpoint["PendingDeploymentSummary"] = {"EndpointConfigName": EndpointConfigName}
        return {"EndpointArn": f"{ARN}:endpoint/{EndpointName}"}
