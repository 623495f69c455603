"""Which samples of a dataset are held out of training, for the evaluation: one definition that the
download job (which splits the shards), the dataset index and the evaluation job all share.

A sample is held out iff `holdout_fraction(url) < rate`. The fraction is the first 8 bytes of the
SHA-256 of the sample's source URL (img2dataset's "url" in its .json; the webdataset key when a
sample has none), read as an unsigned integer over 2**64: uniform on [0, 1), the same on every host
and Python (no `hash()` salt), and the same for one URL wherever it appears. The URL rather than the
key, because img2dataset derives keys from row positions, which repeat across parquet files: keyed
by URL, one image listed in several shards is always on the same side of the split.

The evaluation scores the held-out candidates of smallest fraction: the rate oversamples (some
downloads fail), and "the N smallest" is the same set whatever order the files are read in.

No torch here: the download job and the early checks import it."""

from __future__ import annotations

import hashlib
import json

_SCALE = 2**64


def holdout_fraction(url: str) -> float:
    """The sample's place in [0, 1): the first 8 bytes of sha256(url) as a big-endian integer / 2**64."""
    return int.from_bytes(hashlib.sha256(url.encode("utf-8")).digest()[:8], "big") / _SCALE


def is_held_out(url: str, rate: float) -> bool:
    """True when the sample with this URL (or key) is held out of training at `rate` (0: none, 1: all)."""
    return holdout_fraction(url) < rate


def sample_url(key: str, metadata: bytes | None) -> str:
    """The URL that decides a sample's side: the one img2dataset recorded in the sample's .json, else
    the sample's key (no .json, or one unreadable or without a url). The download's split and the
    evaluation's choice both read it here, so they never disagree on a sample."""
    try:
        meta = json.loads(metadata) if metadata is not None else None
    except ValueError:
        meta = None  # unreadable: the key still identifies the sample
    url = meta.get("url") if isinstance(meta, dict) else None
    return url if isinstance(url, str) and url else key
