"""The pieces of the recipe that lets the tiny model learn on a CPU: a base model whose VAE
reconstructs scenes and whose text encoder tells words apart, Min-SNR loss weighting and
empty prompts for classifier-free guidance."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sdflow_image import scenes
from sdflow_image.builders import tiny_model
from sdflow_image.training import model

pytestmark = pytest.mark.image


def _scene_batch(count: int, size: int = tiny_model.IMAGE_SIZE) -> torch.Tensor:
    rnd = random.Random(3)
    every = scenes.all_scenes()
    pixels = np.stack(
        [np.asarray(scenes.draw(rnd.choice(every), size, size, rnd), dtype=np.float32) for _ in range(count)]
    )
    return torch.from_numpy(pixels / 127.5 - 1.0).permute(0, 3, 1, 2).contiguous()


def _reconstruction_error(vae: Any, images: torch.Tensor) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(vae.decode(vae.encode(images).latent_dist.mean).sample, images))


def test_tokenizer_scene_caption_one_token_per_word() -> None:
    tokenizer = tiny_model.build_tiny_components(0)["tokenizer"]

    for scene in scenes.all_scenes():
        ids = tokenizer(scene.caption).input_ids
        assert len(ids) == len(scene.caption.split()) + 2, scene.caption  # + start and end
        assert len(ids) <= tiny_model.TOKENIZER_MAX_LENGTH


def test_text_encoder_captions_differing_in_one_colour_give_distinct_features() -> None:
    parts = tiny_model.build_tiny_components(0)
    tokenizer, encoder = parts["tokenizer"], parts["text_encoder"]
    captions = ["a red circle on a blue background", "a green circle on a blue background"]
    ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, return_tensors="pt")
    with torch.no_grad():
        hidden = encoder(ids.input_ids)[0]

    # The foreground colour is the third token: its features differ far more than the
    # (identical) first two tokens' do, which must not differ at all under a causal mask.
    assert torch.allclose(hidden[0, :2], hidden[1, :2], atol=1e-5)
    assert float((hidden[0, 2] - hidden[1, 2]).norm()) > 0.5 * float(hidden[0, 2].norm())


@pytest.mark.longest
def test_fit_vae_steps_reconstruct_scenes_better_than_random() -> None:
    images = _scene_batch(32)
    random_vae = tiny_model.build_tiny_components(0)["vae"]
    before = _reconstruction_error(random_vae, images)

    fitted = tiny_model.build_tiny_components(0)["vae"]
    tiny_model.fit_vae(fitted, steps=60, seed=0)
    after = _reconstruction_error(fitted, images)

    assert after < 0.5 * before
    # scaling_factor makes the latents' spread about one, as the UNet's noise schedule assumes.
    with torch.no_grad():
        spread = float((fitted.encode(images).latent_dist.mean * fitted.config.scaling_factor).std())
    assert 0.7 < spread < 1.4


def test_build_tiny_pipeline_saves_inference_scheduler_that_training_reads(tmp_path: Path) -> None:
    from diffusers import DDPMScheduler, StableDiffusionPipeline

    folder = tiny_model.build_tiny_pipeline(tmp_path / "model")
    pipe = StableDiffusionPipeline.from_pretrained(folder, local_files_only=True, safety_checker=None)
    training_schedule = DDPMScheduler.from_pretrained(folder, subfolder="scheduler", local_files_only=True)

    assert type(pipe.scheduler).__name__ == "DPMSolverMultistepScheduler"
    assert training_schedule.config.num_train_timesteps == 1000
    assert training_schedule.config.beta_schedule == "scaled_linear"
    assert pipe.unet.config.sample_size * pipe.vae_scale_factor == tiny_model.IMAGE_SIZE


def _parts() -> model.Parts:
    components = tiny_model.build_tiny_components(0)
    return model.Parts(
        unet=components["unet"],
        vae=components["vae"],
        text_encoder=components["text_encoder"],
        tokenizer=components["tokenizer"],
        noise_scheduler=components["scheduler"],
    )


def _batch(parts: model.Parts, captions: list[str]) -> dict[str, Any]:
    tokenizer = parts.tokenizer
    ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, return_tensors="pt")
    return {"input_ids": ids.input_ids, "pixel_values": _scene_batch(len(captions))}


def test_encode_batch_proportion_empty_prompts_replaces_that_share_with_empty_prompt() -> None:
    parts = _parts()
    captions = [scene.caption for scene in scenes.all_scenes()[:64]]
    batch = _batch(parts, captions)
    with torch.no_grad():
        empty_ids = parts.tokenizer(
            [""], padding="max_length", max_length=parts.tokenizer.model_max_length, return_tensors="pt"
        ).input_ids
        empty = parts.text_encoder(empty_ids)[0][0]

    _, none_dropped = model.encode_batch(batch, parts, torch.device("cpu"), torch.Generator().manual_seed(0))
    _, some_dropped = model.encode_batch(batch, parts, torch.device("cpu"), torch.Generator().manual_seed(0), 0.5)

    def is_empty(hidden: torch.Tensor) -> list[bool]:
        return [bool(torch.allclose(row, empty, atol=1e-5)) for row in hidden]

    assert not any(is_empty(none_dropped))
    dropped = sum(is_empty(some_dropped))
    assert 16 <= dropped <= 48  # about half of 64
    kept = [i for i, gone in enumerate(is_empty(some_dropped)) if not gone]
    assert torch.allclose(some_dropped[kept], none_dropped[kept], atol=1e-5)


def test_compute_loss_snr_gamma_weights_noisy_timesteps_up() -> None:
    parts = _parts()
    latents = torch.randn(32, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(32, tiny_model.TOKENIZER_MAX_LENGTH, 32, generator=torch.Generator().manual_seed(2))

    def loss(**kwargs: Any) -> float:
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():
            return float(model.compute_loss(parts.unet, parts.noise_scheduler, latents, hidden, generator, **kwargs))

    plain, weighted = loss(), loss(snr_gamma=5.0)
    # Same noise and timesteps; Min-SNR only multiplies each sample's MSE by min(SNR, 5) / SNR <= 1.
    assert weighted < plain
    assert loss(snr_gamma=1e9) == pytest.approx(plain, rel=1e-5)
