"""`cache_latents` for FLUX.2 [klein], Qwen-Image and SD 3.5 (training/embedding_cache.py): a batch
from the cache is what the family's `encode_batch` gives with the same draws, whether its samples
and captions are encoded there (a miss) or read back (a hit), dropped captions included; and a
`bin/train` run with the cache trains as the same run without it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import train_runs as runs
from train_runs import HP

from sdflow_image import families
from sdflow_image.training.data_source import KEYS_KEY
from sdflow_image.training.embedding_cache import EmbeddingCache

pytestmark = pytest.mark.image

# Two captions of different lengths (Qwen-Image pads to the longest) and one repeated.
CAPTIONS = ["a red square on a blue background", "a green circle", "a red square on a blue background"]
SHARE = 0.5  # proportion_empty_prompts


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _batch(family: Any, parts: Any, keys: list[str], captions: list[str], start: float = -1.0) -> dict[str, Any]:
    import torch

    tokenize = family.caption_ids(parts)
    rows = [tokenize(caption) for caption in captions]
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    pixels = torch.linspace(start, 1, len(captions) * 3 * 32 * 32).reshape(len(captions), 3, 32, 32)
    return {**batch, "pixel_values": pixels, KEYS_KEY: json.dumps(keys)}


def _same(got: Any, expected: Any, tol: float) -> None:
    import torch

    for name, a, b in [("latents", got.latents, expected.latents), ("hidden", got.hidden, expected.hidden)] + [
        (key, got.extra.get(key), value) for key, value in expected.extra.items()
    ]:
        assert a is not None, name
        assert a.shape == b.shape, name
        assert torch.allclose(a.float(), b.float(), atol=tol, rtol=tol), (name, (a.float() - b.float()).abs().max())
    assert set(got.extra) == set(expected.extra)


def _encode_both(
    family: Any, parts: Any, cache: EmbeddingCache, batch: dict[str, Any], seed: int, tol: float = 1e-6
) -> Any:
    import torch

    cpu = torch.device("cpu")
    expected = family.encode_batch(batch, parts, cpu, torch.Generator().manual_seed(seed), SHARE)
    got = cache.encode(batch, parts, cpu, torch.Generator().manual_seed(seed), SHARE)
    _same(got, expected, tol)
    return torch.rand(len(json.loads(batch[KEYS_KEY])), generator=torch.Generator().manual_seed(seed)) < SHARE


@pytest.mark.parametrize("family_name", ["flux2", "qwenimage", "sd35"])
def test_embedding_cache_batch_equals_encode_batch_on_miss_partial_hit_and_hit(
    family_name: str, bases: Callable[[str], Path]
) -> None:
    family = families.get(family_name)
    parts = family.load_parts(str(bases(family_name)))
    cache = EmbeddingCache(family, 10**9)
    first = _batch(family, parts, ["a", "b", "c"], CAPTIONS)

    dropped = [_encode_both(family, parts, cache, first, seed=3)]  # every sample a miss
    assert (len(cache), cache.misses, cache.hits) == (3, 3, 0)
    dropped.append(_encode_both(family, parts, cache, first, seed=4))  # every sample a hit
    assert (len(cache), cache.misses, cache.hits) == (3, 3, 3)
    # A new sample (d) beside cached ones, in another order: encoded with the rest read back. The new
    # one goes through the VAE alone, encode_batch's with the others: the tiny FLUX.2 and SD 3.5 VAEs'
    # fp32 convolutions round differently by batch size (measured: 2.7e-6 of 2.0 for one row of three
    # against that row alone), hence 1e-5 here.
    mixed = _batch(family, parts, ["c", "d", "a"], [CAPTIONS[2], "a blue triangle", CAPTIONS[0]], start=-0.5)
    mixed["pixel_values"][0], mixed["pixel_values"][2] = first["pixel_values"][2], first["pixel_values"][0]
    dropped.append(_encode_both(family, parts, cache, mixed, seed=5, tol=1e-5))
    assert (len(cache), cache.misses, cache.hits) == (4, 4, 5)
    # The seeds drop some captions and keep others, so both the empty caption and real ones are read back.
    assert any(bool(d.any()) for d in dropped)
    assert any(not bool(d.all()) for d in dropped)
    assert 0 < cache.bytes <= cache.max_bytes


def test_embedding_cache_over_budget_keeps_nothing_and_still_encodes_as_the_family(
    bases: Callable[[str], Path],
) -> None:
    family = families.get("flux2")
    parts = family.load_parts(str(bases("flux2")))
    cache = EmbeddingCache(family, 0)
    batch = _batch(family, parts, ["a", "b", "c"], CAPTIONS)
    for seed in (3, 4):
        _encode_both(family, parts, cache, batch, seed)
    assert (len(cache), cache.bytes, cache.misses, cache.hits) == (0, 0, 6, 0)


def test_embedding_cache_refuses_a_family_it_does_not_encode() -> None:
    with pytest.raises(ValueError, match="not sdxl"):
        EmbeddingCache(families.get("sdxl"), 10**9)


def test_train_flux2_lora_cache_latents_trains_as_uncached_and_reports_hits(
    tmp_path: Path, bases: Callable[[str], Path], dataset: Path
) -> None:
    """8 samples, batch 2, 6 steps: the first epoch encodes each sample, the next reads it back; the
    step losses are those of the same run encoding every step (same draws, dropped captions too)."""
    hp = {**HP, "training_method": "lora", "lora_rank": "4", "max_train_steps": "6", "center_crop": "true",
          "random_flip": "false"}  # fmt: skip
    found: dict[str, tuple[dict[int, float], dict[str, Any]]] = {}
    for cache in ("true", "false"):
        opt_ml = runs.job(tmp_path, f"flux2-cache-{cache}", {**hp, "cache_latents": cache}, bases("flux2"), dataset)
        code, out = runs.run(opt_ml, 1)
        assert code == 0, out[-4000:]
        found[cache] = runs.losses(out), runs.summary(opt_ml)
    (cached, summary), (uncached, plain) = found["true"], found["false"]
    assert plain["latent_cache"] is None
    assert summary["latent_cache"]["samples"] == 8
    assert (summary["latent_cache"]["misses"], summary["latent_cache"]["hits"]) == (8, 4)
    assert sorted(cached) == sorted(uncached) == list(range(1, 7))
    assert [cached[s] for s in sorted(cached)] == pytest.approx([uncached[s] for s in sorted(uncached)], rel=1e-5)
