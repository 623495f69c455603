"""The training image's Dockerfile cannot be built here (no Docker engine), so its promises
are checked by reading it: the exact pinned requirement files, the SageMaker layout, the
base image's torch equal to the pin, and no weights baked in."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.image

IMAGE_DIR = Path(__file__).resolve().parents[2] / "training_image"
REQUIREMENT_FILES = ("requirements.txt", "requirements-colossalai.txt")
PINNED = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?==[A-Za-z0-9.+!-]+$")


@dataclass(frozen=True)
class Instruction:
    keyword: str
    value: str


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with line continuations joined and comments dropped."""
    instructions: list[Instruction] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, value = full.partition(" ")
        instructions.append(Instruction(keyword.upper(), value.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse_dockerfile((IMAGE_DIR / "Dockerfile").read_text())


def values(instructions: list[Instruction], keyword: str) -> list[str]:
    return [i.value for i in instructions if i.keyword == keyword]


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    defaults = {}
    for value in values(instructions, "ARG"):
        name, sep, default = value.partition("=")
        if sep:
            defaults[name] = default
    return defaults


def requirement_lines(name: str) -> list[str]:
    lines = (IMAGE_DIR / name).read_text().splitlines()
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


def shell_commands(run: str) -> list[list[str]]:
    """A RUN line split into its commands (on &&, ||, ; and |), each as its words."""
    lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in {"&&", "||", ";", "|"}:
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def pip_installs(instructions: list[Instruction]) -> list[list[str]]:
    """The argument lists of every `pip install` in RUN instructions."""
    installs = []
    for run in values(instructions, "RUN"):
        for words in shell_commands(run):
            for start in range(len(words) - 1):
                if words[start].endswith("pip") and words[start + 1] == "install":
                    installs.append(words[start + 2 :])
                    break
    return installs


def test_requirement_files_every_line_pinned_exactly() -> None:
    for name in REQUIREMENT_FILES:
        lines = requirement_lines(name)
        assert lines, f"{name} is empty"
        loose = [line for line in lines if not PINNED.match(line)]
        assert not loose, f"{name}: pin these with ==: {loose}"


def test_dockerfile_installs_exactly_the_two_pinned_files(instructions: list[Instruction]) -> None:
    installs = pip_installs(instructions)
    assert installs == [
        ["-r", "requirements.txt"],
        ["--no-deps", "-r", "requirements-colossalai.txt"],
    ], f"pip installs must be exactly the two requirement files, got {installs}"
    # both files are in the image before the RUN that installs them
    copied = " ".join(values(instructions, "COPY")[:1]).split()
    assert set(REQUIREMENT_FILES) <= set(copied)


def test_dockerfile_base_image_torch_matches_requirement_pin(instructions: list[Instruction]) -> None:
    torch_pins = [line for line in requirement_lines("requirements.txt") if line.startswith("torch==")]
    assert len(torch_pins) == 1, torch_pins
    pin = torch_pins[0].removeprefix("torch==")
    (base,) = values(instructions, "FROM")
    resolved = re.sub(r"\$\{(\w+)\}", lambda m: arg_defaults(instructions)[m.group(1)], base)
    assert resolved.startswith(f"pytorch/pytorch:{pin}-cuda"), resolved
    assert resolved.endswith("-devel"), "Colossal-AI builds CUDA kernels at first use: nvcc is needed"


def test_dockerfile_sagemaker_layout(instructions: list[Instruction]) -> None:
    assert values(instructions, "WORKDIR") == ["/opt/ml/code"]
    env = " ".join(values(instructions, "ENV"))
    assert re.search(r"\bPATH=/opt/ml/code/bin:", env), "bin/ must be on PATH for train/serve/download"
    assert re.search(r"\bPYTHONUNBUFFERED=1\b", env)
    assert values(instructions, "EXPOSE") == ["8080"]
    # `docker run IMAGE train` must run train: no entrypoint may wrap or swallow the command
    assert values(instructions, "ENTRYPOINT") in ([], ["[]"])
    assert "COPY . /opt/ml/code" in [f"COPY {v}" for v in values(instructions, "COPY")]
    for command in ("train", "serve", "download"):
        script = IMAGE_DIR / "bin" / command
        assert script.is_file(), f"bin/{command} is missing"
        assert script.stat().st_mode & 0o111, f"bin/{command} is not executable"
        assert script.read_text().startswith("#!/usr/bin/env python3\n")


def test_dockerfile_bakes_in_no_model_weights(instructions: list[Instruction]) -> None:
    build_steps = " ".join(values(instructions, "RUN") + values(instructions, "ADD"))
    for forbidden in ("from_pretrained", "snapshot_download", "hf_hub_download", "huggingface-cli", "wget", "curl"):
        assert forbidden not in build_steps, f"the build must not fetch weights ({forbidden})"
    assert not values(instructions, "ADD"), "ADD can fetch URLs; use COPY"
    ignored = (IMAGE_DIR / ".dockerignore").read_text().split()
    for pattern in ("**/*.safetensors", "**/*.ckpt", "**/*.bin", "**/__pycache__"):
        assert pattern in ignored, f".dockerignore must exclude {pattern}"
