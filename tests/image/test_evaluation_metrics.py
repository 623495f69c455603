"""The evaluation's metrics against hand-computed values on tiny cases: CLIP score (cosine of the
CLIP embeddings * 100, mean clamped at 0), KID (unbiased MMD² with the cubic polynomial kernel),
FID (Fréchet distance of fitted Gaussians, matrix square root by scipy); the CLIP folder's checks
and the held-out grid."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import linalg

from sdflow_image import scenes
from sdflow_image.evaluation import clip_model, grid, metrics
from sdflow_image.evaluation.errors import ClipModelError

pytestmark = pytest.mark.image


class Flatten(torch.nn.Module):
    """Features = the image's pixel values as floats: known features for a hand computation."""

    def __init__(self, dimensions: int) -> None:
        super().__init__()
        self.num_features = dimensions

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return images.reshape(images.shape[0], -1).double()


def as_images(features: np.ndarray) -> torch.Tensor:
    """(N, d) small non-negative integers → uint8 (N, d, 1, 1) "images" whose Flatten features they are."""
    return torch.from_numpy(features.astype(np.uint8)).reshape(features.shape[0], features.shape[1], 1, 1)


def hand_kid(x: np.ndarray, y: np.ndarray) -> float:
    """Unbiased MMD² (Bińkowski et al. 2018, eq. 4) with k(a, b) = (a·b / d + 1)³, loops spelled out."""
    m, d = x.shape

    def k(a: np.ndarray, b: np.ndarray) -> float:
        return float((a @ b / d + 1) ** 3)

    xx = sum(k(x[i], x[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    yy = sum(k(y[i], y[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    xy = sum(k(x[i], y[j]) for i in range(m) for j in range(m)) / (m * m)
    return xx + yy - 2 * xy


def hand_fid(x: np.ndarray, y: np.ndarray) -> float:
    """‖μx - μy‖² + Tr(Σx + Σy - 2 (Σx Σy)^½), unbiased covariances, scipy's sqrtm."""
    mu_x, mu_y = x.mean(0), y.mean(0)
    cov_x, cov_y = np.cov(x, rowvar=False), np.cov(y, rowvar=False)
    root = linalg.sqrtm(cov_x @ cov_y).real
    return float(((mu_x - mu_y) ** 2).sum() + np.trace(cov_x + cov_y - 2 * root))


@pytest.fixture(scope="module")
def clip(tiny_clip_dir: Path) -> clip_model.ClipModel:
    return clip_model.load_clip(clip_model.check_clip_dir(tiny_clip_dir), "cpu")


def _embedding(output: object) -> np.ndarray:
    tensor = output if isinstance(output, torch.Tensor) else output.pooler_output  # type: ignore[attr-defined]
    return tensor.double().numpy()


def hand_cosines(clip: clip_model.ClipModel, images: torch.Tensor, captions: list[str]) -> np.ndarray:
    """100 * cos(image i's embedding, caption j's embedding), straight from the model."""
    with torch.no_grad():
        pixels = clip.processor(images=list(images), return_tensors="pt")["pixel_values"]
        image = _embedding(clip.model.get_image_features(pixel_values=pixels))
        tokens = clip.processor(text=captions, return_tensors="pt", padding=True)
        text = _embedding(
            clip.model.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
        )
    norms = np.outer(np.linalg.norm(image, axis=1), np.linalg.norm(text, axis=1))
    return 100 * (image @ text.T) / norms


@pytest.fixture(scope="module")
def scene_set() -> tuple[torch.Tensor, list[str]]:
    rnd = random.Random(0)
    every = scenes.all_scenes()[:12]
    return metrics.to_uint8([scenes.draw(s, 32, 32, rnd) for s in every]), [s.caption for s in every]


def test_clip_score_matching_pairs_equals_mean_cosine_times_100(
    clip: clip_model.ClipModel, scene_set: tuple[torch.Tensor, list[str]]
) -> None:
    images, captions = scene_set
    cosines = hand_cosines(clip, images, captions)
    expected = max(0.0, float(np.diag(cosines).mean()))

    assert metrics.clip_score(clip, images, captions) == pytest.approx(expected, abs=1e-3)


def test_clip_score_negative_mean_cosine_clamps_to_zero(
    clip: clip_model.ClipModel, scene_set: tuple[torch.Tensor, list[str]]
) -> None:
    images, captions = scene_set
    cosines = hand_cosines(clip, images, captions)
    negative = [(i, j) for i in range(len(captions)) for j in range(len(captions)) if cosines[i, j] < 0]
    assert negative, "the tiny random CLIP gives some pairs a negative cosine"

    score = metrics.clip_score(clip, images[[i for i, _ in negative]], [captions[j] for _, j in negative])

    assert score == 0.0


def test_kid_subset_of_all_samples_equals_hand_unbiased_mmd() -> None:
    rng = np.random.default_rng(0)
    real, fake = rng.integers(0, 6, (7, 3)), rng.integers(2, 9, (7, 3))

    result = metrics.kid(Flatten(3), as_images(real), {"fake": as_images(fake)}, seed=0)

    mean, std = result["fake"]
    # subset_size == N: every subset is the whole set, so each of the 100 subsets gives the same value.
    assert mean == pytest.approx(hand_kid(real.astype(float), fake.astype(float)), rel=1e-9)
    assert std == pytest.approx(0.0, abs=1e-9)


def test_kid_same_distribution_near_zero_and_shifted_larger() -> None:
    rng = np.random.default_rng(1)
    real, same, shifted = rng.integers(0, 10, (40, 4)), rng.integers(0, 10, (40, 4)), rng.integers(5, 15, (40, 4))

    result = metrics.kid(Flatten(4), as_images(real), {"same": as_images(same), "shifted": as_images(shifted)}, 0)

    assert abs(result["same"][0]) < result["shifted"][0] / 10


def test_kid_subsets_smaller_than_n_same_seed_same_value(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(2)
    real, fake = as_images(rng.integers(0, 9, (30, 3))), as_images(rng.integers(0, 9, (30, 3)))
    monkeypatch.setattr(metrics, "KID_MAX_SUBSET", 10)  # subsets of 10 of the 30: drawn at random, from the seed

    first, second = (metrics.kid(Flatten(3), real, {"f": fake}, seed=5)["f"] for _ in range(2))
    other = metrics.kid(Flatten(3), real, {"f": fake}, seed=6)["f"]

    assert first == second
    assert first != other
    assert first[1] > 0  # the subsets differ


def test_fid_small_case_equals_hand_frechet_distance() -> None:
    rng = np.random.default_rng(3)
    real, fake = rng.integers(0, 20, (9, 2)), rng.integers(3, 30, (9, 2))

    result = metrics.fid(Flatten(2), as_images(real), {"fake": as_images(fake), "real": as_images(real)})

    assert result["fake"] == pytest.approx(hand_fid(real.astype(float), fake.astype(float)), rel=1e-4)
    assert result["real"] == pytest.approx(0.0, abs=1e-3)


def test_clip_image_features_uint8_batch_gives_projection_dim_each(clip: clip_model.ClipModel) -> None:
    features = metrics.ClipImageFeatures(clip)(torch.zeros(3, 3, 48, 48, dtype=torch.uint8))

    assert features.shape == (3, clip.projection_dim)
    assert metrics.ClipImageFeatures(clip).num_features == clip.projection_dim


class ModelOutputClip(torch.nn.Module):
    """transformers 5's shape: get_*_features return an output whose pooler_output is the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.config = type("Config", (), {})()

    def get_image_features(self, pixel_values: torch.Tensor) -> object:
        return type("Output", (), {"pooler_output": pixel_values.flatten(1) * self.scale})()

    def get_text_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> object:
        return type("Output", (), {"pooler_output": input_ids.float()})()


def test_tensor_features_model_output_unwrapped_to_embedding() -> None:
    wrapped = metrics.TensorFeatures(ModelOutputClip())

    image = wrapped.get_image_features(torch.ones(2, 3, 2, 2))
    text = wrapped.get_text_features(torch.tensor([[1, 2]]))

    assert isinstance(image, torch.Tensor)
    assert image.shape == (2, 12)
    assert text.tolist() == [[1.0, 2.0]]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (None, "holds no config.json"),
        ("{not json", "config.json is not readable JSON"),
        ({"model_type": "t5"}, "describes a 't5' model, not a CLIP model"),
        ({"model_type": "clip", "projection_dim": 0}, "projection_dim 0 is not a positive integer"),
    ],
)
def test_check_clip_dir_bad_folder_names_flag_and_fix(tmp_path: Path, config: object, message: str) -> None:
    if config is not None:
        (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))

    with pytest.raises(ClipModelError, match=message) as raised:
        clip_model.check_clip_dir(tmp_path)

    assert f"--clip_model_dir {tmp_path}" in str(raised.value)
    assert "evaluation.clip_model_uri" in str(raised.value)


def test_check_clip_dir_config_without_projection_dim_defaults_512(tmp_path: Path, tiny_clip_dir: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {}, "vision_config": {}}))

    assert clip_model.check_clip_dir(tmp_path).projection_dim == 512
    assert clip_model.check_clip_dir(tiny_clip_dir).projection_dim == 32


def test_load_clip_folder_without_weights_fails_naming_flag(tmp_path: Path, tiny_clip_dir: Path) -> None:
    (tmp_path / "config.json").write_text((tiny_clip_dir / "config.json").read_text())

    with pytest.raises(ClipModelError, match="the CLIP model does not load"):
        clip_model.load_clip(clip_model.check_clip_dir(tmp_path), "cpu")


def test_holdout_grid_more_rows_than_max_draws_sixteen_with_header_and_captions() -> None:
    red, green, blue = (scenes.draw(scenes.parse_prompt(f"a white circle on a {c} background"), 32, 32,
                                   random.Random(0)) for c in ("red", "green", "blue"))  # fmt: skip
    rows = grid.MAX_ROWS + 4

    picture = grid.holdout_grid([red] * rows, [green] * rows, [blue] * rows, ["a caption " * 30] * rows)

    assert picture.size == (3 * (grid.CELL + grid.GAP) + grid.CAPTION_WIDTH, grid.HEADER + 16 * (grid.CELL + grid.GAP))
    y = grid.HEADER + 2  # first row, near the top edge: background colour of each column's scene
    assert picture.getpixel((2, y)) == scenes.COLORS["red"]
    assert picture.getpixel((grid.CELL + grid.GAP + 2, y)) == scenes.COLORS["green"]
    assert picture.getpixel((2 * (grid.CELL + grid.GAP) + 2, y)) == scenes.COLORS["blue"]
    header = np.asarray(picture.crop((0, 0, picture.width, grid.HEADER)))
    caption = np.asarray(picture.crop((3 * (grid.CELL + grid.GAP), grid.HEADER, picture.width, grid.HEADER + 40)))
    assert (header < 128).any()  # the column names are written
    assert (caption < 128).any()  # and the caption beside the row


def test_holdout_grid_counts_differ_raises() -> None:
    image = scenes.draw(scenes.all_scenes()[0], 32, 32, random.Random(0))

    with pytest.raises(ValueError, match="one real, base and trained image per caption"):
        grid.holdout_grid([image], [image], [], ["caption"])
