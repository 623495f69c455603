"""The held-out metrics of one evaluation: CLIP score, KID and FID of the base's and the trained
model's renders of the held-out captions, against those captions and the held-out images; and the
held-out grid. Reasons go to `missing` for every metric that cannot be computed.

Real images are resized to the render resolution the way training saw them (shorter side, centre
crop: training.data.resize_center_crop) before any feature is taken, so both sets enter the CLIP
processor at the same size and differ only in what the models drew (see metrics.py)."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from sdflow_image.evaluation import clip_model, report
from sdflow_image.evaluation.grid import HOLDOUT_GRID_FILE, holdout_grid
from sdflow_image.evaluation.heldout import HeldOutSample

HELD_OUT_METRICS = ("clip_score", "kid", "fid")
KID_MIN_SAMPLES = 2  # the unbiased MMD² divides by m(m - 1)


def lack_all(scores: report.Scores, *reasons: str) -> None:
    for name in HELD_OUT_METRICS:
        scores.lack(name, "; ".join(reasons))


def real_images(samples: Sequence[HeldOutSample], resolution: int) -> list[Image.Image]:
    from sdflow_image.training.data import resize_center_crop  # imports torch: only once rendering is done

    return [resize_center_crop(sample.image, resolution) for sample in samples]


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
        "base_std": kid["base"][1],
        "trained_std": kid["trained"][1],
        "samples": count,
        "subset_size": min(metrics.KID_MAX_SUBSET, count),
    }
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
) -> dict[str, Any] | None:
    """Save holdout.png and add the held-out metrics (or why not) to `scores`; `renders` holds the
    "base" and "trained" images, one per sample. Returns evaluation.json's clip_model entry."""
    captions = [sample.caption for sample in samples]
    real = real_images(samples, resolution)
    holdout_grid(real, renders["base"], renders["trained"], captions).save(out_dir / HOLDOUT_GRID_FILE)
    if clip is None:
        lack_all(scores, report.NO_CLIP)
        return None
    from sdflow_image.evaluation import metrics  # torch and torchmetrics: after the checks

    loaded = clip_model.load_clip(clip, device)
    count = len(samples)
    real_t = metrics.to_uint8(real)
    generated = {name: metrics.to_uint8(images) for name, images in renders.items()}
    clip_scores = {name: metrics.clip_score(loaded, images, captions) for name, images in generated.items()}
    scores.metrics["clip_score"] = {"base": clip_scores["base"], "trained": clip_scores["trained"], "samples": count}
    _print_metric("clip_score", clip_scores["base"], clip_scores["trained"])
    features = metrics.ClipImageFeatures(loaded)
    _add_kid(scores, features, real_t, generated, seed, device)
    _add_fid(scores, features, real_t, generated, clip.projection_dim, device)
    del loaded, features
    gc.collect()
    return {"projection_dim": clip.projection_dim, "source": "--clip_model_dir"}
