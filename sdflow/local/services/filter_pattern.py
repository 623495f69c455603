"""CloudWatch Logs filter patterns (FilterLogEvents' `filterPattern`), as the CloudWatch Logs user
guide's "Filter pattern syntax for metric filters, subscription filters, filter log events, and
Live Tail" describes them. No pinned library parses them; moto matches a bare term or phrase only
and returns every event for anything else.

Emulated:
- Unstructured events ("Using filter patterns to match terms in unstructured log events"): an
  empty pattern matches every event; terms are case-sensitive and must all appear
  (`ERROR ARGUMENTS`); a phrase with spaces or other characters goes in double quotes
  (`"INTERNAL SERVER ERROR"`); `-term` excludes events that contain it; `?term ?term` matches
  events with any of them.
- JSON events ("Using filter patterns to match terms in JSON log events"): `{ SELECTOR OP VALUE }`
  with `=` / `!=` on strings (quoted or not, `*` a wildcard anywhere in the value) and
  `=`, `!=`, `<`, `>`, `<=`, `>=` on numbers; `IS TRUE`, `IS FALSE`, `IS NULL`, `NOT EXISTS`;
  `&&`, `||` and parentheses. A selector is `$.a.b` with `[n]` for array elements. An event that
  is not a JSON object, or lacks the field, matches no comparison.
- Regular expressions between `%` (`%ERROR [0-9]+%`), searched anywhere in the message.
Not emulated: space-delimited patterns (`[ip, user, ...]`), refused with InvalidParameterException
rather than answered wrongly."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any

Matcher = Callable[[str], bool]
_MISSING = object()


class FilterPatternError(ValueError):
    """The pattern is not valid filter-pattern syntax (AWS: InvalidParameterException)."""


@functools.lru_cache(maxsize=256)
def compile_pattern(pattern: str | None) -> Matcher:
    """A predicate on an event's message; parsed once per pattern (moto builds its filter per event)."""
    text = (pattern or "").strip()
    if not text:
        return lambda message: True
    if text.startswith("{"):
        return _json_matcher(text)
    if text.startswith("["):
        raise FilterPatternError("Space-delimited filter patterns ([field, ...]) are not emulated by the local cloud")
    if len(text) > 1 and text.startswith("%") and text.endswith("%"):
        try:
            regex = re.compile(text[1:-1])
        except re.error as bad:
            raise FilterPatternError(f"Invalid regular expression in filter pattern: {bad}") from None
        return lambda message: regex.search(message) is not None
    return _terms_matcher(text)


# ---------------------------------------------------------------- unstructured terms

_TERM = re.compile(r'([-?]?)(?:"((?:[^"\\]|\\.)*)"|(\S+))')


def _terms_matcher(text: str) -> Matcher:
    required: list[str] = []
    excluded: list[str] = []
    either: list[str] = []
    position = 0
    for found in _TERM.finditer(text):
        if text[position : found.start()].strip():
            raise FilterPatternError(f"Invalid filter pattern: {text!r}")
        position = found.end()
        prefix, quoted, bare = found.groups()
        term = re.sub(r"\\(.)", r"\1", quoted) if quoted is not None else bare
        if bare is not None and '"' in bare:
            raise FilterPatternError(f"Unbalanced quotes in filter pattern: {text!r}")
        {"-": excluded, "?": either, "": required}[prefix].append(term)
    if text[position:].strip():
        raise FilterPatternError(f"Unbalanced quotes in filter pattern: {text!r}")

    def matches(message: str) -> bool:
        if any(term not in message for term in required) or any(term in message for term in excluded):
            return False
        return not either or any(term in message for term in either)

    return matches


# ---------------------------------------------------------------- JSON patterns

_JSON_TOKEN = re.compile(
    r"""\s*(?:
        (?P<group>[()])
      | (?P<logic>&&|\|\|)
      | (?P<op>!=|<=|>=|=|<|>)
      | (?P<keyword>IS\s+TRUE|IS\s+FALSE|IS\s+NULL|NOT\s+EXISTS)\b
      | (?P<string>"(?:[^"\\]|\\.)*")
      | (?P<word>[^\s()=!<>&|"]+)
    )""",
    re.VERBOSE,
)
_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?$")
_SELECTOR_PART = re.compile(r"\.([^.\[\]]+)|\[(\d+)\]")


def _tokens(body: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    position = 0
    while body[position:].strip():
        found = _JSON_TOKEN.match(body, position)
        if found is None or found.lastgroup is None:
            raise FilterPatternError(f"Invalid JSON filter pattern near {body[position:].strip()[:20]!r}")
        tokens.append((found.lastgroup, found.group(found.lastgroup)))
        position = found.end()
    return tokens


class _Parser:
    """expression := term ('||' term)*; term := factor ('&&' factor)*;
    factor := '(' expression ')' | SELECTOR (OP VALUE | IS TRUE | IS FALSE | IS NULL | NOT EXISTS)"""

    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.tokens, self.index = tokens, 0

    def _peek(self) -> tuple[str, str] | None:
        return self.tokens[self.index] if self.index < len(self.tokens) else None

    def _next(self, what: str) -> tuple[str, str]:
        token = self._peek()
        if token is None:
            raise FilterPatternError(f"Invalid JSON filter pattern: {what} expected at the end")
        self.index += 1
        return token

    def parse(self) -> Callable[[Any], bool]:
        expression = self._expression()
        if self._peek() is not None:
            raise FilterPatternError(f"Invalid JSON filter pattern: unexpected {self._peek()[1]!r}")  # type: ignore[index]
        return expression

    def _expression(self) -> Callable[[Any], bool]:
        terms = [self._term()]
        while self._peek() == ("logic", "||"):
            self.index += 1
            terms.append(self._term())
        return terms[0] if len(terms) == 1 else (lambda document: any(term(document) for term in terms))

    def _term(self) -> Callable[[Any], bool]:
        factors = [self._factor()]
        while self._peek() == ("logic", "&&"):
            self.index += 1
            factors.append(self._factor())
        return factors[0] if len(factors) == 1 else (lambda document: all(factor(document) for factor in factors))

    def _factor(self) -> Callable[[Any], bool]:
        kind, text = self._next("a selector")
        if (kind, text) == ("group", "("):
            inner = self._expression()
            if self._next("')'") != ("group", ")"):
                raise FilterPatternError("Invalid JSON filter pattern: ')' expected")
            return inner
        if kind != "word" or not text.startswith("$"):
            raise FilterPatternError(f"Invalid JSON filter pattern: a selector ($.field) expected, not {text!r}")
        path = _selector(text)
        kind, operator = self._next("an operator")
        if kind == "keyword":
            return _keyword_test(path, " ".join(operator.split()))
        if kind != "op":
            raise FilterPatternError(f"Invalid JSON filter pattern: an operator expected after {text!r}")
        kind, value = self._next("a value")
        if kind not in ("string", "word"):
            raise FilterPatternError(f"Invalid JSON filter pattern: a value expected after {operator!r}")
        return _comparison(path, operator, value, quoted=kind == "string")


def _selector(text: str) -> list[str | int]:
    path: list[str | int] = []
    position = 1
    while position < len(text):
        found = _SELECTOR_PART.match(text, position)
        if found is None:
            raise FilterPatternError(f"Invalid selector in filter pattern: {text!r}")
        path.append(found.group(1) if found.group(1) is not None else int(found.group(2)))
        position = found.end()
    if not path:
        raise FilterPatternError(f"Invalid selector in filter pattern: {text!r}")
    return path


def _resolve(document: Any, path: list[str | int]) -> Any:
    for part in path:
        in_list = isinstance(part, int) and isinstance(document, list) and part < len(document)
        in_object = isinstance(part, str) and isinstance(document, dict) and part in document
        if not (in_list or in_object):
            return _MISSING
        document = document[part]
    return document


def _keyword_test(path: list[str | int], keyword: str) -> Callable[[Any], bool]:
    expected = {"IS TRUE": True, "IS FALSE": False, "IS NULL": None}
    if keyword == "NOT EXISTS":
        return lambda document: _resolve(document, path) is _MISSING
    wanted = expected[keyword]
    return lambda document: (found := _resolve(document, path)) is not _MISSING and found is wanted


def _comparison(path: list[str | int], operator: str, literal: str, quoted: bool) -> Callable[[Any], bool]:
    text = json.loads(literal) if quoted else literal
    number = float(text) if not quoted and _NUMBER.match(text) else None
    if operator not in ("=", "!=") and number is None:
        raise FilterPatternError(f"Invalid JSON filter pattern: {operator!r} needs a number, not {literal!r}")
    wildcard = re.compile("^" + ".*".join(re.escape(piece) for piece in text.split("*")) + "$", re.DOTALL)

    def equal(found: Any) -> bool:
        if number is not None and isinstance(found, int | float) and not isinstance(found, bool):
            return float(found) == number
        return isinstance(found, str) and wildcard.match(found) is not None

    def test(document: Any) -> bool:
        found = _resolve(document, path)
        if found is _MISSING:
            return False
        if operator == "=":
            return equal(found)
        if operator == "!=":
            return not equal(found)
        if number is None or not isinstance(found, int | float) or isinstance(found, bool):
            return False
        value = float(found)
        return {"<": value < number, ">": value > number, "<=": value <= number, ">=": value >= number}[operator]

    return test


def _json_matcher(text: str) -> Matcher:
    if not text.endswith("}"):
        raise FilterPatternError(f"Invalid JSON filter pattern, no closing brace: {text!r}")
    test = _Parser(_tokens(text[1:-1])).parse()

    def matches(message: str) -> bool:
        try:
            document = json.loads(message)
        except ValueError:
            return False
        return isinstance(document, dict) and test(document)

    return matches
