"""The held-out samples the evaluation scores: read from the download job's `holdout/NNNNN.tar`
files (webdataset tars as img2dataset writes them: `<key>.jpg|png|webp`, `<key>.txt`, `<key>.json`
with the source "url"), the N of smallest `holdout.holdout_fraction(url)` chosen.

"Smallest fraction first" (ties by key, then by tar path) is a function of the samples alone, not of
the order the files are listed or read in, so two evaluations of one dataset score the same images
and a larger N only adds images. One URL present in several shards is one candidate (the first by
key and tar path): it is one image. A chosen image that does not decode is skipped (logged, and
counted in `Selection.skipped`) and the next candidate takes its place, as training skips it.

Reading costs two passes over the tars: the first reads only captions and urls, the second decodes
the chosen images, so memory holds N images, not the whole held-out set. No torch here: the job
checks its inputs before it imports it."""

from __future__ import annotations

import io
import logging
import tarfile
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from sdflow_image import holdout
from sdflow_image.evaluation.errors import HoldoutError
from sdflow_image.training.data_source import ShardReadError, TarSample, iter_samples

LOG = logging.getLogger("sdflow.evaluate")

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")  # training.data.IMAGE_KEYS (that module imports torch)
CAPTION_EXTENSIONS = ("txt", "caption", "text")  # training.data.CAPTION_KEYS
HOLDOUT_FIX = "mount the run's held-out tars there (the download job's holdout/NNNNN.tar files)"


@dataclass(frozen=True)
class Candidate:
    """One held-out sample before its image is decoded."""

    fraction: float
    key: str
    tar: str  # path relative to --holdout_dir: the tie-break after the key, and where the error points
    url: str
    caption: str

    @property
    def order(self) -> tuple[float, str, str]:
        return (self.fraction, self.key, self.tar)


@dataclass(frozen=True)
class HeldOutSample:
    candidate: Candidate
    image: Image.Image  # RGB, as stored (the job resizes it to the render resolution)

    @property
    def caption(self) -> str:
        return self.candidate.caption


@dataclass
class Selection:
    samples: list[HeldOutSample]
    candidates: int  # distinct held-out samples with an image and a caption
    tar_files: int
    skipped: list[str] = field(default_factory=list)  # "<tar>:<key>: why", for images that did not decode


def _first(files: dict[str, bytes], extensions: Sequence[str]) -> bytes | None:
    return next((files[ext] for ext in extensions if ext in files), None)


def _url(sample: TarSample) -> str:
    return holdout.sample_url(sample.key, sample.files.get("json"))


def tar_files(holdout_dir: Path) -> list[Path]:
    """Every *.tar below --holdout_dir, sorted; raises HoldoutError when the folder is missing."""
    if not holdout_dir.is_dir():
        raise HoldoutError(f"--holdout_dir {holdout_dir} does not exist or is not a folder; {HOLDOUT_FIX}")
    return sorted(path for path in holdout_dir.rglob("*.tar") if path.is_file())


def _samples(tar: Path) -> Iterator[TarSample]:
    where = f"--holdout_dir {tar}"
    try:
        with tar.open("rb") as stream:
            yield from iter_samples(stream, 0, where)
    except (OSError, EOFError, tarfile.TarError, ShardReadError) as exc:
        raise HoldoutError(f"{where} is not a readable tar ({exc}); {HOLDOUT_FIX}") from exc


def read_candidates(holdout_dir: Path, tars: Sequence[Path]) -> list[Candidate]:
    """Every held-out sample with an image and a caption, one per URL, in selection order."""
    best: dict[str, Candidate] = {}
    for tar in tars:
        relative = tar.relative_to(holdout_dir).as_posix()
        for sample in _samples(tar):
            caption = _first(sample.files, CAPTION_EXTENSIONS)
            if caption is None or _first(sample.files, IMAGE_EXTENSIONS) is None:
                continue  # img2dataset writes none such; a hand-made tar might
            url = _url(sample)
            text = caption.decode("utf-8", errors="replace").strip()
            candidate = Candidate(holdout.holdout_fraction(url), sample.key, relative, url, text)
            # Samples without a url are keyed by their key, which repeats across shards: not merged.
            identity = url if url != sample.key else f"{relative}\0{sample.key}"
            if identity not in best or candidate.order < best[identity].order:
                best[identity] = candidate
    return sorted(best.values(), key=lambda c: c.order)


def _decode(raw: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(raw))
    image.load()
    return image.convert("RGB")


def _read_images(
    holdout_dir: Path, wanted: Sequence[Candidate], fit: Callable[[Candidate, Image.Image], Image.Image]
) -> dict[tuple[str, str], Image.Image | str]:
    """The wanted candidates' images (or why one did not decode), reading only their tars; each image
    passes through `fit` as soon as it is decoded, so memory holds fitted images, not originals."""
    keys: dict[str, set[str]] = defaultdict(set)
    for candidate in wanted:
        keys[candidate.tar].add(candidate.key)
    by_key = {(candidate.tar, candidate.key): candidate for candidate in wanted}
    found: dict[tuple[str, str], Image.Image | str] = {}
    for relative, tar_keys in sorted(keys.items()):
        for sample in _samples(holdout_dir / relative):
            raw = _first(sample.files, IMAGE_EXTENSIONS) if sample.key in tar_keys else None
            if raw is None:
                continue
            try:
                candidate = by_key[(relative, sample.key)]
                found[(relative, sample.key)] = fit(candidate, _decode(raw))
            except (OSError, ValueError, Image.DecompressionBombError) as exc:
                found[(relative, sample.key)] = f"does not decode ({exc})"
    return found


def select(holdout_dir: Path, count: int, fit: Callable[[int, Image.Image], Image.Image] | None = None) -> Selection:
    """The `count` held-out samples of smallest holdout fraction, images decoded (fewer when the
    folder holds fewer; none when it holds no tar). `fit(rank, image)` shapes each decoded image (rank:
    its candidate's place in the selection order), so a large N need not hold N originals."""
    tars = tar_files(holdout_dir)
    ordered = read_candidates(holdout_dir, tars)
    rank = {(candidate.tar, candidate.key): place for place, candidate in enumerate(ordered)}

    def fitted(candidate: Candidate, image: Image.Image) -> Image.Image:
        return fit(rank[(candidate.tar, candidate.key)], image) if fit is not None else image

    selection = Selection(samples=[], candidates=len(ordered), tar_files=len(tars))
    position = 0
    while len(selection.samples) < count and position < len(ordered):
        batch = ordered[position : position + count - len(selection.samples)]
        position += len(batch)
        images = _read_images(holdout_dir, batch, fitted)
        for candidate in batch:
            image = images.get((candidate.tar, candidate.key), "vanished between two reads")
            if isinstance(image, str):
                LOG.warning("held-out sample %s:%s skipped: its image %s", candidate.tar, candidate.key, image)
                selection.skipped.append(f"{candidate.tar}:{candidate.key}: {image}")
                continue
            selection.samples.append(HeldOutSample(candidate, image))
    selection.samples.sort(key=lambda s: s.candidate.order)
    return selection
