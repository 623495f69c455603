"""The held-out split's membership (stable across hosts and versions, uniform, monotone in the rate) and
the evaluation's choice of the N held-out samples it scores (whatever the file order)."""

from __future__ import annotations

import io
import random
import tarfile
from pathlib import Path

import pytest
from evaluation_fixtures import Sample, scene_samples, write_holdout_tar

from sdflow_image import holdout
from sdflow_image.evaluation import heldout
from sdflow_image.evaluation.errors import HoldoutError

pytestmark = pytest.mark.image

URLS = [f"https://images.example.com/{i:05d}.jpg" for i in range(20_000)]


def test_holdout_fraction_known_url_has_pinned_value() -> None:
    # sha256("https://example.com/cat.jpg") starts 777460dbe029a0d1: pinned, because shards already
    # split on S3 must stay split the same way by every later version of the download and evaluation jobs.
    assert holdout.holdout_fraction("https://example.com/cat.jpg") == 0x777460DBE029A0D1 / 2**64


def test_holdout_fraction_many_urls_uniform_in_unit_interval() -> None:
    fractions = [holdout.holdout_fraction(url) for url in URLS]

    assert all(0.0 <= f < 1.0 for f in fractions)
    for rate in (0.05, 0.2, 0.5):
        share = sum(f < rate for f in fractions) / len(fractions)
        assert abs(share - rate) < 0.015  # binomial std at n=20000 is at most 0.0036


def test_is_held_out_rate_bounds_none_or_all() -> None:
    assert not any(holdout.is_held_out(url, 0.0) for url in URLS[:1000])
    assert all(holdout.is_held_out(url, 1.0) for url in URLS[:1000])


def test_is_held_out_larger_rate_keeps_every_smaller_rates_sample() -> None:
    small = {url for url in URLS if holdout.is_held_out(url, 0.05)}
    large = {url for url in URLS if holdout.is_held_out(url, 0.1)}

    assert small < large  # raising the rate only adds samples: earlier evaluations stay comparable


# --- choosing the N held-out samples the evaluation scores (evaluation.heldout) -------------------


def _urls(selection: heldout.Selection) -> list[str]:
    return [sample.candidate.url for sample in selection.samples]


def test_select_n_smallest_fraction_whatever_file_order(tmp_path: Path) -> None:
    samples = scene_samples(12)
    write_holdout_tar(tmp_path / "a" / "holdout" / "00000.tar", samples[:6])
    write_holdout_tar(tmp_path / "a" / "holdout" / "00001.tar", samples[6:])
    shuffled = random.Random(3).sample(samples, len(samples))
    write_holdout_tar(tmp_path / "b" / "z.tar", shuffled[:4])
    write_holdout_tar(tmp_path / "b" / "deeper" / "a.tar", shuffled[4:])

    first, second = heldout.select(tmp_path / "a", 5), heldout.select(tmp_path / "b", 5)

    by_fraction = sorted((s.url for s in samples if s.url), key=holdout.holdout_fraction)
    assert _urls(first) == by_fraction[:5]
    assert _urls(second) == by_fraction[:5]
    assert [s.caption for s in first.samples] == [s.caption for s in second.samples]
    assert (first.candidates, first.tar_files) == (12, 2)


def test_select_more_than_held_out_returns_all_in_order(tmp_path: Path) -> None:
    samples = scene_samples(3)
    write_holdout_tar(tmp_path / "00000.tar", samples)

    selection = heldout.select(tmp_path, 256)

    assert sorted(_urls(selection)) == sorted(s.url for s in samples if s.url)
    fractions = [s.candidate.fraction for s in selection.samples]
    assert fractions == sorted(fractions)
    assert all(s.image.mode == "RGB" and s.image.size == (48, 48) for s in selection.samples)


def test_select_same_url_in_two_shards_counts_once(tmp_path: Path) -> None:
    samples = scene_samples(4)
    write_holdout_tar(tmp_path / "00000.tar", samples)
    write_holdout_tar(tmp_path / "00001.tar", samples[:2])  # the same urls, listed in another parquet file

    selection = heldout.select(tmp_path, 10)

    assert selection.candidates == 4
    assert len(set(_urls(selection))) == len(selection.samples) == 4


def test_select_sample_without_json_uses_key_ties_broken_by_tar(tmp_path: Path) -> None:
    image = scene_samples(1)[0].image
    keyed = [Sample("000000007", image, "first", None, "png"), Sample("000000007", image, "second", None, "webp")]
    write_holdout_tar(tmp_path / "b.tar", keyed[1:])
    write_holdout_tar(tmp_path / "a.tar", keyed[:1])

    selection = heldout.select(tmp_path, 2)

    assert [s.candidate.url for s in selection.samples] == ["000000007", "000000007"]
    assert [s.caption for s in selection.samples] == ["first", "second"]  # same fraction and key: a.tar first


def test_select_image_that_does_not_decode_skipped_next_taken(tmp_path: Path) -> None:
    samples = scene_samples(6)
    order = sorted(samples, key=lambda s: holdout.holdout_fraction(s.url or s.key))
    path = write_holdout_tar(tmp_path / "00000.tar", samples)
    broken = tmp_path / "broken.tar"
    with tarfile.open(path) as source, tarfile.open(broken, "w") as target:
        for member in source.getmembers():
            data = source.extractfile(member).read()  # type: ignore[union-attr]
            if member.name == f"{order[0].key}.jpg":
                data = b"not an image"
            member.size = len(data)
            target.addfile(member, io.BytesIO(data))
    path.unlink()

    selection = heldout.select(tmp_path, 3)

    assert _urls(selection) == [s.url for s in order[1:4]]
    assert len(selection.skipped) == 1
    assert selection.skipped[0].startswith(f"broken.tar:{order[0].key}: does not decode")


def test_select_truncated_tar_fails_naming_file(tmp_path: Path) -> None:
    path = write_holdout_tar(tmp_path / "00000.tar", scene_samples(3))
    path.write_bytes(path.read_bytes()[:700])

    with pytest.raises(HoldoutError, match=r"--holdout_dir .*00000.tar is not a readable tar"):
        heldout.select(tmp_path, 3)


def test_select_missing_folder_fails_naming_flag_and_fix(tmp_path: Path) -> None:
    with pytest.raises(HoldoutError, match=r"--holdout_dir .* does not exist or is not a folder; mount the run's"):
        heldout.select(tmp_path / "nowhere", 3)


def test_select_fit_large_n_keeps_grid_candidates_whole_and_shrinks_the_rest(tmp_path: Path) -> None:
    from sdflow_image.evaluation import holdout_scores

    samples = scene_samples(holdout_scores.FULL_SIZE_CANDIDATES + 8, size=64)
    write_holdout_tar(tmp_path / "00000.tar", samples)

    selection = heldout.select(tmp_path, len(samples), holdout_scores.real_fit(48, 16))

    sizes = [sample.image.size for sample in selection.samples]
    assert sizes[: holdout_scores.FULL_SIZE_CANDIDATES] == [(48, 48)] * holdout_scores.FULL_SIZE_CANDIDATES
    assert sizes[holdout_scores.FULL_SIZE_CANDIDATES :] == [(16, 16)] * 8


def test_render_keep_beyond_grid_rows_shrinks_to_metric_side() -> None:
    from PIL import Image

    from sdflow_image.evaluation import holdout_scores
    from sdflow_image.evaluation.grid import MAX_ROWS

    keep = holdout_scores.render_keep(24)
    image = Image.new("RGB", (96, 96), (200, 10, 10))

    assert keep(MAX_ROWS - 1, image).size == (96, 96)
    assert keep(MAX_ROWS, image).size == (24, 24)


def test_clip_input_side_both_processor_layouts_read_crop_size(tmp_path: Path, tiny_clip_dir: Path) -> None:
    import json

    from sdflow_image.evaluation import clip_model

    assert clip_model.check_clip_dir(tiny_clip_dir).input_side == 32  # the tiny CLIP's processor crop
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {"crop_size": {"height": 336}}}))
    assert clip_model.input_side(tmp_path) == 336  # transformers 5's layout (ViT-L/14-336)
    (tmp_path / "processor_config.json").unlink()
    assert clip_model.input_side(tmp_path) == clip_model.DEFAULT_INPUT_SIDE
