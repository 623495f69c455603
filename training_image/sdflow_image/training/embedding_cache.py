"""`cache_latents` for the families whose text encoders `EncodeCache` (SD's one CLIP) does not
cover: FLUX.2 [klein], Qwen-Image and SD 3.5, on the accelerate backend. Each image's VAE encoding
is kept by sample key, each caption's embeddings by its token rows, and a batch is put together
from them as `family.encode_batch` would encode it.

The draws are `encode_batch`'s, in its order: the caption dropout first (so the dropped rows are
the empty caption's token rows, which are cached like any other caption), then the latent. Where
the family samples the posterior (Qwen-Image, SD 3.x) the cache keeps the distribution's
parameters, not a sample, and draws each step's latent from them with the step's generator, so a
cached run trains on the same distribution as an uncached one and a resumed run (whose cache
starts empty) draws what the uninterrupted one drew; FLUX.2 encodes the posterior's mode, kept
as it is. Qwen-Image's embeddings are kept per caption without padding and padded again to the
batch's longest, with the mask of real tokens, as its `encode_prompts` pads them. Per process, in
host memory, up to a byte budget (`cache_latents_max_gb`), images and captions together.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from sdflow_image.families import flow, flux2, qwenimage
from sdflow_image.families.base import IDS_KEYS, Encoded, Family, Parts
from sdflow_image.training.data_source import KEYS_KEY

log = logging.getLogger("sdflow.train")

FAMILIES = ("flux2", "qwenimage", "sd35")  # the families this cache encodes (train.CACHE_FAMILIES less sd)


def _posterior(parameters: Any) -> Any:
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    return DiagonalGaussianDistribution(parameters)


class EmbeddingCache:
    """VAE encodings by sample key and prompt embeddings by token rows, on the CPU."""

    def __init__(self, family: Family, max_bytes: int) -> None:
        if family.name not in FAMILIES:
            raise ValueError(f"EmbeddingCache encodes {', '.join(FAMILIES)}, not {family.name}")
        self.family, self.max_bytes = family, max_bytes
        self.bytes = 0
        self.hits = self.misses = 0
        self._images: dict[str, Any] = {}
        self._prompts: dict[bytes, tuple[Any, ...]] = {}
        self._empty: dict[str, Any] | None = None
        self._full_logged = False

    def __len__(self) -> int:
        return len(self._images)

    def _keep(self, store: dict[Any, Any], key: Any, value: tuple[Any, ...]) -> None:
        size = sum(t.numel() * t.element_size() for t in value)
        if self.bytes + size > self.max_bytes:
            if not self._full_logged:
                log.warning("latent cache full at %d samples (%.1f GB): the rest are encoded at every step",
                            len(self), self.bytes / 1e9)  # fmt: skip
                self._full_logged = True
            return
        store[key] = tuple(t.detach().cpu().clone() for t in value)  # a row, not a view of its batch
        self.bytes += size

    # --- what differs by family ------------------------------------------------------------

    def _drop(self, batch: dict[str, Any], parts: Parts, device: Any, generator: Any, share: float) -> dict[str, Any]:
        family = self.family
        if family.name in ("flux2", "qwenimage"):
            if self._empty is None:
                self._empty = family.caption_ids(parts)("")
            return flow.drop_captions(batch, self._empty, device, generator, share)
        ids = family.drop_prompts(batch, parts, device, generator, share)
        return dict(zip(IDS_KEYS, ids, strict=False))

    def _image(self, pixels: Any, parts: Parts) -> Any:
        """Pixels → what is kept per image: FLUX.2's latents, else the posterior's parameters."""
        import torch

        family: Any = self.family
        if family.name == "flux2":
            return family.encode_images(pixels, parts, None)
        with torch.no_grad():
            frames = pixels.unsqueeze(2) if family.name == "qwenimage" else pixels
            return parts.vae.encode(frames).latent_dist.parameters

    def _latents(self, kept: Any, parts: Parts, generator: Any) -> Any:
        family: Any = self.family
        if family.name == "flux2":
            return kept
        sample = _posterior(kept).sample(generator=generator)
        if family.name == "qwenimage":
            return qwenimage.normalise(sample, parts.vae)
        return family.scale_latents(sample, parts.vae)

    def _prompts_of(self, rows: dict[str, Any], parts: Parts) -> list[tuple[Any, ...]]:
        """Token rows → each row's embeddings (Qwen-Image's without padding)."""
        family: Any = self.family
        if family.name == "flux2":
            return [(h,) for h in family.encode_prompts(rows, parts)[0]]
        if family.name == "qwenimage":
            return [(h,) for h in qwenimage.prompt_rows(family.last_hidden(rows, parts), rows["attention_mask"])]
        hidden, pooled = family.encode_prompts(list(rows.values()), parts)
        return list(zip(hidden, pooled, strict=True))

    def _assemble(self, items: list[tuple[Any, ...]]) -> tuple[Any, dict[str, Any]]:
        import torch

        if self.family.name == "flux2":
            hidden = torch.stack([h for (h,) in items])
            return hidden, flux2.text_ids(hidden)
        if self.family.name == "qwenimage":
            hidden, mask = qwenimage.pad_rows([h for (h,) in items])
            return hidden, {"mask": mask}
        return torch.stack([h for h, _ in items]), {"pooled": torch.stack([p for _, p in items])}

    # --- the batch -----------------------------------------------------------------------------

    def encode(self, batch: dict[str, Any], parts: Parts, device: Any, generator: Any, share: float) -> Encoded:
        """What `family.encode_batch` returns, from the cache where it can."""
        import torch

        keys: list[str] = json.loads(batch[KEYS_KEY])
        rows = self._drop(batch, parts, device, generator, share)  # drawn first, as encode_batch draws it
        missing = [i for i, key in enumerate(keys) if key not in self._images]
        self.misses += len(missing)
        self.hits += len(keys) - len(missing)
        fresh: dict[int, Any] = {}
        if missing:
            pixels = batch["pixel_values"][missing].to(device, dtype=parts.vae.dtype, non_blocking=True)
            for i, kept_i in zip(missing, self._image(pixels, parts), strict=True):
                fresh[i] = kept_i
                self._keep(self._images, keys[i], (kept_i,))
        kept = [fresh[i] if i in fresh else self._images[key][0].to(device) for i, key in enumerate(keys)]
        latents = self._latents(torch.stack(kept), parts, generator)

        on_cpu = [r.cpu().numpy() for r in rows.values()]  # one copy off the device per step
        tokens = [b"".join(r[i].tobytes() for r in on_cpu) for i in range(len(keys))]
        new = {}
        for i, token in enumerate(tokens):  # each distinct caption not cached yet, once
            if token not in self._prompts and token not in new:
                new[token] = i
        encoded: dict[bytes, tuple[Any, ...]] = {}
        if new:
            picked = list(new.values())
            for token, item in zip(new, self._prompts_of({k: r[picked] for k, r in rows.items()}, parts), strict=True):
                encoded[token] = item
                self._keep(self._prompts, token, item)
        items = [encoded[t] if t in encoded else tuple(x.to(device) for x in self._prompts[t]) for t in tokens]
        hidden, extra = self._assemble(items)
        return Encoded(latents, hidden, extra)
