"""Time to the first batch and local disk used, against the number of shards: the training loader
streaming from S3 (`sdflow_image.training.data`, as a training job runs it) beside SageMaker File mode's way
(every shard copied to the instance's volume, then read from there), side by side, with each
figure's ratio to the smallest dataset. Streaming must stay flat; File mode grows with the data.

The S3 is moto's server on 127.0.0.1 (tests/image/data_fixtures.local_s3), the shards tiny
(`--samples` images of 32 px each). Each measurement runs in a fresh process (as a training job
starts), with its own empty scratch folder as TMPDIR and working directory:
- first batch: from process start of the measured code (imports done) to the first batch in hand,
  index read included; `--workers` DataLoader workers, one rank.
- disk: bytes under the scratch folder afterwards, and the bytes the process and its DataLoader
  workers wrote to any file system (getrusage ru_oublock; 0 where the writes went to a tmpfs).
The best of `--rounds` rounds is kept: on a shared machine other load only slows a round down.

usage: python bench/bench_data_scale.py [--shards 10 100 1000] [--samples 4] [--workers 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "training_image"), str(REPO / "tests" / "image")]

BUCKET = "bench"


def _written() -> int:
    """Bytes this process and its reaped children (the DataLoader workers) wrote to file systems:
    getrusage's output block operations, counted by Linux when a page is dirtied, in 512-byte units."""
    import resource

    blocks = sum(resource.getrusage(who).ru_oublock for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return blocks * 512


def child(mode: str, root: str, index: str, workers: int) -> None:
    """One measurement, in its own process: prints {"first_batch_s", "written"} as JSON."""
    from data_fixtures import KeyTokenizer

    from sdflow_image.training.data import make_dataloader
    from sdflow_image.training.data_source import load_index, source_for

    start_written = _written()
    started = time.perf_counter()
    if mode == "filemode":
        # SageMaker File mode: every object of the channel lands on the volume before the container runs.
        local = Path.cwd() / "channel"
        source = source_for(root)
        for name in [index, *load_index(root, index).shards]:
            (local / name).parent.mkdir(parents=True, exist_ok=True)
            (local / name).write_bytes(source.read_bytes(name))
        root = str(local)
    args = SimpleNamespace(
        dataset_dir=root, dataset_index=index, resolution=32, train_batch_size=4, dataloader_num_workers=workers,
        interleave_shards=8, seed=0, center_crop=True, random_flip=False,
    )  # fmt: skip
    iterator = iter(make_dataloader(args, KeyTokenizer(), rank=0, world_size=1))
    next(iterator)
    elapsed = time.perf_counter() - started
    iterator.close()  # type: ignore[attr-defined]  # joins the workers, so their writes are counted
    print(json.dumps({"first_batch_s": elapsed, "written": _written() - start_written}))


def _du(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def measure(mode: str, root: str, index: str, workers: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"bench-{mode}-") as scratch:
        env = os.environ | {"TMPDIR": scratch}
        command = [
            sys.executable,
            __file__,
            "--child",
            mode,
            "--root",
            root,
            "--index",
            index,
            "--workers",
            str(workers),
        ]
        done = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{mode} child failed:\n{done.stderr[-3000:]}")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        result["disk"] = _du(Path(scratch))
        return result


def _mb(n: float) -> str:
    return f"{n / 1e6:8.3f} MB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--samples", type=int, default=4, help="samples per shard")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=["stream", "filemode"])
    parser.add_argument("--root")
    parser.add_argument("--index")
    options = parser.parse_args()
    if options.child:
        child(options.child, options.root, options.index, options.workers)
        return 0

    from data_fixtures import local_s3, upload_tree, write_key_shards

    results: dict[tuple[str, int], dict[str, Any]] = {}
    with local_s3() as client, tempfile.TemporaryDirectory(prefix="bench-data-") as workdir:
        client.create_bucket(Bucket=BUCKET)
        indexes = {}
        for count in options.shards:
            folder = Path(workdir) / f"n{count}"
            indexes[count] = write_key_shards(folder, count, options.samples, run=f"n{count}", size=32)
            upload_tree(client, folder, BUCKET)
            size = _du(folder)
            print(f"{count:5d} shards uploaded ({_mb(size).strip()})", flush=True)
        root = f"s3://{BUCKET}/runs/"
        for _ in range(options.rounds):
            for count in options.shards:
                for mode in ("stream", "filemode"):
                    got = measure(mode, root, indexes[count], options.workers)
                    best = results.get((mode, count))
                    if best is None or got["first_batch_s"] < best["first_batch_s"]:
                        # disk figures do not vary between rounds; keep those of the fastest round
                        results[(mode, count)] = got

    base = options.shards[0]
    print()
    print(f"best of {options.rounds} rounds; {options.samples} samples of 32 px per shard, {options.workers} workers")
    header = (
        f"{'shards':>6} | {'stream 1st batch':>16} {'x':>6} | {'stream disk':>11} {'written':>11} | "
        f"{'File mode 1st batch':>19} {'x':>6} | {'File mode disk':>14} {'x':>7}"
    )
    print(header)
    print("-" * len(header))
    for count in options.shards:
        stream, filemode = results[("stream", count)], results[("filemode", count)]
        s0, f0 = results[("stream", base)], results[("filemode", base)]
        print(
            f"{count:6d} | {stream['first_batch_s']:14.3f} s {stream['first_batch_s'] / s0['first_batch_s']:5.2f}x | "
            f"{_mb(stream['disk']):>11} {_mb(stream['written']):>11} | "
            f"{filemode['first_batch_s']:17.3f} s {filemode['first_batch_s'] / f0['first_batch_s']:5.2f}x | "
            f"{_mb(filemode['disk']):>14} {filemode['disk'] / max(1, f0['disk']):6.1f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
