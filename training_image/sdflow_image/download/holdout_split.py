"""Splitting one finished img2dataset tar into its training part and its held-out part.

A sample is held out iff `sdflow_image.holdout.is_held_out(url, rate)`, where `url` is the source
URL img2dataset records in the sample's `.json` ("url"), or the sample's key when it has none.
The held-out samples go to a second tar (the download job uploads it as `holdout/NNNNN.tar`), the
others stay in the shard's own tar: both are valid webdataset tars with the member names and
order of the original, so the training reader and the evaluation read them as they read any shard.

The tar is streamed (`tarfile` mode `r|`, one forward pass): only one sample's members are in
memory at a time (webdataset groups consecutive members with the same key into a sample, and the
`.json` that decides the sample's side comes after its image), whatever the shard's size. The
disk briefly holds the original and its two parts."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sdflow_image.holdout import is_held_out, sample_url

# webdataset's key rule, as the training reader applies it (one rule, so the split's samples are
# the reader's): the key is the member's path up to the first dot of its file name.
from sdflow_image.training.data_source import _KEY_EXT as KEY_EXT


class HoldoutSplitError(RuntimeError):
    """A finished shard's tar could not be split; the message names the tar."""


@dataclass(frozen=True)
class SplitCounts:
    kept: int  # samples left in the training tar
    held_out: int  # samples moved to the held-out tar


Member = tuple[tarfile.TarInfo, bytes | None]  # a member and its data (None: not a regular file)


def _groups(tar: tarfile.TarFile) -> Iterator[tuple[str | None, list[Member]]]:
    """Consecutive members with one key, as (key, members); a member outside any sample (no
    extension, or not a regular file) alone, with key None."""
    key: str | None = None
    members: list[Member] = []
    for member in tar:
        match = KEY_EXT.match(member.name) if member.isfile() else None
        member_key = match.group(1) if match is not None else None
        if member_key is None or member_key != key:
            if members:
                yield key, members
            key, members = member_key, []
        handle = tar.extractfile(member) if member.isfile() else None
        members.append((member, handle.read() if handle is not None else None))
    if members:
        yield key, members


def _metadata(members: list[Member]) -> bytes | None:
    for info, data in members:
        match = KEY_EXT.match(info.name)
        if match is not None and match.group(2).lower() == "json":
            return data
    return None


def split_tar(source: Path, train_out: Path, holdout_out: Path, rate: float) -> SplitCounts:
    """Write the samples of `source` to `train_out` or `holdout_out` by their URL's fraction.
    Members that belong to no sample stay with the training part."""
    kept = held = 0
    try:
        with (
            tarfile.open(source, mode="r|") as tar,
            tarfile.open(train_out, mode="w", format=tarfile.PAX_FORMAT) as train,
            tarfile.open(holdout_out, mode="w", format=tarfile.PAX_FORMAT) as holdout,
        ):
            for key, members in _groups(tar):
                out = train
                if key is not None:
                    held_out = is_held_out(sample_url(key, _metadata(members)), rate)
                    out = holdout if held_out else train
                    kept, held = (kept, held + 1) if held_out else (kept + 1, held)
                for info, data in members:
                    out.addfile(info, io.BytesIO(data) if data is not None else None)
    except (tarfile.TarError, OSError) as exc:
        raise HoldoutSplitError(f"could not split {source.name} into its training and held-out parts: {exc}") from exc
    return SplitCounts(kept, held)
