"""The accelerate backend's image (training_image/Dockerfile.accelerate) cannot be built here (no
Docker engine), so its promises are checked by reading it, beside the first image's Dockerfile and
in the environment it mirrors (.venv-accelerate, where these tests run): the same /opt/ml contract
and entrypoints less `download`, the very files `make setup` installs, under the constraints, the
EFA plugin able to find the wheel's CUDA runtime, and the build replay and hadolint taking it."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.dockerfile_parsing import Instruction, arg_defaults, parse_dockerfile, pip_installs, shell_commands, values

pytestmark = pytest.mark.image

IMAGE_DIR = Path(__file__).resolve().parents[2] / "training_image"
REPO_ROOT = IMAGE_DIR.parent
ORCHESTRATION_BIN = REPO_ROOT / ".venv" / "bin"  # dockerfile-parse and hadolint live there (requirements/dev.txt)
# The EFA installer's aws-ofi-nccl, and the newest NCCL line that plugin release was tested with
# (EFA changelog; aws-ofi-nccl release notes). NCCL 2.30 brought the net v12 plugin interface,
# which aws-ofi-nccl speaks from 1.20.0 on: a torch bump that brings a newer NCCL than the
# installer's plugin was tested with must come with a look at a newer installer.
EFA_PLUGIN = {"1.50.0": ("1.21.1", (2, 31))}


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse_dockerfile((IMAGE_DIR / "Dockerfile.accelerate").read_text())


@pytest.fixture(scope="module")
def first() -> list[Instruction]:
    return parse_dockerfile((IMAGE_DIR / "Dockerfile").read_text())


def env_values(instructions: list[Instruction]) -> dict[str, str]:
    found = {}
    for value in values(instructions, "ENV"):
        for word in value.split():
            name, _, setting = word.partition("=")
            found[name] = setting.strip('"')
    return found


def test_dockerfile_accelerate_installs_its_requirements_under_constraints_then_checks(
    instructions: list[Instruction],
) -> None:
    installs = pip_installs(instructions)
    assert installs == [["-c", "constraints-accelerate.txt", "-r", "requirements-accelerate.txt"]], installs
    (run,) = [r for r in values(instructions, "RUN") if "requirements-accelerate.txt" in r]
    assert "pip check" in run, "the build must fail on a broken dependency set"
    for flag in ("BUILD_EXT", "FORCE_CUDA", "--no-build-isolation", "--no-deps"):
        assert flag not in run, f"{flag}: nothing in this stack is built from source or left unresolved"
    copied = values(instructions, "COPY")[0].split()
    assert {"requirements-accelerate.txt", "constraints-accelerate.txt"} <= set(copied)
    requirements = (IMAGE_DIR / "requirements-accelerate.txt").read_text().lower()
    for package in ("colossalai", "img2dataset"):
        assert f"\n{package}==" not in requirements, f"{package} stays in the first image"


def test_makefile_builds_the_second_job_environment_from_the_same_files_and_only_for_setup() -> None:
    makefile = (REPO_ROOT / "Makefile").read_text()
    recipe = makefile[makefile.index("$(ACC_STAMP):") :].split("\n\n", 1)[0]
    assert "-c training_image/constraints-accelerate.txt" in recipe
    assert "-r training_image/requirements-accelerate.txt" in recipe
    assert "-r requirements/image-test.txt" in recipe
    assert "pip check" in recipe
    assert "--no-deps" not in recipe, "dependencies are resolved, not skipped"
    # Each target's rule line and recipe: from "name:" at a line start to the next blank line.
    targets = {m.group(1): m.group(0) for m in re.finditer(r"^([a-z-]+):.*?(?=\n\n|\Z)", makefile, re.M | re.S)}
    assert "$(ACC_STAMP)" in targets["setup"]
    assert "$(ACC_BIN)/pytest tests/image_accelerate" in targets["test"]
    for demo in ("demo", "demo-lora"):  # the demo's ten minutes must not grow by a 6 GB venv
        assert "$(ACC_STAMP)" not in targets[demo]
        assert "setup" not in targets[demo].split("\n", 1)[0], f"{demo} must not depend on setup"
    assert "$(ACC_VENV)" in targets["clean"]


def test_dockerfile_accelerate_keeps_the_first_images_contract(
    instructions: list[Instruction], first: list[Instruction]
) -> None:
    for keyword in ("WORKDIR", "EXPOSE", "ENTRYPOINT"):
        assert values(instructions, keyword) == values(first, keyword), keyword
    assert values(instructions, "COPY")[-1] == "." + " /opt/ml/code"
    ours, theirs = env_values(instructions), env_values(first)
    for name in ("PATH", "VIRTUAL_ENV", "PYTHONUNBUFFERED", "PIP_NO_CACHE_DIR", "HF_HUB_OFFLINE", "WANDB_MODE"):
        assert ours[name] == theirs[name], name
    for name in ("FI_PROVIDER", "FI_EFA_FORK_SAFE"):
        assert ours[name] == theirs[name], name
    # Entrypoints: the same scripts, less download and dedup (their jobs stay in the first image).
    (last_run,) = [r for r in values(instructions, "RUN") if "/opt/ml/code/bin" in r]
    removed = [words[1:] for words in shell_commands(last_run) if words[0] == "rm"]
    assert removed == [["/opt/ml/code/bin/download", "/opt/ml/code/bin/dedup"]], removed
    kept = sorted(p.name for p in (IMAGE_DIR / "bin").iterdir() if p.name not in ("download", "dedup"))
    assert kept == ["evaluate", "serve", "train"]
    assert "Dockerfile.accelerate" in (IMAGE_DIR / ".dockerignore").read_text().split()


def test_dockerfile_accelerate_base_pinned_by_digest_python_and_torch_as_tested(
    instructions: list[Instruction],
) -> None:
    defaults = arg_defaults(instructions)
    (base,) = values(instructions, "FROM")
    image = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], base)
    match = re.fullmatch(r"python:(\d+\.\d+)-slim-bookworm@sha256:[0-9a-f]{64}", image)
    assert match, f"Docker's Python image, pinned by digest: {image}"
    assert match.group(1) == sysconfig.get_python_version(), "the image's Python is the one this venv tests"
    assert defaults["TORCH_VERSION"] == version("torch").split("+", 1)[0]


def test_dockerfile_accelerate_efa_plugin_fits_the_wheels_nccl_and_finds_its_cuda_runtime(
    instructions: list[Instruction], first: list[Instruction]
) -> None:
    (efa,) = [r for r in values(instructions, "RUN") if "efa_installer.sh" in r]
    (first_efa,) = [r for r in values(first, "RUN") if "efa_installer.sh" in r]
    assert efa == first_efa, "the EFA installer runs exactly as in the first image"
    installer = arg_defaults(instructions)["EFA_INSTALLER_VERSION"]
    assert installer in EFA_PLUGIN, f"EFA installer {installer}: which aws-ofi-nccl, tested with which NCCL?"
    nccl = tuple(int(part) for part in version("nvidia-nccl-cu13").split(".")[:2])
    assert nccl <= EFA_PLUGIN[installer][1], f"NCCL {nccl} is newer than aws-ofi-nccl {EFA_PLUGIN[installer][0]} knows"
    library_path = env_values(instructions)["LD_LIBRARY_PATH"].split(":")
    assert library_path[:2] == ["/opt/amazon/ofi-nccl/lib", "/opt/amazon/efa/lib"]
    assert "" not in library_path, "an empty entry would search the working directory"
    # The plugin dlopen()s "libcudart.so": the link must name the wheel's runtime, where pip puts it.
    (link,) = [words for r in values(instructions, "RUN") for words in shell_commands(r) if words[0] == "ln"]
    target, name = Path(link[-2].replace("${VIRTUAL_ENV}", "/opt/venv")), Path(link[-1])
    assert name.name == "libcudart.so"
    assert str(name.parent) in library_path, "the link's folder is on LD_LIBRARY_PATH"
    here = Path(sys.prefix) / target.relative_to("/opt/venv")  # this venv has the image's venv's layout
    assert here.is_file(), f"the wheel's CUDA runtime is not at {here}: update the link"


def test_dockerfile_accelerate_replay_plan_and_hadolint_take_it() -> None:
    python, hadolint = ORCHESTRATION_BIN / "python", ORCHESTRATION_BIN / "hadolint"
    assert python.is_file(), "run `make setup`: .venv has the replay's parser (dockerfile-parse)"
    assert hadolint.is_file(), "run `make setup`: .venv has hadolint"
    dockerfile = IMAGE_DIR / "Dockerfile.accelerate"
    planned = subprocess.run(
        [str(python), str(REPO_ROOT / ".ci" / "dockerfile_replay.py"), "--plan", "--dockerfile", str(dockerfile)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert "python:3.11-slim-bookworm" in planned.stdout
    assert planned.stdout.count("NOT REPLAYED") == 3, (
        "only the apt, EFA installer and cuda-compat lines are not replayed"
    )
    linted = subprocess.run([str(hadolint), str(dockerfile)], capture_output=True, text=True, check=False)
    assert linted.returncode == 0, f"hadolint found problems:\n{linted.stdout}{linted.stderr}"
