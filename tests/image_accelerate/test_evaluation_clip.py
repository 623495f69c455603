"""The evaluation's held-out metrics on the second stack (transformers 5, whose get_image_features /
get_text_features return a model output, not the tensor torchmetrics 1.9.0 expects): a tiny CLIP
folder loads from disk, and CLIP score (checked against the cosine computed by hand), KID and FID
come out of evaluation.holdout_scores with holdout.png beside them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from evaluation_fixtures import scene_samples, write_holdout_tar
from PIL import Image

from sdflow_image.builders.tiny_clip import build_tiny_clip
from sdflow_image.evaluation import clip_model, heldout, holdout_scores, metrics, report

pytestmark = pytest.mark.image


def test_holdout_scores_transformers_5_clip_gives_hand_clip_score_kid_and_fid(tmp_path: Path) -> None:
    clip_dir = build_tiny_clip(tmp_path / "clip", train_steps=0)
    write_holdout_tar(tmp_path / "holdout" / "00000.tar", scene_samples(34))
    samples = heldout.select(tmp_path / "holdout", 32).samples
    real = holdout_scores.real_images(samples, 32)
    rng = np.random.default_rng(0)
    noise = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in samples]
    renders = {"base": noise, "trained": real}  # trained "draws" the held-out images themselves
    scores = report.Scores()
    config = clip_model.check_clip_dir(clip_dir)

    entry = holdout_scores.score(
        samples, renders, config, scores, resolution=32, seed=0, device="cpu", out_dir=tmp_path
    )

    assert entry == {"projection_dim": 32, "source": "--clip_model_dir"}
    assert scores.missing == []
    loaded = clip_model.load_clip(config, "cpu")
    captions = [s.caption for s in samples]
    with torch.no_grad():
        pixels = loaded.processor(images=list(metrics.to_uint8(real)), return_tensors="pt")["pixel_values"]
        image = loaded.model.get_image_features(pixel_values=pixels).pooler_output.double().numpy()
        tokens = loaded.processor(text=captions, return_tensors="pt", padding=True)
        text = loaded.model.get_text_features(**tokens).pooler_output.double().numpy()
    cosines = (image * text).sum(1) / (np.linalg.norm(image, axis=1) * np.linalg.norm(text, axis=1))
    assert scores.metrics["clip_score"]["trained"] == pytest.approx(max(0.0, 100 * cosines.mean()), abs=1e-3)
    assert scores.metrics["kid"]["trained"] < scores.metrics["kid"]["base"]
    assert scores.metrics["fid"]["trained"] == pytest.approx(0.0, abs=1e-2)  # the same images as the real ones
    assert scores.metrics["fid"]["base"] > 1.0
    assert (tmp_path / "holdout.png").is_file()
    json.dumps(scores.metrics)  # plain floats, ready for evaluation.json
