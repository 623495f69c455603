"""Orchestration cost of the local runtime: N no-op shards through the real, strict pipeline.

Everything is real (template, state machine with its Distributed Map and ResultWriter, every
handler in its worker process under its own IAM role, EventBridge delivery, job_events
resolving each task token, SageMaker quotas and rate limits, logs and metrics) except the
SageMaker work: each job "finishes" at once, so what is timed is the orchestration alone.
Each size runs in its own process (one local cloud per process). Transitions and API calls are
counted by the local cloud itself (Runtime.sfn_transitions, Runtime.api_calls), after the run;
peak RSS is the whole runtime's (this process, its Lambda workers and anything else it started).

    .venv/bin/python bench/bench_local_runtime.py --shards 10000
    .venv/bin/python bench/bench_local_runtime.py --shards 1000 10000   # side by side, with the growth ratio

The last line for each size reads
`shards=N status=SUCCEEDED wall_s=… per_shard_ms=… peak_rss_mb=… peak_cloud_rss_mb=…
transitions_per_shard=… job_describes_per_shard=… api_calls_per_shard=…` (peak_rss_mb: the whole
runtime with its Lambda workers; peak_cloud_rss_mb: the cloud process alone;
job_describes_per_shard is the name kept since it replaced describe_calls_per_shard).
`--profile-memory` adds where the cloud process's memory was allocated (tracemalloc). `--set FIELD=JSON`
changes one field of the run document (e.g. `--set training.resolution=4096`). A run that does not succeed
prints its error and cause (`status=FAILED error=… cause=…`), and the exit status is 1.
job_describes counts SageMaker Describe* calls (polling a job's status; the reconciler makes none
before a claim's deadline); api_calls counts every call the pipeline made (the starters'
DescribeExecution after each Create included).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from sdflow.local.sagemaker.noop import NoOpSageMaker


def _one_row_parquet(folder: Path) -> bytes:
    """A real LAION-style file: Validate run reads every listed parquet's footer."""
    from sdflow.samples import SampleRow, write_parquet

    return write_parquet(
        folder / "one-row.parquet", [SampleRow("http://127.0.0.1:9/0.png", "noop", 64, 64)]
    ).read_bytes()


# The files of a diffusers StableDiffusionPipeline folder as save_pretrained writes them (diffusers 0.29), each
# component's config and weights. No job reads the weights (the jobs are no-ops), but Validate run reads the
# model_index.json (its `_class_name` decides the family) and checks every component it lists is there.
NOOP_MODEL_INDEX = {
    "_class_name": "StableDiffusionPipeline",
    "_diffusers_version": "0.29.2",
    "feature_extractor": [None, None],
    "image_encoder": [None, None],
    "requires_safety_checker": False,
    "safety_checker": [None, None],
    "scheduler": ["diffusers", "DDPMScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}
NOOP_CONFIGS = {
    "scheduler/scheduler_config.json": {"_class_name": "DDPMScheduler", "num_train_timesteps": 1000},
    "text_encoder/config.json": {"architectures": ["CLIPTextModel"], "hidden_size": 32, "num_hidden_layers": 1},
    "tokenizer/tokenizer_config.json": {"tokenizer_class": "CLIPTokenizer", "model_max_length": 77},
    "tokenizer/vocab.json": {"<|startoftext|>": 0, "<|endoftext|>": 1},
    "tokenizer/special_tokens_map.json": {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>"},
    "unet/config.json": {"_class_name": "UNet2DConditionModel", "sample_size": 8, "cross_attention_dim": 32},
    "vae/config.json": {"_class_name": "AutoencoderKL", "sample_size": 64, "latent_channels": 4},
}
NOOP_WEIGHTS = ("text_encoder/model.safetensors", "unet/diffusion_pytorch_model.safetensors",
                "vae/diffusion_pytorch_model.safetensors")  # fmt: skip


def _empty_safetensors() -> bytes:
    """A valid safetensors file holding no tensor: its 8-byte header length, then the header."""
    header = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    return len(header).to_bytes(8, "little") + header


def upload_noop_base_model(s3: Any, bucket: str, prefix: str) -> str:
    """The stub base model under s3://bucket/prefix/; its URI."""
    objects: dict[str, bytes] = {"model_index.json": json.dumps(NOOP_MODEL_INDEX).encode()}
    objects |= {key: json.dumps(config).encode() for key, config in NOOP_CONFIGS.items()}
    objects |= {key: _empty_safetensors() for key in NOOP_WEIGHTS}
    objects["tokenizer/merges.txt"] = b"#version: 0.2\n"
    for key, body in objects.items():
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=body)
    return f"s3://{bucket}/{prefix}/"


def upload_noop_inputs(cloud: Any, workdir: Path, shards: int, concurrency: int) -> dict[str, Any]:
    """`shards` one-row parquet files and a stub base model in the stack's bucket; the run document."""
    s3, bucket = cloud.client("s3"), cloud.outputs["DataBucketName"]
    parquet = _one_row_parquet(workdir)
    for i in range(shards):
        s3.put_object(Bucket=bucket, Key=f"datasets/noop/part-{i:05d}.parquet", Body=parquet)
    base_model_uri = upload_noop_base_model(s3, bucket, "models/noop")
    return {
        "dataset": {"prefix": f"s3://{bucket}/datasets/noop/"},
        "base_model_uri": base_model_uri,
        "download": {"max_concurrency": concurrency},
        "training": {"instance_type": "ml.m5.xlarge"},
        "endpoint": {"name": "sdflow-noop", "instance_type": "ml.m5.large"},
    }


def _tree_rss(process: psutil.Process) -> tuple[int, list[psutil.Process]]:
    """The summed RSS of the process and its descendants, and the descendants."""
    total = 0
    children = process.children(recursive=True)
    for proc in [process, *children]:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += proc.memory_info().rss
    return total, children


def _workers_by_function(children: list[psutil.Process]) -> dict[str, int]:
    """How many of the processes are Lambda workers of each function (their environment says)."""
    found: collections.Counter[str] = collections.Counter()
    for proc in children:
        with contextlib.suppress(psutil.Error):
            found[proc.environ().get("AWS_LAMBDA_FUNCTION_NAME", "(not a Lambda worker)")] += 1
    return dict(found)


def _top_allocations(snapshot: Any, label: str, limit: int = 15) -> list[str]:
    """Where the cloud process's live Python memory was allocated in a tracemalloc snapshot,
    biggest first, then the callers behind the biggest line."""
    stats = snapshot.statistics("lineno")
    total = sum(stat.size for stat in stats)
    lines = [f"{label}: {total / 2**20:.0f} MB traced"]
    lines += [f"{stat.size / 2**20:8.1f} MB {stat.count:>9} blocks  {stat.traceback[0]}" for stat in stats[:limit]]
    biggest = stats[0].traceback[0]
    for stat in [s for s in snapshot.statistics("traceback") if s.traceback[-1] == biggest][:4]:
        lines.append(f"-- {stat.size / 2**20:.1f} MB from:")
        lines += [f"     {frame}" for frame in stat.traceback.format()[-12:]]
    return lines


class _LargestHeap:
    """Keeps the tracemalloc snapshot of the largest traced heap seen while the run goes on: the
    peak is transient (it falls by the end of the run), so a snapshot at the end misses it.
    A snapshot is taken when the traced heap has grown 10% past the largest one kept."""

    def __init__(self) -> None:
        self.snapshot: Any = None
        self.size = 0
        self.at_s = 0.0

    def sample(self, started: float) -> None:
        import tracemalloc

        current, _ = tracemalloc.get_traced_memory()
        if current > self.size * 1.1:
            self.snapshot, self.size, self.at_s = tracemalloc.take_snapshot(), current, time.monotonic() - started


def with_field(document: dict[str, Any], assignment: str) -> dict[str, Any]:
    """`document` with the field `a.b.c=JSON` set (a value that is not JSON is taken as a string)."""
    path, sep, text = assignment.partition("=")
    if not sep or not path:
        raise ValueError(f"--set {assignment!r}: write FIELD=VALUE, e.g. training.resolution=512")
    try:
        value = json.loads(text)
    except ValueError:
        value = text
    *parents, name = path.split(".")
    changed = json.loads(json.dumps(document))
    block = changed
    for part in parents:
        block = block.setdefault(part, {})
    block[name] = value
    return changed


def run_one(
    shards: int, concurrency: int, profile_memory: bool = False, assignments: list[str] | None = None
) -> dict[str, Any]:
    from sdflow.local.cloud import LocalCloud

    if profile_memory:
        import tracemalloc

        tracemalloc.start(4)
    peak = peak_own = peak_children = peak_threads = 0
    peak_workers: dict[str, int] = {}
    stop = threading.Event()
    me = psutil.Process()

    def sample() -> None:
        nonlocal peak, peak_own, peak_children, peak_threads, peak_workers
        while not stop.is_set():
            rss, children = _tree_rss(me)
            if rss > peak:
                peak, peak_children, peak_workers = rss, len(children), _workers_by_function(children)
            with contextlib.suppress(psutil.NoSuchProcess):
                peak_own = max(peak_own, me.memory_info().rss)
                peak_threads = max(peak_threads, me.num_threads())
            stop.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    largest = _LargestHeap()
    profiler_started = time.monotonic()

    def profile() -> None:
        while not stop.wait(15.0):
            largest.sample(profiler_started)

    if profile_memory:
        threading.Thread(target=profile, daemon=True).start()
    with tempfile.TemporaryDirectory() as workdir:
        started = time.monotonic()
        with LocalCloud(
            Path(workdir),
            port=0,
            sagemaker_factory=lambda w, url, lis: NoOpSageMaker(url, lis, direct_s3=True),
            # The account's processing quota equals the run's concurrency: Validate run caps
            # max_concurrency at it, and no shard waits on ResourceLimitExceeded.
            quotas={"processing job": concurrency},
        ) as cloud:
            up_s = time.monotonic() - started
            sfn = cloud.client("stepfunctions")
            document = upload_noop_inputs(cloud, Path(workdir), shards, concurrency)
            for assignment in assignments or []:
                document = with_field(document, assignment)
            runtime = cloud.runtime
            assert runtime is not None
            with runtime.api_calls_lock:
                before = collections.Counter(runtime.api_calls)  # the bench's own set-up is not counted
            run_started = time.monotonic()
            arn = sfn.start_execution(
                stateMachineArn=cloud.outputs["PipelineStateMachineArn"], name="noop", input=json.dumps(document)
            )["executionArn"]
            polls = 1  # the bench's own DescribeExecution calls, not the pipeline's
            while (described := sfn.describe_execution(executionArn=arn))["status"] == "RUNNING":
                polls += 1
                time.sleep(0.2)
            status = described["status"]
            error, cause = described.get("error"), described.get("cause")
            run_s = time.monotonic() - run_started
            transitions = runtime.sfn_transitions
            with runtime.api_calls_lock:
                calls = dict(collections.Counter(runtime.api_calls) - before)
            allocations: list[str] = []
            if profile_memory:
                import tracemalloc

                current, traced_peak = tracemalloc.get_traced_memory()
                allocations = [
                    f"traced Python memory: {current / 2**20:.0f} MB live at the end, "
                    + f"{traced_peak / 2**20:.0f} MB at its peak"
                ]
                if largest.snapshot is not None:
                    allocations += _top_allocations(
                        largest.snapshot, f"the largest heap sampled ({largest.at_s:.0f} s in)"
                    )
                allocations += _top_allocations(tracemalloc.take_snapshot(), "at the end of the run")
    stop.set()
    sampler.join()
    polls_excluded = collections.Counter(calls)
    polls_excluded[("states", "DescribeExecution")] -= polls  # the bench's own polling
    describes = sum(
        n
        for (service, operation), n in polls_excluded.items()
        if "sagemaker" in service and operation.startswith("Describe")
    )
    return {
        "shards": shards,
        "status": status,
        "error": error,  # why a run that did not succeed ended (the execution's error and cause)
        "cause": cause,
        "up_s": up_s,
        "run_s": run_s,
        "peak_mb": peak / 2**20,
        "peak_cloud_mb": peak_own / 2**20,  # the local cloud's own process, without its workers
        "processes_at_peak": peak_children,  # the Lambda workers (and any other child) at the peak
        "workers_at_peak": peak_workers,  # function name (stack-prefixed) -> its workers at the peak
        "peak_threads": peak_threads,  # the cloud process's threads (each has a stack of its own)
        "allocations": allocations,
        "transitions": transitions,
        "describe_calls": describes,
        "api_calls": sum(calls.values()) - polls,
    }


def summary_line(r: dict[str, Any]) -> str:
    n = r["shards"]
    if r["status"] != "SUCCEEDED":
        return f"shards={n} status={r['status']} error={r.get('error')} cause={r.get('cause')}"
    return (
        f"shards={n} status={r['status']} wall_s={r['run_s']:.1f} per_shard_ms={1000 * r['run_s'] / n:.1f} "
        f"peak_rss_mb={r['peak_mb']:.0f} peak_cloud_rss_mb={r.get('peak_cloud_mb', 0):.0f} "
        f"transitions_per_shard={r['transitions'] / n:.2f} "
        f"job_describes_per_shard={r['describe_calls'] / n:.2f} api_calls_per_shard={r['api_calls'] / n:.1f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shards", type=int, nargs="+", default=[100, 1000], help="shard counts, each run in its own process"
    )
    parser.add_argument(
        "--concurrency", type=int, default=100, help="download.max_concurrency (and the local processing quota)"
    )
    parser.add_argument(
        "--profile-memory",
        action="store_true",
        help="trace the cloud process's allocations (tracemalloc: slower) and print where its memory is "
        "at its largest and at the end",
    )
    parser.add_argument(
        "--set",
        dest="assignments",
        action="append",
        default=[],
        metavar="FIELD=JSON",
        help="change one field of the run document (repeatable), e.g. --set training.resolution=512",
    )
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(run_one(args.one, args.concurrency, args.profile_memory, args.assignments)))
        return 0
    results = [run_size(size, args) for size in args.shards]
    failed = [r for r in results if r["status"] != "SUCCEEDED"]
    if failed:
        for r in failed:
            print(summary_line(r))
        return 1
    print(
        f"{'shards':>8} {'stack up s':>11} {'run s':>8} {'ms/shard':>9} {'peak MB':>8} {'cloud MB':>9} "
        f"{'workers at peak':>16} {'threads':>8} {'API calls/shard':>16}"
    )
    for r in results:
        print(
            f"{r['shards']:>8} {r['up_s']:>11.1f} {r['run_s']:>8.1f} {1000 * r['run_s'] / r['shards']:>9.1f} "
            f"{r['peak_mb']:>8.0f} {r['peak_cloud_mb']:>9.0f} {r['processes_at_peak']:>16} {r['peak_threads']:>8} "
            f"{r['api_calls'] / r['shards']:>16.1f}"
        )
    if len(results) >= 2:
        first, last = results[0], results[-1]
        print(
            f"growth {first['shards']} -> {last['shards']} shards: time x{last['run_s'] / first['run_s']:.1f} "
            f"(shards x{last['shards'] / first['shards']:.0f}), peak memory x{last['peak_mb'] / first['peak_mb']:.2f}"
        )
    for r in results:
        named = r["workers_at_peak"].items()
        workers = ", ".join(f"{name.split('-')[-2] if '-' in name else name} {n}" for name, n in named)
        print(f"workers at the peak of {r['shards']} shards: {workers}")
    for r in results:
        if r.get("allocations"):
            print(f"where the cloud process's Python memory is after {r['shards']} shards (tracemalloc):")
            print("\n".join(r["allocations"]))
    for r in results:
        print(summary_line(r))
    return 0


class SizeFailed(RuntimeError):
    """The process that ran one size ended without its result line."""


def run_size(size: int, args: argparse.Namespace) -> dict[str, Any]:
    """One size in a process of its own (one local cloud per process): its result (a run that failed carries
    its error and cause). A process that dies without a result raises with the end of its stderr."""
    command = [sys.executable, __file__, "--one", str(size), "--concurrency", str(args.concurrency)]
    command += ["--profile-memory"] if args.profile_memory else []
    command += [f"--set={assignment}" for assignment in args.assignments]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise SizeFailed(f"{size} shards: the run's process exited {done.returncode}:\n{done.stderr[-4000:]}")
    return dict(json.loads(lines[-1]))


if __name__ == "__main__":
    sys.exit(main())
