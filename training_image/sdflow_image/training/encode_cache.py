"""Encode each training image and caption once (`cache_latents`): the VAE's latent distribution
and the frozen text encoder's embeddings, kept for every later epoch.

Without it every step runs the VAE encoder over full-resolution pixels and the text encoder
over the captions again (bench/bench_cached_latents.py measures the difference on CPU and
counts it for SD 1.5 at 512²). The cache keeps the distribution's parameters (mean and
log-variance), not a sample: each step still draws its latent from it with the step's
generator, in the same order as `model.encode_batch`, so a cached run trains on the same
distribution as an uncached one, and a resumed run (whose cache starts empty and fills again)
draws what the uninterrupted one drew. Per process, in host memory, up to a byte budget; the
images must be the same at every epoch (center_crop and no random_flip: train.py refuses the
rest).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from sdflow_image.training.data_source import KEYS_KEY

log = logging.getLogger("sdflow.train")

EMPTY_PROMPT = ""  # the cache key of the empty prompt's embedding (proportion_empty_prompts)


class EncodeCache:
    """Latent distributions and caption embeddings by sample key, on the CPU."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = self.misses = 0
        self._latents: dict[str, Any] = {}
        self._hidden: dict[str, Any] = {}
        self._full_logged = False

    def __len__(self) -> int:
        return len(self._latents)

    def _keep(self, key: str, latents: Any, hidden: Any) -> None:
        size = latents.numel() * latents.element_size() + hidden.numel() * hidden.element_size()
        if self.bytes + size > self.max_bytes:
            if not self._full_logged:
                log.warning("latent cache full at %d samples (%.1f GB): the rest are encoded at every step",
                            len(self), self.bytes / 1e9)  # fmt: skip
                self._full_logged = True
            return
        self._latents[key], self._hidden[key] = latents.cpu(), hidden.cpu()
        self.bytes += size

    def _empty_prompt(self, parts: Any, device: Any) -> Any:
        import torch

        if EMPTY_PROMPT not in self._hidden:
            tokenizer = parts.tokenizer
            ids = tokenizer(
                "", padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
            ).input_ids.to(device)
            with torch.no_grad():
                self._hidden[EMPTY_PROMPT] = parts.text_encoder(ids, return_dict=False)[0][0].cpu()
        return self._hidden[EMPTY_PROMPT].to(device)

    def encode(
        self, batch: dict[str, Any], parts: Any, device: Any, generator: Any, proportion_empty_prompts: float
    ) -> tuple[Any, Any]:
        """What `model.encode_batch` returns, from the cache where it can."""
        import torch
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        keys: list[str] = json.loads(batch[KEYS_KEY])
        dropped = None
        if proportion_empty_prompts > 0:  # drawn first, as encode_batch draws it
            dropped = torch.rand(len(keys), generator=generator, device=device) < proportion_empty_prompts
        missing = [i for i, key in enumerate(keys) if key not in self._latents]
        self.misses += len(missing)
        self.hits += len(keys) - len(missing)
        fresh: dict[int, tuple[Any, Any]] = {}
        if missing:
            vae = parts.vae
            with torch.no_grad():
                pixels = batch["pixel_values"][missing].to(device, dtype=vae.dtype, non_blocking=True)
                moments = vae.encode(pixels).latent_dist.parameters
                hidden = parts.text_encoder(batch["input_ids"][missing].to(device), return_dict=False)[0]
            for row, i in enumerate(missing):
                fresh[i] = (moments[row], hidden[row])
                self._keep(keys[i], moments[row], hidden[row])
        moments_rows, hidden_rows = [], []
        for i, key in enumerate(keys):
            moments_i, hidden_i = fresh[i] if i in fresh else (self._latents[key], self._hidden[key])
            moments_rows.append(moments_i.to(device, non_blocking=True))
            hidden_rows.append(hidden_i.to(device, non_blocking=True))
        if dropped is not None and bool(dropped.any()):
            empty = self._empty_prompt(parts, device)
            hidden_rows = [empty if bool(dropped[i]) else h for i, h in enumerate(hidden_rows)]
        distribution = DiagonalGaussianDistribution(torch.stack(moments_rows))
        latents = distribution.sample(generator=generator) * parts.vae.config.scaling_factor
        return latents, torch.stack(hidden_rows)
