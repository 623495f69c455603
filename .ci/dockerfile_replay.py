"""Replay the training images' build steps as written, without a Docker engine.

Two Dockerfiles, one build context (training_image/): Dockerfile (the Colossal-AI image) and
Dockerfile.accelerate (the accelerate backend's image); `--dockerfile` picks one, and each has a
stand-in for its own base image (BASES).

CI has no Docker engine and cannot pull the base image, so this builds the image's file system
the way `docker build` would, step by step, and fails where the build would fail:

- every RUN line runs verbatim under `/bin/sh -c` (Docker's shell form), in the WORKDIR in
  effect, with exactly the ARG defaults and ENV values in effect at that line as its environment;
- WORKDIR creates its folder; COPY copies from the build context (training_image/, less what
  .dockerignore excludes, read with fnmatch: `**/` matches at any depth);
- all of it inside a private mount namespace (`unshare`, no privileges needed) where /opt is an
  overlay whose writes go to a scratch folder: /opt/venv and /opt/ml/code are the Dockerfile's own
  paths, and the host's /opt is read, never written. Where the kernel or a container refuses
  namespaces, CI (root, CI=true, a machine used once) replays on the host's own /opt instead: the
  paths it would write must not exist before, and are removed after.

What stands in for Dockerfile's base image (FROM ${BASE_IMAGE}, pytorch/pytorch:2.5.1-cuda12.4-cudnn9-devel):
- its Python: a Python prefix at /opt/conda (where that image keeps its Python) made from the
  host's CPython 3.11 (its interpreter copied, its standard library linked), with pip, and torch
  at the Dockerfile's TORCH_VERSION from PyPI under training_image/constraints.txt: PyPI's
  2.5.1+cu124 wheel, the build that image carries. The venv the Dockerfile makes with
  --system-site-packages sees it there, as it sees the image's;
- its PATH: /opt/conda/bin, then the host's system folders;
- its OS: the host's (Debian, /bin/sh, g++, tar), not Ubuntu 22.04. No CUDA toolkit and no GPU,
  which is what `docker build` sees too.
- The network: the host's pip settings (HOME for the user's pip.conf, PIP_* variables the
  Dockerfile does not set) reach the RUN lines, as a builder's network does.

What stands in for Dockerfile.accelerate's (python:3.11-slim-bookworm, Docker's Python on Debian 12):
the same kind of Python prefix, at /opt/python (that image keeps its Python in /usr/local, which the
replay does not overlay; the RUN lines find `python` on PATH either way), with pip and no torch (that
base has none: the image installs torch from its requirements); PATH puts it first.

Not replayed, each for the reason NOT_REPLAYED (NOT_REPLAYED_ACCELERATE) gives: the lines that
install into the base's operating system with apt (they would change the host's), the EFA
installer and, in Dockerfile.accelerate, NVIDIA's cuda-compat (hosts outside the package
registries). They are matched by their exact text; a listed line that changed, or went, fails
the replay, so the list is re-read whenever they change.

    python .ci/dockerfile_replay.py [--dockerfile training_image/Dockerfile.accelerate] [--keep DIR]
    python .ci/dockerfile_replay.py --plan [--dockerfile ...]   # the steps, replayed or not; runs none
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONTEXT = REPO / "training_image"
DOCKERFILE = CONTEXT / "Dockerfile"
DOCKERFILE_ACCELERATE = CONTEXT / "Dockerfile.accelerate"
BASE_PREFIX = Path("/opt/conda")  # where pytorch/pytorch images keep their Python
BASE_PATH = f"{BASE_PREFIX}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
INSIDE_FLAG = "--inside-namespace"

APT_REASON = (
    "apt-get installs into the base image's Ubuntu 22.04; here it would change the CI host's own system "
    "(as root) or fail (without). The host's own tools stand in: checked present (REQUIRED_HOST_TOOLS)"
)
EFA_REASON = (
    "downloads the EFA installer from efa-installer.amazonaws.com, a host outside the package registries CI "
    "may reach, and installs its .debs with apt into the base's OS; checked by building the image on AWS"
)
COMPAT_REASON = (
    "installs NVIDIA's cuda-compat from developer.download.nvidia.com, a host outside the package registries CI may "
    "reach, with dpkg and apt into the base's OS; the driver libraries it holds serve a GPU host only (the compat "
    "rule itself is tested on CPU: tests/image/test_gpu_check.py)"
)
# Exact RUN text (continuations joined, as Docker passes it to the shell) -> why it is not replayed.
NOT_REPLAYED: dict[str, str] = {
    "apt-get update     && apt-get install -y --no-install-recommends g++ curl ca-certificates     "
    "&& rm -rf /var/lib/apt/lists/*": APT_REASON,
    'mkdir /tmp/efa && cd /tmp/efa     && curl -fsSLO "https://efa-installer.amazonaws.com/aws-efa-installer-'
    '${EFA_INSTALLER_VERSION}.tar.gz"     && tar -xf "aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz"     '
    "&& cd aws-efa-installer     && apt-get update     && ./efa_installer.sh -y --skip-kmod --skip-limit-conf "
    "--no-verify     && cd / && rm -rf /tmp/efa /var/lib/apt/lists/*     && test -f "
    "/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so     && ls /opt/amazon/efa/lib/libfabric.so*": EFA_REASON,
}
REQUIRED_HOST_TOOLS = ("g++", "tar", "sh")  # what the apt line installs or the later lines use
# Dockerfile.accelerate's lines of the same two kinds, for the same reasons (its base's OS is Debian 12;
# its apt line installs curl for the EFA installer, which no replayed line uses).
NOT_REPLAYED_ACCELERATE: dict[str, str] = {
    "apt-get update     && apt-get install -y --no-install-recommends curl ca-certificates     "
    "&& rm -rf /var/lib/apt/lists/*": APT_REASON.replace("Ubuntu 22.04", "Debian 12"),
    'mkdir /tmp/efa && cd /tmp/efa     && curl -fsSLO "https://efa-installer.amazonaws.com/aws-efa-installer-'
    '${EFA_INSTALLER_VERSION}.tar.gz"     && tar -xf "aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz"     '
    "&& cd aws-efa-installer     && apt-get update     && ./efa_installer.sh -y --skip-kmod --skip-limit-conf "
    "--no-verify     && cd / && rm -rf /tmp/efa /var/lib/apt/lists/*     && test -f "
    "/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so     && ls /opt/amazon/efa/lib/libfabric.so*": EFA_REASON,
    'curl -fsSLO "https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/${CUDA_KEYRING}"     '
    '&& dpkg -i "${CUDA_KEYRING}" && rm "${CUDA_KEYRING}"     && apt-get update     && apt-get install -y '
    "--no-install-recommends cuda-compat-13-0     && rm -rf /var/lib/apt/lists/*     && test -L "
    '"${SDFLOW_CUDA_COMPAT_DIR}/libcuda.so.1"     && ls "${SDFLOW_CUDA_COMPAT_DIR}"/libcuda.so.580.*': COMPAT_REASON,
}
METADATA = {"EXPOSE", "ENTRYPOINT", "CMD", "LABEL", "COMMENT", "ARG", "ENV"}  # nothing to run
PASSED_THROUGH = ("HOME", "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")


class ReplayError(RuntimeError):
    """A build step failed, or the Dockerfile has a step the replay cannot stand for."""


@dataclass(frozen=True)
class Base:
    """What stands in for one base image: a Python 3.11 prefix, with torch where the image has it."""

    image: str  # the start of the BASE_IMAGE it stands for (name and tag)
    prefix: Path
    not_replayed: dict[str, str]
    host_tools: tuple[str, ...]  # what the unreplayed lines would install and the replayed ones use
    torch_arg: str | None = None  # the ARG naming the torch the base image carries; None: it has none

    @property
    def path(self) -> str:
        return f"{self.prefix}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


BASES = (
    Base("pytorch/pytorch:", BASE_PREFIX, NOT_REPLAYED, REQUIRED_HOST_TOOLS, torch_arg="TORCH_VERSION"),
    Base("python:3.11-slim-bookworm", Path("/opt/python"), NOT_REPLAYED_ACCELERATE, ("tar", "sh")),
)


@dataclass
class Step:
    instruction: str
    value: str  # as written, continuations joined
    line: int  # 1-based, in the Dockerfile
    args: dict[str, str] = field(default_factory=dict)
    envs: dict[str, str] = field(default_factory=dict)

    def words(self) -> list[str]:
        """The value split into words with ARG and ENV substituted (WORKDIR, COPY), as Docker does."""
        from dockerfile_parse.util import WordSplitter

        return list(WordSplitter(self.value, args=self.args, envs=self.envs).split())


def parse(dockerfile: Path = DOCKERFILE, base_path: str | None = None) -> list[Step]:
    """The Dockerfile's instructions, each with the ARG and ENV values in effect there (PATH: the
    base image's, `base_path` or that of the stand-in for the base its FROM line names)."""
    import io

    from dockerfile_parse import DockerfileParser

    if base_path is None:  # a FROM line with no stand-in (a test's) gets the first base's PATH
        try:
            base_path = base_for(parse(dockerfile, base_path="")).path
        except ReplayError:
            base_path = BASE_PATH
    # A file object: given a path, DockerfileParser reads <path>/Dockerfile unless the name ends so.
    content = io.BytesIO(dockerfile.read_bytes())
    parser = DockerfileParser(fileobj=content, env_replace=True, parent_env={"PATH": base_path})
    return [
        Step(item["instruction"], item["value"], item["startline"] + 1, dict(ctx.args), dict(ctx.envs))
        for item, ctx in zip(parser.structure, parser.context_structure, strict=True)
    ]


def base_for(steps: list[Step]) -> Base:
    """The stand-in for the image the one FROM line names (ARG defaults substituted)."""
    froms = [s for s in steps if s.instruction == "FROM"]
    if len(froms) != 1:
        raise ReplayError(f"the replay stands in for one base image; the Dockerfile has {len(froms)} FROM lines")
    # ARGs before FROM are in scope only for it: the parser gives FROM no args, so substitute them here.
    before = {
        name: default
        for step in steps[: steps.index(froms[0])]
        if step.instruction == "ARG"
        for name, _, default in [step.value.partition("=")]
    }
    image = Step("FROM", froms[0].value, froms[0].line, args=before).words()[0]
    for base in BASES:
        if image.startswith(base.image):
            return base
    raise ReplayError(f"Dockerfile line {froms[0].line}: no stand-in for the base image {image} (BASES)")


def plan(steps: list[Step], not_replayed: dict[str, str] | None = None) -> list[Step]:
    """The steps to replay; raises on an instruction the replay cannot stand for, or a stale list."""
    not_replayed = NOT_REPLAYED if not_replayed is None else not_replayed
    froms = [s for s in steps if s.instruction == "FROM"]
    if len(froms) != 1:
        raise ReplayError(f"the replay stands in for one base image; the Dockerfile has {len(froms)} FROM lines")
    unknown = [s for s in steps if s.instruction not in METADATA | {"FROM", "RUN", "WORKDIR", "COPY"}]
    if unknown:
        raise ReplayError(
            f"Dockerfile line {unknown[0].line}: {unknown[0].instruction} is not replayed by .ci/dockerfile_replay.py"
        )
    runs = [s.value for s in steps if s.instruction == "RUN"]
    for text in not_replayed:
        if runs.count(text) != 1:
            raise ReplayError(
                "NOT_REPLAYED lists a RUN line the Dockerfile no longer has (changed or removed): "
                f"{text[:80]}... Update the list, after checking the line cannot be replayed"
            )
    for step in steps:
        if step.instruction == "RUN" and step.value.lstrip().startswith("["):
            raise ReplayError(f"Dockerfile line {step.line}: exec-form RUN is not replayed (shell form only)")
    return [s for s in steps if s.instruction in {"RUN", "WORKDIR", "COPY"}]


def run_environment(step: Step, host: dict[str, str], base_path: str = BASE_PATH) -> dict[str, str]:
    """What a RUN line sees: the build's ARG and ENV values over the host's network settings."""
    passed = {k: v for k, v in host.items() if k in PASSED_THROUGH or k.startswith("PIP_")}
    return {**passed, "PATH": base_path, **step.args, **step.envs}


def dockerignore_patterns(context: Path = CONTEXT) -> list[str]:
    path = context / ".dockerignore"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def ignored(relative: str, patterns: list[str]) -> bool:
    """Whether .dockerignore excludes `relative` (a POSIX path in the context) or a folder above it."""
    parts = relative.split("/")
    for pattern in patterns:
        if pattern.startswith("!"):
            raise ReplayError(f".dockerignore exception {pattern!r} is not replayed")
        anywhere = pattern.startswith("**/")
        bare = pattern[3:] if anywhere else pattern.lstrip("/")
        for end in range(1, len(parts) + 1):
            starts = range(end) if anywhere else range(1)
            if any(fnmatch.fnmatchcase("/".join(parts[start:end]), bare) for start in starts):
                return True
    return False


def copy_into(step: Step, workdir: Path, context: Path = CONTEXT) -> None:
    words = step.words()
    if any(w.startswith("--") for w in words) or len(words) < 2:
        raise ReplayError(f"Dockerfile line {step.line}: COPY {step.value!r} is not replayed (flags or no source)")
    *sources, dest_word = words
    dest = Path(dest_word) if dest_word.startswith("/") else workdir / dest_word
    patterns = dockerignore_patterns(context)
    into_folder = dest_word.endswith("/") or len(sources) > 1 or dest_word in {".", "./"}
    for source in sources:
        origin = (context / source).resolve()
        if origin == context.resolve() or origin.is_dir():
            _copy_tree(origin, dest, context, patterns)
        else:
            rel = origin.relative_to(context.resolve()).as_posix()
            if ignored(rel, patterns):
                raise ReplayError(f"Dockerfile line {step.line}: COPY {source} is excluded by .dockerignore")
            target = dest / origin.name if into_folder else dest
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, target)


def _copy_tree(origin: Path, dest: Path, context: Path, patterns: list[str]) -> None:
    for path in sorted(origin.rglob("*")):
        rel = path.relative_to(context.resolve()).as_posix()
        if ignored(rel, patterns) or path.is_dir():
            continue
        target = dest / path.relative_to(origin)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


def make_base(torch_version: str | None, base: Base = BASES[0]) -> None:
    """The stand-in for the base image's Python (see the module docstring), at its prefix, with
    torch at `torch_version` from PyPI (under constraints.txt) where the base image carries one."""
    prefix = base.prefix
    base_exe = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    if version != "python3.11":
        raise ReplayError(f"the base image's Python is 3.11; run the replay with a Python 3.11, not {version}")
    lib = prefix / "lib" / version
    (prefix / "bin").mkdir(parents=True)
    lib.mkdir(parents=True)
    shutil.copy2(base_exe, prefix / "bin" / version)  # a copy: a link would lead Python to its old prefix
    for name in ("python3", "python"):
        (prefix / "bin" / name).symlink_to(version)
    for entry in stdlib.iterdir():
        if entry.name != "site-packages":
            (lib / entry.name).symlink_to(entry)
    (lib / "site-packages").mkdir()
    python = str(prefix / "bin" / "python")
    env = {**{k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "PYTHONPATH"}}, "PATH": base.path}
    found = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], env=env, capture_output=True, text=True)
    if found.stdout.strip() != str(prefix):
        prefix = found.stdout.strip()
        raise ReplayError(f"the stand-in Python's prefix is {prefix!r}, not {prefix}: {found.stderr}")
    subprocess.run([python, "-m", "ensurepip", "--default-pip"], env=env, check=True)
    if torch_version is not None:
        pin = ["-c", str(CONTEXT / "constraints.txt"), f"torch=={torch_version}"]
        subprocess.run([python, "-m", "pip", "install", "-q", *pin], env=env, check=True)


def replay(
    steps: list[Step], host: dict[str, str], not_replayed: dict[str, str] | None = None, base_path: str = BASE_PATH
) -> list[tuple[int, str, float]]:
    """Run the planned steps in order; returns (line, what, seconds) for each."""
    not_replayed = NOT_REPLAYED if not_replayed is None else not_replayed
    timings: list[tuple[int, str, float]] = []
    workdir = Path("/")
    for step in plan(steps, not_replayed):
        started = time.perf_counter()
        if step.instruction == "WORKDIR":
            (word,) = step.words()
            workdir = Path(word) if word.startswith("/") else workdir / word
            workdir.mkdir(parents=True, exist_ok=True)
            what = f"WORKDIR {workdir}"
        elif step.instruction == "COPY":
            copy_into(step, workdir)
            what = f"COPY {step.value}"
        elif step.value in not_replayed:
            print(f"--- line {step.line}: RUN not replayed: {not_replayed[step.value]}", flush=True)
            timings.append((step.line, "RUN (not replayed)", 0.0))
            continue
        else:
            print(f"--- line {step.line}: RUN {step.value}", flush=True)
            result = subprocess.run(
                ["/bin/sh", "-c", step.value], cwd=workdir, env=run_environment(step, host, base_path)
            )
            if result.returncode != 0:
                raise ReplayError(
                    f"Dockerfile line {step.line}: RUN exited {result.returncode} (the image build would fail "
                    f"there): {step.value[:200]}"
                )
            what = f"RUN {step.value[:60]}"
        timings.append((step.line, what, time.perf_counter() - started))
    return timings


def inside(keep: Path, dockerfile: Path = DOCKERFILE, *, overlay: bool = True) -> int:
    """In the private mount namespace: /opt as an overlay, the stand-in base, then the steps.
    Without `overlay` (CI without namespaces: see the module docstring) on the host's /opt."""
    if overlay:
        upper, work = keep / "opt-upper", keep / "opt-work"
        upper.mkdir(parents=True)
        work.mkdir()
        subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", f"lowerdir=/opt,upperdir={upper},workdir={work}", "/opt"],
            check=True,
        )
    steps = parse(dockerfile)
    base = base_for(steps)
    if base.prefix.exists():
        raise ReplayError(f"{base.prefix} exists on this host: the stand-in base would mix with it")
    missing = [tool for tool in base.host_tools if shutil.which(tool) is None]
    if missing:
        raise ReplayError(f"the host lacks {missing}, which the unreplayed apt line installs in the image")
    plan(steps, base.not_replayed)  # refuse before the slow part
    torch_version = next(s.args[base.torch_arg] for s in steps if base.torch_arg in s.args) if base.torch_arg else None
    started = time.perf_counter()
    make_base(torch_version, base)
    base_s = time.perf_counter() - started
    timings = replay(steps, dict(os.environ), base.not_replayed, base.path)
    carried = f" + torch {torch_version} from PyPI" if torch_version else ""
    print(f"\n{dockerfile.name}: stand-in base (Python 3.11{carried}) made in {base_s:.0f} s", flush=True)
    for line, what, seconds in timings:
        print(f"  line {line:3d}  {seconds:7.1f} s  {what}", flush=True)
    total = base_s + sum(s for _, _, s in timings)
    print(f"replayed {sum(1 for t in timings if 'not replayed' not in t[1])} steps in {total:.0f} s; "
          f"not replayed: {len(base.not_replayed)} RUN lines (BASES)", flush=True)  # fmt: skip
    return 0


def show_plan(dockerfile: Path) -> int:
    """--plan: the base stood in for, then each step, replayed or not (and why); runs none of them."""
    steps = parse(dockerfile)
    base = base_for(steps)
    print(f"{dockerfile.name}: base {base.image}..., stood in for at {base.prefix}", flush=True)
    for step in plan(steps, base.not_replayed):
        reason = base.not_replayed.get(step.value) if step.instruction == "RUN" else None
        print(f"  line {step.line:3d}  {step.instruction} {step.value[:80]}", flush=True)
        if reason:
            print(f"            NOT REPLAYED: {reason}", flush=True)
    return 0


def namespaces_allowed(namespace: list[str]) -> bool:
    """Whether `unshare` may make the namespace here, and mount in it."""
    probe = subprocess.run([*namespace, "sh", "-c", "mount -t tmpfs none /mnt"], capture_output=True, check=False)
    return probe.returncode == 0


def on_host(scratch: Path, dockerfile: Path) -> int:
    """The replay on the host's /opt (CI without namespaces): what it writes there is removed after."""
    if os.geteuid() != 0 or os.environ.get("CI", "").lower() not in {"1", "true"}:
        print(
            "dockerfile replay FAILED: this machine refuses mount namespaces (unshare), and replaying on the "
            "host's /opt is done only as root in CI (CI=true): run it where `unshare -rm` works",
            file=sys.stderr,
            flush=True,
        )
        return 1
    before = set(Path("/opt").iterdir()) if Path("/opt").exists() else set()
    targets = [base_for(parse(dockerfile)).prefix, Path("/opt/venv"), Path("/opt/ml/code")]
    present = [str(path) for path in targets if path.exists()]
    if present:
        print(
            f"dockerfile replay FAILED: {present} exist on this host; the replay would mix with them", file=sys.stderr
        )
        return 1
    print("--- no mount namespace here: replaying on the host's /opt (CI), removed afterwards", flush=True)
    try:
        return inside(scratch, dockerfile, overlay=False)
    except (ReplayError, subprocess.CalledProcessError) as exc:
        print(f"dockerfile replay FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        for path in [*targets, *(set(Path("/opt").iterdir()) - before)]:
            shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--keep", type=Path, default=None, help="scratch folder to use and keep (default: removed)")
    parser.add_argument(
        "--dockerfile",
        type=Path,
        default=DOCKERFILE,
        help="the Dockerfile to replay (or a variant), on training_image/",
    )
    parser.add_argument("--plan", action="store_true", help="print the steps, replayed or not and why; run none")
    parser.add_argument(INSIDE_FLAG, dest="inside", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.plan:
            return show_plan(args.dockerfile.resolve())
        if args.inside is not None:
            return inside(args.inside, args.dockerfile.resolve())
    except (ReplayError, subprocess.CalledProcessError) as exc:
        print(f"dockerfile replay FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    scratch = (args.keep or Path(tempfile.mkdtemp(prefix="dockerfile-replay-"))).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        # -m: mounts of our own (private: the host sees none of them). As root that is all it takes;
        # otherwise -r makes us root in a user namespace of our own, which the kernel must allow.
        namespace = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
        if not namespaces_allowed(namespace):
            return on_host(scratch, args.dockerfile.resolve())
        command = [sys.executable, __file__, "--dockerfile", str(args.dockerfile.resolve()), INSIDE_FLAG, str(scratch)]
        code = subprocess.run([*namespace, *command], check=False).returncode
        if code != 0:
            print(f"dockerfile replay exited {code} (run as: {' '.join(namespace)} ...)", file=sys.stderr, flush=True)
        return code
    finally:
        if args.keep is None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
