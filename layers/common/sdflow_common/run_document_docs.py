"""docs/run-document.md's field tables, generated from the run document's model (sdflow_common.run_document):
each field's type, default, limits and description come from its pydantic field, so the page cannot promise
what Validate run refuses. What the model holds in code rather than in a field's constraints (an S3 location,
a rule across fields) is in ALLOWED_NOTES beside the generator; a unit test holds its keys to real fields.

    PYTHONPATH=layers/common .venv/bin/python -m sdflow_common.run_document_docs --write docs/run-document.md

(`--check docs/run-document.md` exits 1 when a table differs from the model; tests/unit/test_run_document_docs.py
checks it too). Each table sits between `<!-- fields: BLOCK -->` and `<!-- end fields -->` lines; the text
around the tables is the page's own."""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from sdflow_common.run_document import ENDPOINT_NAME, EXECUTION_ARN, RUN_NAME, RunDocument
from sdflow_common.training_options import INSTANCE_TYPE, LORA_TARGET_MODULE

DASH = "\N{EN DASH}"  # ranges as the page writes them
# The blocks with a table, by their path in the document ("" is the top level).
BLOCKS = (
    "",
    "dataset",
    "dataset.filters",
    "dataset.filters.columns",
    "download",
    "deduplication",
    "training",
    "training.lora",
    "endpoint",
    "evaluation",
    "approval",
)
# A pattern, in the words the page uses for it.
PATTERN_WORDS = {
    INSTANCE_TYPE: "`ml.<family>.<size>`",
    RUN_NAME: f"1{DASH}40 of `A{DASH}Z a{DASH}z 0{DASH}9 - _`",
    ENDPOINT_NAME.pattern: "letters, digits and hyphens, starting and ending with a letter or digit",
    LORA_TARGET_MODULE: "dotted Python names (`to_q`, `to_out.0`)",
    EXECUTION_ARN: "the ARN of an ended execution of this pipeline, "
    "`arn:aws:states:<region>:<account>:execution:<pipeline>:<name>`",
}
# What a field's validators allow beyond its constraints, by the field's path.
ALLOWED_NOTES = {
    "base_model_uri": "`s3://<data bucket>/…`",
    "dataset.parquet_uris": "at most the stack's MaxShards, each `s3://<bucket>/<key>` (not a folder), no duplicates",
    "dataset.prefix": "`s3://<bucket>/<folder>`",
    "dataset": "exactly one of `parquet_uris`, `prefix`",
    "dataset.filters": "at least one bound set; every column in every parquet (Validate run reads their footers)",
    "dataset.filters.max_aspect_ratio": "≥ 1",
    "dataset.filters.min_caption_length": "≤ `max_caption_length`",
    "training.max_wait_seconds": "≥ `max_runtime_seconds`, only with `use_spot`",
    "training.keep_alive_seconds": "not with `use_spot`",
    "training.plugin": "colossalai: `torch_ddp`, `low_level_zero`, `gemini`; accelerate: `ddp`, `fsdp2`",
    "training.mixed_precision": "accelerate: `no`, `bf16`",
    "training.lora": "only with `method` `lora`",
    "training.lora.target_modules": "each once, ≤ 2,500 characters joined",
    "training.validation_prompts": "≤ 2,500 characters as a JSON list",
    "endpoint.name": "starting with the stack's `EndpointNamePrefix` (default `sdflow`)",
    "evaluation.holdout_samples": "the dataset must hold it",
    "evaluation.clip_model_uri": "`s3://<this stack's bucket>/…/`",
    "evaluation.prompts_uri": "`s3://<this stack's bucket>/…`, not with `prompts`",
    "evaluation.prompts": "each in the scene grammar",
    "evaluation.min_prompt_adherence": "not with `gate.prompt_adherence`",
}
HEADER = "| field | type | default | allowed | meaning |\n|---|---|---|---|---|\n"
START = re.compile(r"^<!-- fields: (?P<block>[a-z_.]*) -->$", re.MULTILINE)
END = "<!-- end fields -->"
DAY = 24 * 3600


class StaleDocs(Exception):
    """The page has no table for a block, or its markers are broken."""


def block_model(path: str) -> type[BaseModel]:
    model: type[BaseModel] = RunDocument
    for part in filter(None, path.split(".")):
        model = _model_of(model.model_fields[part].annotation)
    return model


def _model_of(annotation: Any) -> type[BaseModel]:
    for arg in (annotation, *get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    raise TypeError(f"{annotation} holds no model")


def _nullable(annotation: Any) -> tuple[Any, bool]:
    if get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(annotation):
        rest = [arg for arg in get_args(annotation) if arg is not type(None)]
        return rest[0], True
    return annotation, False


def type_words(annotation: Any) -> str:
    inner, nullable = _nullable(annotation)
    origin = get_origin(inner)
    if origin is Literal:
        kinds = {type(value) for value in get_args(inner)}
        words = "integer" if kinds == {int} else "string"
    elif origin is list:
        words = f"list of {type_words(get_args(inner)[0])}s"
    elif get_origin(inner) is not None and get_args(inner):  # Annotated[str, Field(...)]
        words = type_words(get_args(inner)[0])
    else:
        simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
        words = simple.get(inner, "object") if isinstance(inner, type) else "object"
    return f"{words} or null" if nullable else words


def default_words(field: FieldInfo) -> str:
    if field.is_required():
        return "**required**"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "all defaults"
    if value is None:
        return "`null`"
    shown = f"`{json.dumps(value, ensure_ascii=False)}`"
    return f"{shown} ({_days(value)})" if _is_days(value) else shown


def _is_days(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= DAY and value % DAY == 0


def _days(value: int) -> str:
    return "1 day" if value == DAY else f"{value // DAY} days"


def _number(value: Any) -> str:
    return f"{value} ({_days(value)})" if _is_days(value) else f"{value}"


def _bounds(metadata: list[Any]) -> str:
    found: dict[str, Any] = {}
    for item in metadata:
        for name in ("ge", "gt", "le", "lt"):
            if getattr(item, name, None) is not None:
                found[name] = getattr(item, name)
    low = ("ge", found["ge"]) if "ge" in found else ("gt", found["gt"]) if "gt" in found else None
    high = ("le", found["le"]) if "le" in found else ("lt", found["lt"]) if "lt" in found else None
    if low and high and low[0] == "ge" and high[0] == "le":
        return f"{_number(low[1])} {DASH} {_number(high[1])}"
    if low and high and high[0] == "lt":
        return f"{low[1]} {'≤' if low[0] == 'ge' else '<'} x < {_number(high[1])}"
    words = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    return ", ".join(f"{words[bound[0]]} {_number(bound[1])}" for bound in (low, high) if bound is not None)


def _lengths(metadata: list[Any], unit: str) -> str:
    low = next((m.min_length for m in metadata if isinstance(m, annotated_types.MinLen)), None)
    high = next((m.max_length for m in metadata if isinstance(m, annotated_types.MaxLen)), None)
    if low is not None and high is not None:
        return f"{low}{DASH}{high} {unit}"
    if high is not None:
        return f"≤ {high} {unit}"
    if low:
        return "non-empty" if unit == "chars" and low == 1 else f"≥ {low} {unit}"
    return ""


def _pattern(metadata: list[Any]) -> str:
    for item in metadata:
        pattern = getattr(item, "pattern", None)
        if pattern is not None:
            return PATTERN_WORDS.get(str(pattern), f"`{pattern}`")
    return ""


def allowed_words(path: str, field: FieldInfo) -> str:
    inner, _ = _nullable(field.annotation)
    parts: list[str] = []
    if get_origin(inner) is Literal:
        parts.append(", ".join(f"`{value}`" for value in get_args(inner)))
    if get_origin(inner) is list:
        item = get_args(inner)[0]
        item_metadata = [m for arg in get_args(item)[1:] for m in getattr(arg, "metadata", [arg])]
        parts += [_lengths(field.metadata, "items")]
        each = ", ".join(filter(None, (_lengths(item_metadata, "chars"), _pattern(item_metadata))))
        parts += [f"each {each}" if each else ""]
    else:
        unit = "chars" if inner is str else "items"
        parts += [_bounds(field.metadata), _lengths(field.metadata, unit), _pattern(field.metadata)]
    parts.append(ALLOWED_NOTES.get(path, ""))
    return "; ".join(part for part in parts if part)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def table(block: str) -> str:
    """The markdown table of one block's fields, in the model's order."""
    rows = []
    for name, field in block_model(block).model_fields.items():
        path = f"{block}.{name}" if block else name
        cells = [
            f"`{name}`",
            type_words(field.annotation),
            default_words(field),
            allowed_words(path, field),
            field.description or "",
        ]
        rows.append("| " + " | ".join(_cell(cell) for cell in cells) + " |\n")
    return HEADER + "".join(rows)


def render(page: str) -> str:
    """`page` with every block's table between its markers replaced by the model's."""
    out: list[str] = []
    position, seen = 0, set[str]()
    for start in START.finditer(page):
        block = start["block"]
        if block not in BLOCKS:
            raise StaleDocs(f"<!-- fields: {block} --> names no block of the run document; blocks: {BLOCKS}")
        end = page.find(END, start.end())
        if end < 0:
            raise StaleDocs(f"<!-- fields: {block} --> has no {END} after it")
        out += [page[position : start.end()], "\n", table(block)]
        position, seen = end, seen | {block}
    if missing := [block or "(top level)" for block in BLOCKS if block not in seen]:
        raise StaleDocs(f"the page has no table for: {', '.join(missing)}")
    return "".join([*out, page[position:]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write or check docs/run-document.md's field tables.")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path, metavar="PATH", help="rewrite the tables in PATH")
    group.add_argument("--check", type=Path, metavar="PATH", help="exit 1 when PATH's tables differ from the model")
    args = parser.parse_args(argv)
    path = args.write or args.check
    page = path.read_text(encoding="utf-8")
    try:
        text = render(page)
    except StaleDocs as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 1
    if args.write:
        path.write_text(text, encoding="utf-8")
    elif text != page:
        print(
            f"{path}'s field tables differ from the run document's model; regenerate: --write {path}", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
