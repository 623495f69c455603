"""One way to declare and parse the flags of the image's three entrypoints (download, train, serve).

Each entrypoint lists its flags as `Flag` rows; `build_parser` turns them into an argparse parser
whose errors raise `FlagError` (argparse would print and exit 2, and the reason would never reach
SageMaker's failure file). SageMaker passes a training job's hyperparameters as strings in
hyperparameters.json: `parse` converts them with the very same converters and takes them as
defaults, so `--flag value` on the command line and `{"flag": "value"}` in the job request are
checked alike, and an unknown key is an error that lists the known ones.

Environment defaults (`Flag.env`) serve SageMaker's own variables (SAGEMAKER_BIND_TO_PORT) and
the local runtime's; a bad value there names the variable.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

Converter = Callable[[str], Any]


class FlagError(ValueError):
    """A flag, hyperparameter or environment default is missing or invalid; the message names it."""


# --- converters: text -> value, or ValueError("<what is wrong>") --------------------------------


def number(
    kind: type, minimum: float | None = None, *, exclusive: bool = False, maximum: float | None = None
) -> Converter:
    """int or float within bounds; the error says which bound."""
    noun = "an integer" if kind is int else "a number"

    def convert(text: str) -> Any:
        try:
            value = kind(str(text).strip())
        except ValueError:
            raise ValueError(f"is not {noun}") from None
        if kind is float and not math.isfinite(value):
            raise ValueError("is not a finite number")
        if minimum is not None and (value <= minimum if exclusive else value < minimum):
            raise ValueError(f"must be {'>' if exclusive else '>='} {minimum:g}")
        if maximum is not None and value > maximum:
            raise ValueError(f"must be <= {maximum:g}")
        return value

    convert.__name__ = kind.__name__
    return convert


positive_int = number(int, 1)
non_negative_int = number(int, 0)
positive_float = number(float, 0, exclusive=True)
non_negative_float = number(float, 0)


def boolean(text: str) -> bool:
    value = str(text).strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise ValueError("is not true or false")


def choice(options: Sequence[str]) -> Converter:
    def convert(text: str) -> str:
        value = str(text).strip()
        if value not in options:
            raise ValueError(f"is not one of {', '.join(options)}")
        return value

    convert.__name__ = "choice"
    return convert


def prompt_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError('is not a JSON list of strings (e.g. ["a cat", "a dog"])') from None
    if not isinstance(value, list) or not all(isinstance(p, str) and p.strip() for p in value):
        raise ValueError('is not a JSON list of non-empty strings (e.g. ["a cat", "a dog"])')
    return value


def text(value: str) -> str:
    return value


def path(text: str) -> Path:
    if not text.strip():
        raise ValueError("is empty; expected a path")
    return Path(text)


def name_list(text: str) -> list[str]:
    """Comma-separated names (module names, ...); empty text is the empty list."""
    names = [name.strip() for name in str(text).split(",")]
    if any(not name for name in names) and str(text).strip():
        raise ValueError("has an empty name between commas (e.g. to_q,to_k,to_v)")
    return [name for name in names if name]


# --- declaring and parsing ------------------------------------------------------------------------


@dataclass(frozen=True)
class Flag:
    """One flag: `--name` on the command line, `name` as a hyperparameter."""

    name: str
    convert: Converter
    default: Any
    help: str
    required: bool = False
    env: str | None = None  # environment variable that overrides `default`
    # argparse's nargs ("+": one or more values, each converted, the flag's value their list); None: one value
    nargs: str | None = None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise FlagError(f"{message} (see `{self.prog} --help`)")


def argparse_type(convert: Converter) -> Converter:
    """A converter as an argparse `type=`: its ValueError becomes argparse's message for the flag."""

    def wrapped(raw: str) -> Any:
        try:
            return convert(raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{raw!r} {exc}") from None

    wrapped.__name__ = convert.__name__
    return wrapped


def _default(flag: Flag, environ: Mapping[str, str]) -> Any:
    raw = environ.get(flag.env) if flag.env else None
    if raw is None or not raw.strip():
        return flag.default
    try:
        return flag.convert(raw)
    except ValueError as exc:
        raise FlagError(f"environment variable {flag.env}={raw!r} {exc} (it sets --{flag.name})") from None


def build_parser(
    prog: str, description: str, flags: Sequence[Flag], environ: Mapping[str, str] | None = None
) -> argparse.ArgumentParser:
    environ = os.environ if environ is None else environ
    parser = _Parser(prog=prog, description=description)
    for flag in flags:
        default = _default(flag, environ)
        where = f"; env {flag.env}" if flag.env else ""
        parser.add_argument(
            f"--{flag.name}",
            dest=flag.name,
            type=argparse_type(flag.convert),
            default=default,
            required=flag.required and default is None,
            help=f"{flag.help} (default: {default}{where})",
            **({"nargs": flag.nargs} if flag.nargs else {}),
        )
    return parser


def hyperparameter_defaults(flags: Sequence[Flag], hyperparameters: Mapping[str, str]) -> dict[str, Any]:
    """Typed values of hyperparameters.json, or FlagError naming the key, the value and the fix."""
    known = {flag.name: flag for flag in flags}
    typed: dict[str, Any] = {}
    for key, raw in hyperparameters.items():
        if key.startswith("sagemaker_"):
            continue  # SageMaker's own keys (framework containers add some)
        flag = known.get(key)
        if flag is None:
            raise FlagError(f"unknown hyperparameter {key!r}; known: {', '.join(sorted(known))}")
        try:
            typed[key] = flag.convert(str(raw))
        except ValueError as exc:
            raise FlagError(f"hyperparameter {key}={raw!r} {exc}") from None
    return typed


def parse(
    parser: argparse.ArgumentParser,
    flags: Sequence[Flag],
    argv: Sequence[str] | None = None,
    hyperparameters: Mapping[str, str] | None = None,
) -> argparse.Namespace:
    """Hyperparameters become defaults, then `argv` (default: sys.argv[1:]) goes on top."""
    if hyperparameters:
        parser.set_defaults(**hyperparameter_defaults(flags, hyperparameters))
    return parser.parse_args(None if argv is None else list(argv))
