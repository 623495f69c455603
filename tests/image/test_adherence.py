"""The prompt-adherence score on images drawn to match their prompts, drawn not to, blurred,
and noise."""

from __future__ import annotations

import random

import numpy as np
import pytest
from PIL import Image, ImageFilter

from sdflow_image import scenes
from sdflow_image.evaluation import adherence

pytestmark = pytest.mark.image


def _drawn(scene_list: list[scenes.Scene], size: int = 32, seed: int = 0) -> list[Image.Image]:
    rnd = random.Random(seed)
    return [scenes.draw(scene, size, size, rnd) for scene in scene_list]


@pytest.mark.parametrize("size", [32, 64, 128])
def test_score_images_drawn_to_match_scores_one(size: int) -> None:
    every = scenes.all_scenes()

    report = adherence.score_images(_drawn(every, size), [s.caption for s in every])

    assert report.score == 1.0
    assert report.shape_accuracy == 1.0
    assert report.prompts == len(every)


def test_score_images_blurred_and_recompressed_still_read_right() -> None:
    every = scenes.all_scenes()
    images = []
    for image in _drawn(every, 64, seed=4):
        soft = image.filter(ImageFilter.GaussianBlur(1.5)).resize((32, 32), Image.Resampling.BILINEAR)
        images.append(soft)

    report = adherence.score_images(images, [s.caption for s in every])

    assert report.score == 1.0
    assert report.shape_accuracy >= 0.9


def test_score_images_swapped_colours_score_zero() -> None:
    every = scenes.all_scenes()
    swapped = [scenes.Scene(s.background, s.shape, s.foreground) for s in every]

    report = adherence.score_images(_drawn(swapped), [s.caption for s in every])

    assert report.score == 0.0
    assert report.shape_accuracy == 1.0


def test_score_images_wrong_shape_keeps_colours_and_misses_shape() -> None:
    every = scenes.all_scenes()
    other = {"square": "triangle", "circle": "square", "triangle": "circle"}
    reshaped = [scenes.Scene(s.foreground, other[s.shape], s.background) for s in every]

    report = adherence.score_images(_drawn(reshaped), [s.caption for s in every])

    assert report.score == 1.0
    assert report.shape_accuracy == 0.0


def test_score_images_noise_scores_near_chance() -> None:
    prompts = adherence.default_prompts()
    rng = np.random.default_rng(0)
    noise = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in prompts]

    report = adherence.score_images(noise, prompts)

    assert report.score <= 0.3  # chance is 1/8 per colour


def test_score_images_prompt_outside_grammar_names_it() -> None:
    with pytest.raises(scenes.PromptGrammarError, match="a photo of a cat"):
        adherence.score_images(_drawn(scenes.all_scenes()[:1]), ["a photo of a cat"])


def test_score_images_counts_differ_raises() -> None:
    with pytest.raises(ValueError, match="one image per prompt"):
        adherence.score_images(_drawn(scenes.all_scenes()[:2]), [scenes.all_scenes()[0].caption])


def test_default_prompts_are_held_out_of_training_scenes() -> None:
    training = {s.caption for s in scenes.training_scenes()}

    assert len(adherence.default_prompts()) == scenes.HELDOUT_COUNT
    assert not training & set(adherence.default_prompts())


def test_make_grid_places_each_prompt_pair_side_by_side() -> None:
    red = Image.new("RGB", (32, 32), (255, 0, 0))
    blue = Image.new("RGB", (32, 32), (0, 0, 255))

    grid = adherence.make_grid([[red] * 10, [blue] * 10], cell=16, columns=4)

    assert grid.size == (4 * (2 * 16 + 4), 3 * (16 + 4))
    assert grid.getpixel((2, 2)) == (255, 0, 0)
    assert grid.getpixel((16 + 2, 2)) == (0, 0, 255)
