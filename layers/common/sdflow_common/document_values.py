"""Values every block of the run document checks and quotes: S3 URIs, and text made safe to quote in a report
(run_document assembles the document; its blocks import these from here, run_document re-exports them)."""

from __future__ import annotations

import re
import unicodedata

S3_URI = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])/(?P<key>.*)$")
# Field names and values quoted in a message are cut to this many characters.
QUOTE_LIMIT = 80
# Escaped when quoted: control and format characters, lone surrogates (JSON allows them, UTF-8
# encoders refuse them), line and paragraph separators (they would break a report's lines).
UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/key` → (bucket, key); ValueError naming the expected form otherwise."""
    match = S3_URI.match(uri)
    if not match:
        raise ValueError(f"'{uri}' is not an S3 URI; write it as s3://<bucket>/<key>")
    return match["bucket"], match["key"]


def printable(text: str, limit: int = QUOTE_LIMIT) -> str:
    """`text` safe to quote in a report, an error cause and an SNS message: control characters and
    lone surrogates (legal in JSON, refused by UTF-8 encoders) escaped, cut to `limit` characters."""
    out = []
    for char in text:
        if unicodedata.category(char) in UNSAFE_CATEGORIES:
            out.append(char.encode("unicode_escape", "backslashreplace").decode("ascii"))
        else:
            out.append(char)
    shown = "".join(out)
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"
