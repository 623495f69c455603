"""Does the SageMaker SDK's core package (sagemaker-core: typed request shapes, resource classes)
fit the Lambda layer? Measured side by side in one run, against the layer as it is now:

1. size: each installed as a layer's content is, `pip install --target` (the layer: its
   requirements.txt under requirements/constraints.txt, plus the sdflow_common folder;
   sagemaker-core: its whole dependency closure, pinned by the notebook venv `.venv-sdk` when
   that venv has the SDK, else PyPI's newest), against Lambda's quota of 250 MB unzipped for the
   function and all its layers together (Lambda quotas; the API refuses "Unzipped size must be
   smaller than 262144000 bytes", so 250 MiB). Also shown: sagemaker-core less the boto3 stack
   the Lambda Python runtime already has.
2. cold import: a fresh interpreter per measurement (the Lambda init phase imports the handler
   module in one), the layer's directory first on sys.path as /opt/python is on Lambda; the
   import's own seconds and the process's peak RSS, median of --repeat rounds. The cases run
   interleaved, round by round, after one untimed round (page cache, __pycache__), so a busy
   neighbour does not favour one side.

    .venv/bin/python bench/bench_sdk_core_layer.py --repeat 7
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SDK_VENV = REPO / ".venv-sdk"
LAYER = REPO / "layers" / "common"
CONSTRAINTS = REPO / "requirements" / "constraints.txt"
# "Unzipped size must be smaller than 262144000 bytes": the function plus all its layers.
LAMBDA_UNZIPPED_LIMIT = 262_144_000
MIB = 1024 * 1024
# The Lambda runtime's own packages stand in for these: this interpreter's site-packages (boto3).
RUNTIME_SITE = sysconfig.get_paths()["purelib"]
# What the Lambda Python runtime ships itself (the AWS SDK for Python and its dependencies).
RUNTIME_PROVIDED = {"boto3", "botocore", "s3transfer", "jmespath", "python-dateutil", "six", "urllib3"}

CHILD = """
import json, resource, sys, time
sys.path[:0] = {paths!r}
started = time.perf_counter()
{statement}
seconds = time.perf_counter() - started
print(json.dumps({{"seconds": seconds, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


@dataclass(frozen=True)
class Case:
    label: str
    statement: str
    paths: tuple[str, ...]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", default="2.27.0", help="sagemaker-core version to measure")
    parser.add_argument("--repeat", type=int, default=7, help="fresh interpreters per case (median)")
    parser.add_argument("--work", type=Path, help="where the two targets go (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the targets afterwards")
    return parser.parse_args(argv)


def sdk_venv_pins(version: str) -> tuple[list[str], str]:
    """`pip freeze` of .venv-sdk as constraints when its SDK imports; else none (PyPI's newest)."""
    python = SDK_VENV / "bin" / "python"
    if not python.exists():
        return [], "PyPI (no .venv-sdk)"
    check = subprocess.run([str(python), "-c", "import sagemaker.core"], capture_output=True, check=False)
    if check.returncode != 0:
        return [], "PyPI (.venv-sdk has no importable sagemaker.core)"
    frozen = subprocess.run(
        [str(python), "-m", "pip", "freeze", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    pins, theirs = [], None
    for line in frozen:
        name = line.split("==")[0].strip().lower().replace("_", "-")
        if name == "sagemaker-core":
            theirs = line.split("==")[-1]
        elif "==" in line and not line.startswith("-e"):
            pins.append(line)
    note = "" if theirs in (None, version) else f"; it has sagemaker-core {theirs}"
    return pins, f".venv-sdk's pip freeze ({len(pins)} pins{note})"


def pip_target(target: Path, *requirements: str) -> None:
    # -qq: errors only (not the find-links warnings of a local pip.conf); the target is no environment
    # of its own, so pip's check against the running venv's packages is noise.
    pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-qq", "--no-warn-conflicts"]
    subprocess.run([*pip, "--target", str(target), *requirements], check=True)


def tree_bytes(root: Path, *, pycache: bool = True) -> int:
    total = 0
    for folder, dirs, files in os.walk(root):
        if not pycache and "__pycache__" in dirs:
            dirs.remove("__pycache__")
        total += sum(os.lstat(os.path.join(folder, name)).st_size for name in files)
    return total


def distribution_bytes(target: Path) -> dict[str, int]:
    """Bytes per installed distribution, from each one's RECORD (what pip wrote for it)."""
    sizes: dict[str, int] = {}
    for record in target.glob("*.dist-info/RECORD"):
        name = record.parent.name.removesuffix(".dist-info").rsplit("-", 1)[0].lower().replace("_", "-")
        total = 0
        for line in record.read_text().splitlines():
            path = (target / line.split(",")[0]).resolve()
            if path.is_file():
                total += path.stat().st_size
        sizes[name] = total
    return sizes


def child_env(home: Path) -> dict[str, str]:
    """Credentials as Lambda gives them (environment), and no instance metadata lookups to time out."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("AWS_", "PYTHON"))}
    env.update(
        {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": str(home / "none.cfg"),
            "AWS_SHARED_CREDENTIALS_FILE": str(home / "none.creds"),
            "HOME": str(home),
        }
    )
    return env


def measure(case: Case, env: dict[str, str]) -> dict[str, float]:
    code = CHILD.format(paths=[*case.paths, RUNTIME_SITE], statement=case.statement)
    # -I -S: no site processing, so no .pth (an editable install's finder) and no PYTHON* variables:
    # sys.path is the layer, then the runtime's packages, as on Lambda.
    command = [sys.executable, "-I", "-S", "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{case.label}: the import failed\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


def main() -> None:
    bench = parse_args()
    work = bench.work or Path(tempfile.mkdtemp(prefix="sdflow-bench-sdk-core-"))
    work.mkdir(parents=True, exist_ok=True)
    layer_target, sdk_target, home = work / "layer", work / "sdk-core", work / "home"
    for folder in (layer_target, sdk_target):
        shutil.rmtree(folder, ignore_errors=True)
    home.mkdir(exist_ok=True)
    try:
        pins, pinned_by = sdk_venv_pins(bench.version)
        print(f"installing the layer and sagemaker-core {bench.version} (pinned by {pinned_by}) into {work}")
        pip_target(layer_target, "-r", str(LAYER / "requirements.txt"), "-c", str(CONSTRAINTS))
        shutil.copytree(
            LAYER / "sdflow_common", layer_target / "sdflow_common", ignore=shutil.ignore_patterns("__pycache__")
        )
        pin_file = work / "sdk-pins.txt"
        pin_file.write_text("\n".join(pins) + "\n")
        pip_target(sdk_target, f"sagemaker-core=={bench.version}", "-c", str(pin_file))

        layer_bytes, sdk_bytes = tree_bytes(layer_target), tree_bytes(sdk_target)
        per_dist, in_layer = distribution_bytes(sdk_target), distribution_bytes(layer_target)
        runtime_bytes = sum(size for name, size in per_dist.items() if name in RUNTIME_PROVIDED)
        # Added to the layer, a distribution both need (pydantic, typing-extensions …) is there once.
        shared_bytes = sum(size for name, size in per_dist.items() if name in in_layer)
        combined = layer_bytes + sdk_bytes - shared_bytes
        rows = [
            ("layer now: powertools, thrift, sdflow_common", layer_bytes, tree_bytes(layer_target, pycache=False)),
            (f"sagemaker-core {bench.version} + dependencies", sdk_bytes, tree_bytes(sdk_target, pycache=False)),
            ("  less the runtime's boto3 stack", sdk_bytes - runtime_bytes, None),
            ("layer now + sagemaker-core (shared packages once)", combined, None),
        ]
        print()
        header = f"{'MiB':>8} {'no .pyc MiB':>12} {'of limit':>9} {'x layer':>8}"
        print(f"{'unzipped size (pip install --target)':<48} {header}")
        for label, size, no_pyc in rows:
            bare = f"{no_pyc / MIB:12.1f}" if no_pyc is not None else f"{'':>12}"
            share = size / LAMBDA_UNZIPPED_LIMIT
            print(f"{label:<48} {size / MIB:8.1f} {bare} {share:9.0%} {ratio(size, layer_bytes):>8}")
        print(f"{'Lambda quota: function + all layers, unzipped':<48} {LAMBDA_UNZIPPED_LIMIT / MIB:8.1f}")
        biggest = sorted(per_dist.items(), key=lambda item: -item[1])[:10]
        print("largest in sagemaker-core's closure: " + ", ".join(f"{n} {s / MIB:.0f}" for n, s in biggest) + " MiB")

        layer, sdk = (str(layer_target),), (str(sdk_target),)
        cases = [
            Case("bare interpreter (nothing imported)", "pass", ()),
            Case(
                "boto3 + sagemaker client",
                'import boto3; boto3.client("sagemaker", region_name="us-east-1")',
                layer,
            ),
            Case("layer: sdflow_common.sagemaker_jobs", "import sdflow_common.sagemaker_jobs", layer),
            Case(
                "layer: sagemaker_jobs + sagemaker client",
                'import boto3, sdflow_common.sagemaker_jobs; boto3.client("sagemaker", region_name="us-east-1")',
                layer,
            ),
            Case("sagemaker-core: sagemaker.core.shapes", "import sagemaker.core.shapes", sdk),
            Case("sagemaker-core: sagemaker.core.resources", "import sagemaker.core.resources", sdk),
        ]
        env = child_env(home)
        for case in cases:  # untimed: first compile of sdflow_common, page cache
            measure(case, env)
        results: dict[str, list[dict[str, float]]] = {case.label: [] for case in cases}
        for _round in range(bench.repeat):
            for case in cases:
                results[case.label].append(measure(case, env))
        seconds = {label: statistics.median(r["seconds"] for r in runs) for label, runs in results.items()}
        rss = {label: statistics.median(r["rss_mb"] for r in runs) for label, runs in results.items()}
        base = cases[1].label
        print()
        print(f"cold import, fresh interpreter, median of {bench.repeat} ({sys.version.split()[0]})")
        print(f"{'':<48} {'import s':>9} {'x boto3':>8} {'peak RSS MB':>12} {'x boto3':>8}")
        for case in cases:
            label = case.label
            print(
                f"{label:<48} {seconds[label]:9.3f} {ratio(seconds[label], seconds[base]):>8} "
                f"{rss[label]:12.1f} {ratio(rss[label], rss[base]):>8}"
            )
        fits = combined < LAMBDA_UNZIPPED_LIMIT
        print()
        print(
            f"fits the layer: {'yes' if fits else 'no'} ({combined / MIB:.0f} MiB of "
            f"{LAMBDA_UNZIPPED_LIMIT / MIB:.0f} MiB, before the functions' own code)"
        )
    finally:
        if bench.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
