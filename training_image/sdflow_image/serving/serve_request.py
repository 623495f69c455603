"""The body of POST /invocations: from bytes and headers to a validated request, or a 400.

Every malformed request is a `BadRequestError` naming the field at fault, never an exception
that would reach the client as a 500: bodies that are not UTF-8, not JSON, JSON nested deeper
than Python's parser recurses (RecursionError), text with lone UTF-16 surrogates (JSON allows
the escape "\\ud800"; UTF-8 cannot carry it, so neither the tokenizer nor a JSON answer could).
"""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

JSON_TYPE = "application/json"
PNG_TYPE = "image/png"
SIZE_MULTIPLE = 8  # the VAE of every Stable Diffusion model downsamples by a power of two ≤ 8
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a 64-bit value


class BadRequestError(Exception):
    """A request the server will not run; carries the field at fault for the 400 body."""

    def __init__(
        self,
        message: str,
        field: str | None = None,
        errors: list[dict[str, str]] | None = None,
        status: int = 400,
        **extra: Any,
    ):
        super().__init__(message)
        self.message = message
        self.field = field
        self.errors = errors or [{"field": field or "body", "message": message}]
        self.status = status
        self.extra = extra


@dataclass(frozen=True)
class SizeLimits:
    min_size: int = 64
    max_size: int = 1024
    max_prompt_chars: int = 1000


class InvocationRequest(BaseModel):
    """The body of POST /invocations. Strict: no coercion ("7" is not 7), no unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str
    negative_prompt: str | None = None
    num_inference_steps: int = Field(default=30, ge=1, le=150)
    guidance_scale: float = Field(default=7.5, ge=0.0, le=30.0, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    # None: the size the model was trained at (known once it is loaded).
    width: int | None = None
    height: int | None = None
    num_images: int = Field(default=1, ge=1, le=4)

    @field_validator("prompt", "negative_prompt")
    @classmethod
    def _prompt_text(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return value
        limits = _limits_from(info)
        if info.field_name == "prompt" and not value.strip():
            raise PydanticCustomError("prompt_empty", "must be a non-empty string")
        if len(value) > limits.max_prompt_chars:
            raise PydanticCustomError(
                "prompt_too_long",
                "is {length} characters long; the limit is {limit}",
                {"length": len(value), "limit": limits.max_prompt_chars},
            )
        surrogate = next((ch for ch in value if "\ud800" <= ch <= "\udfff"), None)
        if surrogate is not None:
            raise PydanticCustomError(
                "prompt_surrogate",
                "contains the lone UTF-16 surrogate \\u{code:04x}, which is not text; "
                "escape characters beyond U+FFFF as a surrogate pair or send them as UTF-8",
                {"code": ord(surrogate)},
            )
        return value

    @field_validator("width", "height")
    @classmethod
    def _image_size(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None:
            return value
        limits = _limits_from(info)
        if not limits.min_size <= value <= limits.max_size or value % SIZE_MULTIPLE:
            raise PydanticCustomError(
                "image_size",
                "must be a multiple of {multiple} between {low} and {high}",
                {"multiple": SIZE_MULTIPLE, "low": limits.min_size, "high": limits.max_size},
            )
        return value


REQUEST_FIELDS = tuple(InvocationRequest.model_fields)


def _limits_from(info: ValidationInfo) -> SizeLimits:
    context = info.context or {}
    limits = context.get("limits")
    return limits if isinstance(limits, SizeLimits) else SizeLimits()


_JSON_TYPE_NAMES = {
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _decode_json(body: bytes) -> Any:
    try:
        return json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except RecursionError:
        # json's parser recurses once per nesting level; the request has only flat fields.
        raise BadRequestError(
            "body nests arrays or objects too deeply to parse; every field of the request is a plain value",
            field="body",
        ) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequestError(f"body is not valid JSON: {exc}", field="body") from exc


def parse_request(body: bytes, content_type: str | None, limits: SizeLimits) -> InvocationRequest:
    """Bytes and Content-Type of a POST /invocations → a validated request, or BadRequestError."""
    if content_type is not None:
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type != JSON_TYPE:
            raise BadRequestError(
                f"Content-Type must be {JSON_TYPE}, got {_show(content_type)}; send the request as JSON",
                field="Content-Type",
            )
    data = _decode_json(body)
    if not isinstance(data, dict):
        raise BadRequestError(
            f"body must be a JSON object with the fields {', '.join(REQUEST_FIELDS)}; "
            f"got a JSON {_JSON_TYPE_NAMES.get(type(data), type(data).__name__)}",
            field="body",
        )
    try:
        return InvocationRequest.model_validate(data, context={"limits": limits})
    except ValidationError as exc:
        errors = [_describe_error(err) for err in exc.errors(include_url=False, include_input=True)]
        first = errors[0]
        raise BadRequestError("; ".join(e["message"] for e in errors), field=first["field"], errors=errors) from exc
    except RecursionError:
        raise BadRequestError("body nests arrays or objects too deeply to validate", field="body") from None


# A shown input is cut at both length and depth: a value nested a thousand levels deep must
# not make the error message itself recurse past Python's limit.
_SHOW = reprlib.Repr()
_SHOW.maxlevel = 2
_SHOW.maxstring = 60
_SHOW.maxother = 60
_SHOW.maxlist = _SHOW.maxdict = 4


def _show(value: Any) -> str:
    return _SHOW.repr(value)


def _describe_error(err: Any) -> dict[str, str]:
    """One pydantic error → {"field", "message"}, worded for someone writing the request."""
    name = ".".join(_show(part) if not isinstance(part, str) else part for part in err["loc"]) or "body"
    kind = err["type"]
    if kind == "extra_forbidden":
        message = f"unknown field {_show(name)}; the allowed fields are {', '.join(REQUEST_FIELDS)}"
    elif kind == "missing":
        message = f"{name} is required"
    else:
        message = f"{name}: {_lower_first(err['msg'])} (got {_show(err.get('input'))})"
    return {"field": name, "message": message}


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def choose_media_type(accept: str | None) -> str | None:
    """The response type for an Accept header: JSON unless PNG is preferred; None → 406."""
    if accept is None or not accept.strip():
        return JSON_TYPE
    # (quality, -position) so that, at equal quality, the first listed type wins.
    best: tuple[float, int, str] | None = None
    for position, item in enumerate(accept.split(",")):
        parts = [p.strip() for p in item.split(";")]
        media_range = parts[0].lower()
        quality = 1.0
        for param in parts[1:]:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                quality = _quality(value)
        if not quality > 0:  # also false for nan
            continue
        if media_range in ("*/*", "application/*", JSON_TYPE):
            candidate = JSON_TYPE
        elif media_range in ("image/*", PNG_TYPE):
            candidate = PNG_TYPE
        else:
            continue
        key_tuple = (quality, -position, candidate)
        if best is None or key_tuple[:2] > best[:2]:
            best = key_tuple
    return best[2] if best else None


def _quality(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return 0.0
