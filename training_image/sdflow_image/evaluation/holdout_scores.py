"""The held-out metrics of one evaluation: CLIP score, KID and FID of the base's and the trained
model's renders of the held-out captions, against those captions and the held-out images; and the
held-out grid. Reasons go to `missing` for every metric that cannot be computed.

Real images are resized to the render resolution the way training saw them (shorter side, centre
crop: training.data.resize_center_crop) before any feature is taken, so both sets enter the CLIP
processor at the same size and differ only in what the models drew (see metrics.py)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from sdflow_image.evaluation import clip_model, report
from sdflow_image.evaluation.grid import CELL, HOLDOUT_GRID_FILE, MAX_ROWS, holdout_grid
from sdflow_image.evaluation.heldout import HeldOutSample

HELD_OUT_METRICS = ("clip_score", "kid", "fid")
KID_MIN_SAMPLES = 2  # the unbiased MMD² divides by m(m - 1)
# Only the grid's rows are kept at the render resolution; every other image (held-out or generated) is
# shrunk, as soon as it is decoded or drawn, to the square the CLIP processor feeds its vision tower
# (it would shrink it there anyway), so host memory grows with N x side², not N x resolution²: at
# N = 10,000 and ViT-L/14's 224 px, about 1.5 GB per image set instead of 31 GB at 1024 px. Twice the
# grid's rows of held-out candidates stay whole, so a few undecodable images still leave a full grid.
FULL_SIZE_CANDIDATES = 2 * MAX_ROWS


def lack_all(scores: report.Scores, *reasons: str) -> None:
    for name in HELD_OUT_METRICS:
        scores.lack(name, "; ".join(reasons))


def real_images(samples: Sequence[HeldOutSample], resolution: int) -> list[Image.Image]:
    from sdflow_image.training.data import resize_center_crop  # imports torch: only once rendering is done

    return [resize_center_crop(sample.image, resolution) for sample in samples]


def metric_side(clip: clip_model.ClipConfig | None, resolution: int) -> int:
    """The side images are kept at beyond the grid: the CLIP input square (the grid's cell without one)."""
    return min(resolution, clip.input_side if clip is not None else CELL)


def shrink(image: Image.Image, side: int) -> Image.Image:
    if image.width <= side and image.height <= side:
        return image
    return image.resize((side, side), Image.Resampling.BICUBIC)


def render_keep(side: int) -> Callable[[int, Image.Image], Image.Image]:
    """adherence.render's `keep`: the grid's rows whole, every other drawn image shrunk to `side`."""
    return lambda index, image: image if index < MAX_ROWS else shrink(image, side)


def real_fit(resolution: int, side: int) -> Callable[[int, Image.Image], Image.Image]:
    """heldout.select's `fit`: a held-out image as training saw it at the render resolution (shorter
    side, centre crop), shrunk to `side` beyond the first candidates (see FULL_SIZE_CANDIDATES)."""
    from sdflow_image.training.data import resize_center_crop

    def fit(rank: int, image: Image.Image) -> Image.Image:
        real = resize_center_crop(image, resolution)
        return real if rank < FULL_SIZE_CANDIDATES else shrink(real, side)

    return fit


def _print_metric(name: str, base: float, trained: float) -> None:
    # The metric lines SageMaker's metric definitions read, as adherence prints its own.
    print(f"eval:base_{name}={base:.6f}", flush=True)
    print(f"eval:{name}={trained:.6f}", flush=True)


def _add_kid(
    scores: report.Scores, features: Any, real: Any, generated: dict[str, Any], seed: int, device: str
) -> None:
    from sdflow_image.evaluation import metrics

    count = real.shape[0]
    if count < KID_MIN_SAMPLES:
        reason = f"{count} held-out sample: KID needs at least {KID_MIN_SAMPLES} (set evaluation.holdout_samples)"
        scores.lack("kid", reason)
        return
    kid = metrics.kid(features, real, generated, seed, device)
    scores.metrics["kid"] = {
        "base": kid["base"][0],
        "trained": kid["trained"][0],
        "samples": count,
        "subset_size": min(metrics.KID_MAX_SUBSET, count),
    }
    if count > metrics.KID_MAX_SUBSET:
        # With N <= KID_MAX_SUBSET every subset is the whole set and the std is 0: no error bar, not shown.
        scores.metrics["kid"] |= {"base_std": kid["base"][1], "trained_std": kid["trained"][1]}
    _print_metric("kid", kid["base"][0], kid["trained"][0])


def _add_fid(
    scores: report.Scores, features: Any, real: Any, generated: dict[str, Any], dimensions: int, device: str
) -> None:
    from sdflow_image.evaluation import metrics

    count = real.shape[0]
    if count < dimensions:
        scores.lack(
            "fid",
            f"{count} held-out samples, fewer than the CLIP model's {dimensions} feature dimensions "
            f"(projection_dim): the covariances would be singular and FID mostly its small-sample bias; "
            f"set evaluation.holdout_samples to at least {dimensions}",
        )
        return
    fid = metrics.fid(features, real, generated, device)
    scores.metrics["fid"] = {"base": fid["base"], "trained": fid["trained"], "samples": count}
    _print_metric("fid", fid["base"], fid["trained"])


def score(
    samples: Sequence[HeldOutSample],
    renders: dict[str, list[Image.Image]],
    clip: clip_model.ClipConfig | None,
    scores: report.Scores,
    *,
    resolution: int,
    seed: int,
    device: str,
    out_dir: Path,
    fitted: bool = False,
) -> dict[str, Any] | None:
    """Save holdout.png and add the held-out metrics (or why not) to `scores`; `renders` holds the
    "base" and "trained" images, one per sample. `fitted`: the samples' images went through `real_fit`
    already. Returns evaluation.json's clip_model entry."""
    captions = [sample.caption for sample in samples]
    real = [sample.image for sample in samples] if fitted else real_images(samples, resolution)
    holdout_grid(real, renders["base"], renders["trained"], captions).save(out_dir / HOLDOUT_GRID_FILE)
    if clip is None:
        lack_all(scores, report.NO_CLIP)
        return None
    from sdflow_image.evaluation import metrics  # torch and torchmetrics: after the checks

    loaded = clip_model.load_clip(clip, device)
    count = len(samples)
    # One size for every image: the grid's rows are still whole, the rest shrunk already.
    side = metric_side(clip, resolution)
    real_t = metrics.to_uint8([shrink(image, side) for image in real])
    del real
    generated = {name: metrics.to_uint8([shrink(image, side) for image in images]) for name, images in renders.items()}
    clip_scores = {name: metrics.clip_score(loaded, images, captions) for name, images in generated.items()}
    scores.metrics["clip_score"] = {"base": clip_scores["base"], "trained": clip_scores["trained"], "samples": count}
    _print_metric("clip_score", clip_scores["base"], clip_scores["trained"])
    features = metrics.ClipImageFeatures(loaded)
    _add_kid(scores, features, real_t, generated, seed, device)
    _add_fid(scores, features, real_t, generated, clip.projection_dim, device)
    del loaded, features
    gc.collect()
    return {"projection_dim": clip.projection_dim, "source": "--clip_model_dir"}
