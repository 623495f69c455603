"""The generated sample data's two kinds: the demo's scenes, and photo-like landscapes with free-form
captions that stand in for a user's own photographs (the held-out evaluation's e2e run trains on them)."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from sdflow import samples
from sdflow_common.run_document import scene_prompt_problem


def test_make_images_photos_free_form_captions_outside_scene_grammar() -> None:
    images = samples.make_images(12, kind="photos", seed=3, min_size=48, max_size=80)

    assert all(scene_prompt_problem(image.caption) is not None for image in images)
    assert len({image.caption for image in images}) > 3
    for image in images:
        decoded = Image.open(io.BytesIO(image.data))
        assert decoded.size == (image.width, image.height)
        assert len(set(decoded.convert("RGB").getdata())) > 50  # textured, not flat colours like a scene


def test_make_images_scenes_captions_follow_scene_grammar() -> None:
    images = samples.make_images(12, seed=3)

    assert all(scene_prompt_problem(image.caption) is None for image in images)


def test_make_images_same_seed_same_photos() -> None:
    first, second = (samples.make_images(4, kind="photos", seed=9) for _ in range(2))

    assert [i.data for i in first] == [i.data for i in second]


def test_make_images_unknown_kind_refused_naming_kinds() -> None:
    with pytest.raises(samples.SampleDataError, match="kind must be one of \\['photos', 'scenes'\\]"):
        samples.make_images(1, kind="paintings")
