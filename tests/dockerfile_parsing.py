"""Reading a Dockerfile without Docker: its instructions (continuations joined, comments dropped),
ARG defaults and the commands of its RUN lines. Shared by the tests of both training images
(tests/image/test_dockerfile.py, tests/image_accelerate/test_dockerfile_accelerate.py), which run in
different venvs; standard library only."""

from __future__ import annotations

import shlex
from dataclasses import dataclass


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


def values(instructions: list[Instruction], keyword: str) -> list[str]:
    return [i.value for i in instructions if i.keyword == keyword]


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    defaults = {}
    for value in values(instructions, "ARG"):
        name, sep, default = value.partition("=")
        if sep:
            defaults[name] = default
    return defaults


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
