"""The held-out split's membership: stable across hosts and versions, uniform, monotone in the rate."""

from __future__ import annotations

import pytest

from sdflow_image import holdout

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
