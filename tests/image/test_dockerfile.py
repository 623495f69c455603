"""The training image's Dockerfile cannot be built here (no Docker engine), so its promises
are checked by reading it (the exact pinned requirement files installed the same way as the
job environment .venv-image, the SageMaker layout, the base image's torch equal to the pin and
pinned by digest, no weights, tests or demo code baked in), and the job environment these tests
run in is checked against the same files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.dockerfile_parsing import Instruction, arg_defaults, parse_dockerfile, pip_installs, shell_commands, values

pytestmark = pytest.mark.image

IMAGE_DIR = Path(__file__).resolve().parents[2] / "training_image"
REQUIREMENT_FILES = ("requirements.txt", "requirements-colossalai.txt", "constraints.txt")
REPO_ROOT = IMAGE_DIR.parent
PINNED = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?==[A-Za-z0-9.+!-]+$")


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse_dockerfile((IMAGE_DIR / "Dockerfile").read_text())


def requirement_lines(name: str) -> list[str]:
    lines = (IMAGE_DIR / name).read_text().splitlines()
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


def test_requirement_files_every_line_pinned_exactly() -> None:
    for name in REQUIREMENT_FILES:
        lines = requirement_lines(name)
        assert lines, f"{name} is empty"
        loose = [line for line in lines if not PINNED.match(line)]
        assert not loose, f"{name}: pin these with ==: {loose}"


def test_dockerfile_installs_the_two_files_with_constraints_then_checks(instructions: list[Instruction]) -> None:
    installs = pip_installs(instructions)
    assert installs == [
        ["-c", "constraints.txt", "-r", "requirements.txt"],
        ["--no-build-isolation", "-c", "constraints.txt", "-r", "requirements-colossalai.txt"],
    ], f"pip installs must be exactly the two requirement files under the constraints, got {installs}"
    run = next(r for r in values(instructions, "RUN") if "requirements-colossalai.txt" in r)
    for variable in ("BUILD_EXT", "FORCE_CUDA"):
        assert variable not in run, (
            "Colossal-AI 0.5.0's setup.py builds kernels only where it sees a GPU, and no image builder has one: "
            "the training job builds them (sdflow_image/training/kernels.py)"
        )
    assert "pip check" in run, "the build must fail on a broken dependency set"
    copied = values(instructions, "COPY")[0].split()
    assert set(REQUIREMENT_FILES) <= set(copied), "every requirement file is in the image before the install"


def test_makefile_builds_the_job_environment_from_the_same_files() -> None:
    makefile = (REPO_ROOT / "Makefile").read_text()
    recipe = makefile[makefile.index("$(IMAGE_STAMP):") :].split("\n\n", 1)[0]
    assert "-c training_image/constraints.txt" in recipe
    for name in ("requirements.txt", "requirements-colossalai.txt"):
        assert f"-r training_image/{name}" in recipe, f"the job environment must install {name}"
    assert "pip check" in recipe
    assert "--no-deps" not in recipe, "dependencies are resolved, not skipped"


def test_dockerfile_base_image_torch_matches_requirement_pin(instructions: list[Instruction]) -> None:
    torch_pins = [line for line in requirement_lines("requirements.txt") if line.startswith("torch==")]
    assert len(torch_pins) == 1, torch_pins
    pin = torch_pins[0].removeprefix("torch==")
    assert arg_defaults(instructions)["TORCH_VERSION"] == pin
    (base,) = values(instructions, "FROM")
    resolved = re.sub(r"\$\{(\w+)\}", lambda m: arg_defaults(instructions)[m.group(1)], base)
    assert resolved.startswith(f"pytorch/pytorch:{pin}-cuda"), resolved
    assert re.search(r"-devel@sha256:[0-9a-f]{64}$", resolved), "a -devel base (nvcc), pinned by digest"


def test_dockerfile_installs_into_a_venv_not_the_system_python(instructions: list[Instruction]) -> None:
    runs = values(instructions, "RUN")
    assert any("-m venv --system-site-packages" in r for r in runs), "PEP 668: install into a venv"
    env = " ".join(values(instructions, "ENV"))
    assert re.search(r"\bPATH=/opt/ml/code/bin:/opt/venv/bin:", env)


def test_job_environment_has_every_pinned_version() -> None:
    from importlib.metadata import PackageNotFoundError, version

    wrong = {}
    for name in ("requirements.txt", "requirements-colossalai.txt"):
        for line in requirement_lines(name):
            package, _, pin = line.partition("==")
            package = package.split("[", 1)[0]
            try:
                installed = version(package)
            except PackageNotFoundError:
                installed = "missing"
            if installed.split("+", 1)[0] != pin:
                wrong[package] = f"pinned {pin}, installed {installed}"
    assert not wrong, f"the job environment differs from the image's requirements: {wrong} (run `make setup`)"


@pytest.mark.slow
def test_job_environment_pip_check_is_clean() -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_sagemaker_layout(instructions: list[Instruction]) -> None:
    assert values(instructions, "WORKDIR") == ["/opt/ml/code"]
    env = " ".join(values(instructions, "ENV"))
    assert re.search(r"\bPATH=/opt/ml/code/bin:", env), "bin/ must be on PATH for train/serve/download"
    assert re.search(r"\bPYTHONUNBUFFERED=1\b", env)
    assert values(instructions, "EXPOSE") == ["8080"]
    # `docker run IMAGE train` must run train: no entrypoint may wrap or swallow the command
    assert values(instructions, "ENTRYPOINT") in ([], ["[]"])
    assert "COPY . /opt/ml/code" in [f"COPY {v}" for v in values(instructions, "COPY")]
    for command in ("train", "serve", "download", "dedup", "evaluate"):
        script = IMAGE_DIR / "bin" / command
        assert script.is_file(), f"bin/{command} is missing"
        assert script.stat().st_mode & 0o111, f"bin/{command} is not executable"
        assert script.read_text().startswith("#!/usr/bin/env python3\n")


def test_dockerfile_bakes_in_no_model_weights(instructions: list[Instruction]) -> None:
    build_steps = " ".join(values(instructions, "RUN") + values(instructions, "ADD"))
    for forbidden in ("from_pretrained", "snapshot_download", "hf_hub_download", "huggingface-cli", "wget"):
        assert forbidden not in build_steps, f"the build must not fetch weights ({forbidden})"
    fetched = [
        word
        for run in values(instructions, "RUN")
        for words in shell_commands(run)
        if words[0] == "curl"
        for word in words[1:]
        if "://" in word
    ]
    assert [re.sub(r"\$\{\w+\}", "V", url) for url in fetched] == [
        "https://efa-installer.amazonaws.com/aws-efa-installer-V.tar.gz"
    ], "curl fetches the EFA installer and nothing else"
    assert not values(instructions, "ADD"), "ADD can fetch URLs; use COPY"
    ignored = (IMAGE_DIR / ".dockerignore").read_text().split()
    for pattern in (
        "**/*.safetensors",
        "**/*.ckpt",
        "**/*.bin",
        "**/__pycache__",
        "sdflow_image/builders",
    ):
        assert pattern in ignored, f".dockerignore must exclude {pattern}"


def test_dockerfile_installs_efa_as_aws_dlc_recipe_and_points_nccl_at_it(instructions: list[Instruction]) -> None:
    """The choice (Dockerfile, base note): the PyTorch base plus the EFA installer run as AWS's Deep
    Learning Container recipe runs it, not the DLC itself (README, "The training image")."""
    (efa,) = [r for r in values(instructions, "RUN") if "efa_installer.sh" in r]
    (installer,) = [words for words in shell_commands(efa) if words[0] == "./efa_installer.sh"]
    assert installer[1:] == ["-y", "--skip-kmod", "--skip-limit-conf", "--no-verify"], installer
    assert "test -f /opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so" in efa, "the build fails without the NCCL plugin"
    assert re.fullmatch(r"\d+\.\d+\.\d+", arg_defaults(instructions)["EFA_INSTALLER_VERSION"])
    env = " ".join(values(instructions, "ENV"))
    assert re.search(r"\bFI_PROVIDER=efa\b", env)
    assert re.search(r"\bFI_EFA_FORK_SAFE=1\b", env), "DataLoader workers fork a rank that registered EFA memory"
    assert re.search(r"\bLD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib:", env)
    assert "FI_EFA_USE_DEVICE_RDMA" not in env, "forcing GPUDirect RDMA fails on EFA hosts without it"
