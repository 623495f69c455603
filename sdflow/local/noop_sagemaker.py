"""A SageMaker stand-in whose jobs do no work: for benchmarks and tests of the orchestration.

Everything around it stays real (the patched SageMaker API with its quotas and rate limits, the
status events, job_events resolving each token); only the job's content is skipped. A download
job writes the `_SUCCESS` marker build_index reads, a training job reports artifacts and a
loss, an endpoint goes InService. `job_seconds` holds each job that long, so concurrency and
quotas are exercised; `peak_running` records the most processing jobs ever running at once."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3

from sdflow_common.run_document import parse_s3_uri


class NoOpSageMaker:
    """Finishes every job (after `job_seconds`), reporting through the same listener as LocalSageMaker."""

    def __init__(
        self,
        endpoint_url: str,
        listener: Any,
        *,
        job_seconds: float = 0.0,
        max_threads: int = 8,
        direct_s3: bool = False,
        account_id: str = "123456789012",
    ) -> None:
        self.listener = listener
        self.direct_s3 = direct_s3
        self.account_id = account_id
        self.job_seconds = job_seconds
        self.s3 = boto3.client(
            "s3", endpoint_url=endpoint_url, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )  # fmt: skip
        self.pool = ThreadPoolExecutor(max_workers=max_threads)
        self._lock = threading.Lock()
        self.running = 0
        self.peak_running = 0
        self.processing_jobs: list[str] = []

    def _processing(self, request: dict[str, Any]) -> None:
        with self._lock:
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
            self.processing_jobs.append(request["ProcessingJobName"])
        try:
            time.sleep(self.job_seconds)
            output = request["ProcessingOutputConfig"]["Outputs"][0]["S3Output"]["S3Uri"]
            bucket, key = parse_s3_uri(output)
            marker = {"samples": 1, "failed": 0, "tar_files": ["00000.tar"]}
            self._put(bucket, key.rstrip("/") + "/_SUCCESS", json.dumps(marker).encode())
        finally:
            with self._lock:
                self.running -= 1
        self.listener.job_status_changed("processing", request["ProcessingJobName"], "Completed", {})

    def _put(self, bucket: str, key: str, body: bytes) -> None:
        """The job's output, written straight into the local S3 backend: a real job writes from its
        own process, so its HTTP cost is not the orchestration's and would only blur the measure."""
        if self.direct_s3:
            from moto.s3.models import s3_backends

            s3_backends[self.account_id]["aws"].put_object(bucket, key, body)
        else:
            self.s3.put_object(Bucket=bucket, Key=key, Body=body)

    def _training(self, request: dict[str, Any]) -> None:
        time.sleep(self.job_seconds)
        name = request["TrainingJobName"]
        artifacts = f"{request['OutputDataConfig']['S3OutputPath'].rstrip('/')}/{name}/output/model.tar.gz"
        fields = {
            "ModelArtifacts": {"S3ModelArtifacts": artifacts},
            "FinalMetricDataList": [{"MetricName": "train:loss", "Value": 0.1}],
        }
        self.listener.job_status_changed("training", name, "Completed", fields)

    def run_processing_job(self, request: dict[str, Any]) -> None:
        self.pool.submit(self._processing, request)

    def run_training_job(self, request: dict[str, Any]) -> None:
        self.pool.submit(self._training, request)

    def deploy_endpoint(self, endpoint_name: str, endpoint_config: dict[str, Any], model: dict[str, Any]) -> None:
        config = endpoint_config["EndpointConfigName"]
        self.pool.submit(
            self.listener.job_status_changed, "endpoint", endpoint_name, "InService", {"EndpointConfigName": config}
        )

    def invoke_endpoint(self, endpoint_name: str, body: bytes, content_type: str, accept: str) -> tuple[bytes, str]:
        return b"{}", "application/json"

    def stop_job(self, kind: str, name: str) -> None:
        """Nothing to stop: a no-op job ends by itself."""

    def job_wall_times(self) -> dict[str, float]:
        return {}

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)
