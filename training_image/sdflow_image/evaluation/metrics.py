"""CLIP score, KID and FID of generated images, base against trained, with torchmetrics (1.9.0,
pinned on both job stacks) on the features of the CLIP model the user names.

Definitions (torchmetrics' implementations, which follow the papers):
- CLIP score (Hessel et al. 2021, "CLIPScore"): 100 * cos(E_image, E_caption) averaged over the
  (generated image, held-out caption) pairs, then max(·, 0) (torchmetrics clamps the mean). 0-100,
  higher is better.
- KID (Bińkowski et al. 2018): the unbiased estimate of MMD² between real and generated features
  with the cubic polynomial kernel k(x, y) = (x·y / d + 1)³, averaged over `subsets` random subsets
  of `subset_size` per side; mean and standard deviation reported. Unbiased, so it is usable at the
  small N a held-out split gives, and can be slightly negative. Lower is better.
- FID (Heusel et al. 2017): ‖μ_r - μ_g‖² + Tr(Σ_r + Σ_g - 2(Σ_r Σ_g)^½) of Gaussians fitted to the
  features. Computed only when N ≥ the feature dimension: with fewer samples than dimensions the
  covariances are singular and FID is dominated by its bias (it falls as N grows, whatever the
  model). Lower is better.
Features are the CLIP model's projected image embeddings (`get_image_features`, the processor's
resize and normalisation) rather than Inception-v3's: the user's own model, no download, and a
feature space trained on captioned images (as the clean-fid / "CLIP-FID" work uses).

Both image sets must reach the features alike: the job renders at its resolution and resizes the
real held-out images to that same square (training's resize + centre crop) before they get here,
so the processor then resizes both from the same size with the same filter, and a difference in
scale or resampling blur is never scored as a difference between models.

transformers 5 returns a model output from `get_image_features` / `get_text_features` where 4.x
returns the tensor; torchmetrics 1.9.0 expects the tensor, so the model goes to it wrapped
(`TensorFeatures`), which works on both stacks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from torchmetrics.image.fid import FrechetInceptionDistance
from torchmetrics.image.kid import KernelInceptionDistance
from torchmetrics.multimodal.clip_score import CLIPScore

from sdflow_image.evaluation.clip_model import ClipModel

KID_MAX_SUBSET = 1000
KID_SUBSETS = 100
BATCH = 32  # images per CLIP forward pass


def _tensor(output: Any) -> torch.Tensor:
    """The projected embeddings, from a tensor (transformers 4) or a model output (transformers 5)."""
    if isinstance(output, torch.Tensor):
        return output
    return output.pooler_output


class TensorFeatures(torch.nn.Module):
    """A CLIPModel whose get_image_features / get_text_features return tensors on every transformers."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    @property
    def config(self) -> Any:  # torchmetrics reads config.text_config.max_position_embeddings
        return self.model.config

    def get_image_features(self, pixel_values: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return _tensor(self.model.get_image_features(pixel_values=pixel_values, **kwargs))

    def get_text_features(self, input_ids: torch.Tensor, attention_mask: Any = None, **kwargs: Any) -> torch.Tensor:
        return _tensor(self.model.get_text_features(input_ids=input_ids, attention_mask=attention_mask, **kwargs))


class ClipImageFeatures(torch.nn.Module):
    """uint8 NCHW images → the CLIP model's image embeddings (the processor resizes and normalises):
    the `feature=` module of torchmetrics' KID and FID."""

    def __init__(self, clip: ClipModel) -> None:
        super().__init__()
        self.model = TensorFeatures(clip.model)
        self.processor = clip.processor
        self.num_features = clip.projection_dim  # FID sizes its state from it (no dummy 299 px pass)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        pixels = self.processor(images=list(images.cpu()), return_tensors="pt")["pixel_values"]
        parameter = next(self.model.parameters())
        return self.model.get_image_features(pixels.to(parameter.device, parameter.dtype))


def to_uint8(images: Sequence[Image.Image]) -> torch.Tensor:
    """PIL images of one size → a uint8 NCHW tensor (what KID and FID take from a custom extractor)."""
    arrays = [np.asarray(image.convert("RGB"), dtype=np.uint8) for image in images]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def _batches(images: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.split(images, BATCH))


def _update(
    metric: KernelInceptionDistance | FrechetInceptionDistance, images: torch.Tensor, real: bool, device: str
) -> None:
    for chunk in _batches(images):
        metric.update(chunk.to(device), real=real)


def clip_score(clip: ClipModel, images: torch.Tensor, captions: Sequence[str]) -> float:
    """torchmetrics' CLIPScore of each image against its caption (same order), averaged."""
    # The callable form takes any model with CLIPModel's two feature methods (its documented contract).
    model: Any = TensorFeatures(clip.model)
    metric = CLIPScore(model_name_or_path=lambda: (model, clip.processor)).to(clip.device)
    with torch.no_grad():
        for start, chunk in zip(range(0, len(captions), BATCH), _batches(images), strict=True):
            # On the model's device: CLIPScore moves the model to the images' device.
            metric.update(chunk.to(clip.device), list(captions[start : start + BATCH]))
        return float(metric.compute())


def kid(
    features: torch.nn.Module, real: torch.Tensor, generated: dict[str, torch.Tensor], seed: int, device: str = "cpu"
) -> dict[str, tuple[float, float]]:
    """(mean, std) of KID between `real` and each generated set (uint8 NCHW, same count), subsets
    drawn from a generator seeded with `seed`, so a rerun gives the same numbers."""
    count = real.shape[0]
    metric = KernelInceptionDistance(
        feature=features, subsets=KID_SUBSETS, subset_size=min(KID_MAX_SUBSET, count), reset_real_features=False
    ).to(device)
    results: dict[str, tuple[float, float]] = {}
    with torch.no_grad():
        _update(metric, real, True, device)
        for name, images in generated.items():
            _update(metric, images, False, device)
            # torchmetrics draws its subsets with torch.randperm on the global generator.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                mean, std = metric.compute()
            results[name] = (float(mean), float(std))
            metric.reset()  # keeps the real features
    return results


def fid(
    features: torch.nn.Module, real: torch.Tensor, generated: dict[str, torch.Tensor], device: str = "cpu"
) -> dict[str, float]:
    """FID between `real` and each generated set (uint8 NCHW)."""
    metric = FrechetInceptionDistance(feature=features, reset_real_features=False).to(device)
    results: dict[str, float] = {}
    with torch.no_grad():
        _update(metric, real, True, device)
        for name, images in generated.items():
            _update(metric, images, False, device)
            results[name] = float(metric.compute())
            metric.reset()
    return results
