"""Stable Diffusion 1.x/2.x: one CLIP text encoder, a UNet on the epsilon or v-prediction loss
(diffusers 0.29's examples/text_to_image/train_text_to_image.py; the code is training.model's,
which this family has always used)."""

from __future__ import annotations

from typing import Any

from sdflow_image.families.base import LOADER_DTYPES, Encoded, Family, PartDtypes, Parts


class StableDiffusion(Family):
    name = "sd"
    pipeline_class_name = "StableDiffusionPipeline"
    # No safety checker, as the server and the adherence comparison load models: a base that has
    # one (SD 1.5's model_index lists it) would black out one side's images only.
    pipeline_kwargs = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}

    def load_parts(self, base: str, left_out: tuple[str, ...] = (), dtypes: PartDtypes = LOADER_DTYPES) -> Parts:
        from sdflow_image.training import model

        return model.load_parts(base, dtypes)

    def encode_batch(
        self, batch: dict[str, Any], parts: Parts, device: Any, generator: Any, proportion_empty_prompts: float
    ) -> Encoded:
        from sdflow_image.training import model

        latents, hidden = model.encode_batch(batch, parts, device, generator, proportion_empty_prompts)
        return Encoded(latents, hidden)

    def compute_loss(
        self,
        model: Any,
        parts: Parts,
        encoded: Encoded,
        generator: Any,
        *,
        noise_offset: float = 0.0,
        autocast: Any = None,
        snr_gamma: float = 0.0,
    ) -> Any:
        return unet_loss(model, parts, encoded, generator, noise_offset, autocast, snr_gamma)


def unet_loss(
    model: Any, parts: Parts, encoded: Encoded, generator: Any, noise_offset: float, autocast: Any, snr_gamma: float
) -> Any:
    """The UNet families' loss (training.model.compute_loss); SDXL's pooled embeddings and time ids
    ride in `encoded.extra` as its `added_cond_kwargs` (empty for SD: none)."""
    from sdflow_image.training import model as sd_model

    return sd_model.compute_loss(
        model, parts.noise_scheduler, encoded.latents, encoded.hidden, generator, noise_offset, autocast,
        snr_gamma=snr_gamma, added_cond_kwargs=encoded.extra or None,
    )  # fmt: skip


FAMILY = StableDiffusion()
