"""Which samples of a dataset are held out from training (docs/contracts.md "The download job").

A sample is held out iff `holdout_fraction(url) < rate`. The fraction hashes the sample's source
URL, not its webdataset key: img2dataset derives keys from row positions, so the same key repeats
across parquet files, while one URL appearing in several shards must always land on the same side.
The download job splits by it, and the evaluation ranks its candidates by it, so nothing needs to
store a list of held-out keys."""

from __future__ import annotations

import hashlib


def holdout_fraction(url: str) -> float:
    """A number in [0, 1), uniform over URLs: the first 8 bytes of sha256(url) over 2**64."""
    return int.from_bytes(hashlib.sha256(url.encode("utf-8")).digest()[:8], "big") / 2**64


def is_held_out(url: str, rate: float) -> bool:
    return holdout_fraction(url) < rate
