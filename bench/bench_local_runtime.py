"""Orchestration cost of the local runtime: N no-op shards through the real pipeline.

Everything is real (template, state machine with its Distributed Map, every handler in its
worker process, EventBridge delivery, job_events resolving each task token) except the
SageMaker work: each job "finishes" at once, so what is timed is the orchestration alone.
Each size runs in its own process (one local cloud per process); time and peak memory
(this process plus its Lambda workers) are printed side by side with the growth ratio.

    .venv/bin/python bench/bench_local_runtime.py            # 100 and 1,000 shards
    .venv/bin/python bench/bench_local_runtime.py --sizes 50
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import psutil

from sdflow_common.run_document import parse_s3_uri


class NoOpSageMaker:
    """Finishes every job at once, reporting through the same listener as LocalSageMaker."""

    def __init__(self, endpoint_url: str, listener: Any) -> None:
        self.listener = listener
        self.s3 = boto3.client(
            "s3", endpoint_url=endpoint_url, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )  # fmt: skip
        self.pool = ThreadPoolExecutor(max_workers=8)

    def _processing(self, request: dict[str, Any]) -> None:
        output = request["ProcessingOutputConfig"]["Outputs"][0]["S3Output"]["S3Uri"]
        bucket, key = parse_s3_uri(output)
        marker = {"samples": 1, "failed": 0, "tar_files": ["00000.tar"]}
        self.s3.put_object(Bucket=bucket, Key=key.rstrip("/") + "/_SUCCESS", Body=json.dumps(marker).encode())
        self.listener.job_status_changed("processing", request["ProcessingJobName"], "Completed", {})

    def _training(self, request: dict[str, Any]) -> None:
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
        pass

    def job_wall_times(self) -> dict[str, float]:
        return {}

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)


def _tree_rss(process: psutil.Process) -> int:
    total = 0
    for proc in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += proc.memory_info().rss
    return total


def run_one(shards: int) -> dict[str, float]:
    from sdflow.local.cloud import LocalCloud

    peak = 0
    stop = threading.Event()
    me = psutil.Process()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, _tree_rss(me))
            stop.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with tempfile.TemporaryDirectory() as workdir:
        started = time.monotonic()
        with LocalCloud(Path(workdir), port=0, sagemaker_factory=lambda w, url, lis: NoOpSageMaker(url, lis)) as cloud:
            up_s = time.monotonic() - started
            s3, sfn = cloud.client("s3"), cloud.client("stepfunctions")
            bucket = cloud.outputs["DataBucketName"]
            for i in range(shards):
                s3.put_object(Bucket=bucket, Key=f"datasets/noop/part-{i:05d}.parquet", Body=b"PAR1")
            s3.put_object(Bucket=bucket, Key="models/noop/model_index.json", Body=b"{}")
            document = {
                "dataset": {"prefix": f"s3://{bucket}/datasets/noop/"},
                "base_model_uri": f"s3://{bucket}/models/noop/",
                "download": {"max_concurrency": 100},
                "training": {"instance_type": "ml.m5.xlarge"},
                "endpoint": {"name": "noop", "instance_type": "ml.m5.large"},
            }
            run_started = time.monotonic()
            arn = sfn.start_execution(
                stateMachineArn=cloud.outputs["PipelineStateMachineArn"], name="noop", input=json.dumps(document)
            )["executionArn"]
            while (status := sfn.describe_execution(executionArn=arn)["status"]) == "RUNNING":
                time.sleep(0.2)
            run_s = time.monotonic() - run_started
            if status != "SUCCEEDED":
                raise SystemExit(f"{shards} shards: execution ended {status}")
    stop.set()
    sampler.join()
    return {"shards": shards, "up_s": up_s, "run_s": run_s, "peak_mb": peak / 2**20}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000], help="shard counts to compare")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(run_one(args.one)))
        return 0
    results = []
    for size in args.sizes:
        out = subprocess.run(
            [sys.executable, __file__, "--one", str(size)], capture_output=True, text=True, check=True
        ).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'shards':>8} {'stack up s':>11} {'run s':>8} {'ms/shard':>9} {'peak MB':>8}")
    for r in results:
        print(
            f"{r['shards']:>8} {r['up_s']:>11.1f} {r['run_s']:>8.1f} "
            f"{1000 * r['run_s'] / r['shards']:>9.1f} {r['peak_mb']:>8.0f}"
        )
    if len(results) >= 2:
        first, last = results[0], results[-1]
        print(
            f"growth {first['shards']} -> {last['shards']} shards: time x{last['run_s'] / first['run_s']:.1f}, "
            f"peak memory x{last['peak_mb'] / first['peak_mb']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
