"""The second stack's model families (SD 3.5, FLUX.2 [klein], Qwen-Image) on CPU with tiny pipelines
built in code: detected from the saved pipeline, trained a few steps through the family interface,
encoded as their pipelines encode a prompt, a LoRA adapter saved in the format each pipeline loads,
and served (the base, and the base with the adapter) through the serving code."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sdflow_image import families
from sdflow_image.builders import tiny
from sdflow_image.evaluation import adherence
from sdflow_image.families import flow
from sdflow_image.serving import serve_model
from sdflow_image.training import lora

pytestmark = pytest.mark.image

NEW = list(families.NEW_STACK_FAMILIES)
PROMPTS = ["a red square on a blue background", "a green circle"]
# Qwen-Image's last block computes a text stream that nothing reads (the transformer's output is the
# image stream's): those weights get no gradient, which DDP must be told (find_unused_parameters).
UNUSED = {
    "qwenimage": {
        f"transformer_blocks.1.{name}.{kind}"
        for name in ("attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")
        for kind in ("weight", "bias")
    }
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """One torch thread per test process: `-n 2` on two cores runs two (measured: the tiny Qwen3
    encoder's forward took 0.27 s on one thread, 0.7 to 2.5 s on two beside another process)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """family → its tiny pipeline's folder (built once per session)."""
    built: dict[str, Path] = {}

    def base(family: str) -> Path:
        if family not in built:
            built[family] = tiny.build_tiny(family, tmp_path_factory.mktemp(f"tiny-{family}") / "model")
        return built[family]

    return base


def _batch(family: families.Family, parts: Any, captions: list[str]) -> dict[str, Any]:
    import torch

    tokenize = family.caption_ids(parts)
    rows = [tokenize(caption) for caption in captions]
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    pixels = torch.linspace(-1, 1, len(captions) * 3 * 32 * 32).reshape(len(captions), 3, 32, 32)
    return {**batch, "pixel_values": pixels}


def _loss(family: families.Family, parts: Any, model: Any, batch: dict[str, Any], seed: int = 0) -> Any:
    """The loss of `batch` with every draw (caption dropout, posterior, noise, timestep) from `seed`."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    encoded = family.encode_batch(batch, parts, torch.device("cpu"), generator, 0.0)
    return family.compute_loss(model, parts, encoded, generator)


# --- which family -------------------------------------------------------------------------------


@pytest.mark.parametrize(("qk_norm", "family"), [("rms_norm", "sd35"), (None, "sd3")])
def test_detect_family_sd3_pipeline_reads_transformer_qk_norm_for_sd35(
    qk_norm: str | None, family: str, tmp_path: Path
) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"num_layers": 24, "qk_norm": qk_norm}))
    assert families.detect_family(tmp_path) == family


@pytest.mark.parametrize("family", NEW)
def test_detect_family_tiny_pipeline_saved_reads_its_family(family: str, tiny_base: Callable[[str], Path]) -> None:
    assert families.detect_family(tiny_base(family)) == family


# --- training through the family interface ----------------------------------------------------------


@pytest.mark.parametrize("family", NEW)
def test_family_tiny_model_trained_few_steps_loss_falls(family: str, tiny_base: Callable[[str], Path]) -> None:
    import torch

    fam = families.get(family)
    parts = fam.load_parts(str(tiny_base(family)))
    for module in fam.frozen_modules(parts):
        module.requires_grad_(False)
    batch = _batch(fam, parts, PROMPTS)
    optimizer = torch.optim.AdamW(parts.denoiser.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):  # the same draws each step: only the weights change the loss
        loss = _loss(fam, parts, parts.denoiser, batch)
        loss.backward()
        unused = {n for n, p in parts.denoiser.named_parameters() if p.requires_grad and p.grad is None}
        assert unused == UNUSED.get(family, set()), sorted(unused)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("family", NEW)
def test_family_noise_offset_raises_naming_flow_matching(family: str, tiny_base: Callable[[str], Path]) -> None:
    fam = families.get(family)
    with pytest.raises(ValueError, match=r"(flow|rectified flow)"):
        fam.compute_loss(None, None, None, None, noise_offset=0.1)  # type: ignore[arg-type]


@pytest.mark.parametrize("family", ["flux2", "qwenimage"])
def test_encode_batch_prompt_embeddings_equal_the_pipelines_own(family: str, tiny_base: Callable[[str], Path]) -> None:
    """What the transformer trains on is what the pipeline conditions it on when it serves."""
    import torch

    fam = families.get(family)
    base = tiny_base(family)
    parts = fam.load_parts(str(base))
    pipe = fam.pipeline_class().from_pretrained(str(base), local_files_only=True)
    for caption in PROMPTS:
        encoded = fam.encode_batch(
            _batch(fam, parts, [caption]), parts, torch.device("cpu"), torch.Generator().manual_seed(0), 0.0
        )
        with torch.no_grad():
            expected = pipe.encode_prompt(caption, device=torch.device("cpu"))
        torch.testing.assert_close(encoded.hidden, expected[0])
        if family == "flux2":
            torch.testing.assert_close(encoded.extra["text_ids"], expected[1])
        else:  # one caption: every row is real, which the pipeline says with no mask at all
            assert expected[1] is None
            assert bool(encoded.extra["mask"].all())


@pytest.mark.parametrize("family", ["flux2", "qwenimage"])
def test_encode_batch_every_caption_dropped_encodes_the_empty_prompt(
    family: str, tiny_base: Callable[[str], Path]
) -> None:
    import torch

    fam = families.get(family)
    parts = fam.load_parts(str(tiny_base(family)))
    cpu = torch.device("cpu")
    dropped = fam.encode_batch(_batch(fam, parts, PROMPTS), parts, cpu, torch.Generator().manual_seed(0), 1.0)
    empty = fam.encode_batch(_batch(fam, parts, ["", ""]), parts, cpu, torch.Generator().manual_seed(0), 0.0)
    torch.testing.assert_close(dropped.hidden, empty.hidden)


def test_sample_sigmas_same_generator_same_draws_on_the_schedule() -> None:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    for scheme in (flow.UNIFORM, flow.LOGIT_NORMAL):
        a = flow.sample_sigmas(scheduler, 64, "cpu", torch.Generator().manual_seed(1), scheme)
        b = flow.sample_sigmas(scheduler, 64, "cpu", torch.Generator().manual_seed(1), scheme)
        assert torch.equal(a[0], b[0])
        torch.testing.assert_close(a[1] * 1000, a[0].float())  # each sigma is its timestep's
    with pytest.raises(ValueError, match="weighting scheme"):
        flow.sample_sigmas(scheduler, 1, "cpu", None, "cosmap")


# --- LoRA: saved in each pipeline's format, loaded into it, computing as trained --------------------


@pytest.fixture(scope="module", params=NEW)
def adapter(request: pytest.FixtureRequest, tiny_base: Callable[[str], Path], tmp_path_factory: Any) -> dict[str, Any]:
    """A family's tiny model with a LoRA adapter (alpha != rank, B non-zero) saved as the trainer
    saves it (training.lora), beside a served model folder of the training job's layout."""
    import torch

    family = request.param
    fam = families.get(family)
    parts = fam.load_parts(str(tiny_base(family)))
    args = argparse.Namespace(
        lora_rank=4, lora_alpha=12.0, lora_dropout=0.0, lora_target_modules=[], train_text_encoder_lora=False
    )
    lora.add_adapters(parts, args, fam)
    with torch.no_grad():
        for name, param in parts.denoiser.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    parts.denoiser.eval()
    out = tmp_path_factory.mktemp(f"lora-{family}")
    lora.save_adapter(fam, lora.adapter_layers(fam, parts, args), out)
    info = {"format": 1, "family": family, "method": "lora", "resolution": 32, "dtype": "float32"}
    (out / serve_model.MODEL_INFO_FILE).write_text(json.dumps(info))
    return {"family": family, "parts": parts, "out": out, "base": tiny_base(family)}


def test_lora_adapter_saved_then_loaded_into_pipeline_computes_as_trained_also_fused(adapter: dict[str, Any]) -> None:
    import torch

    fam, parts = families.get(adapter["family"]), adapter["parts"]
    batch = _batch(fam, parts, PROMPTS)
    with torch.no_grad():
        trained = _loss(fam, parts, parts.denoiser, batch)
        pipe = fam.pipeline_class().from_pretrained(str(adapter["base"]), local_files_only=True)
        untouched = _loss(fam, parts, pipe.transformer, batch)
        lora.load_adapter(pipe, adapter["out"])
        loaded = _loss(fam, parts, pipe.transformer, batch)
        lora.fuse(pipe)
        fused = _loss(fam, parts, pipe.transformer, batch)
    assert abs(float(untouched) - float(trained)) > 1e-4, "the adapter changes nothing: test is void"
    torch.testing.assert_close(loaded, trained, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fused, trained, atol=1e-5, rtol=1e-4)


# --- serving: the base (a full model's layout) and the base with the adapter ---------------------------


def test_serve_family_base_and_adapter_load_and_draw_images(adapter: dict[str, Any]) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = serve_model.load_pipeline(serve_model.ServeSettings(model_dir=adapter["base"], device="cpu"))
    settings = serve_model.ServeSettings(model_dir=adapter["out"], base_model_dir=adapter["base"], device="cpu")
    tuned = serve_model.load_pipeline(settings)
    assert any(isinstance(m, BaseTunerLayer) for m in tuned.transformer.modules())
    assert not any(isinstance(m, BaseTunerLayer) for m in base.transformer.modules())
    # The evaluation's renders (a list of prompts, guided) and the server's calibration.
    images = adherence.render(tuned, PROMPTS, resolution=32, num_inference_steps=2, guidance_scale=4.0)
    assert [image.size for image in images] == [(32, 32)] * 2
    timing = serve_model.calibrate(base, 32)
    assert timing.step_s > 0
    # No sdflow_model.json: the size the pipeline draws by default (FLUX.2's and Qwen-Image's
    # transformers have no sample_size).
    expected = getattr(base.transformer.config, "sample_size", None) or base.default_sample_size
    assert serve_model.default_size(None, base) == expected * base.vae_scale_factor


@pytest.mark.parametrize("family", ["flux2", "qwenimage"])
def test_call_kwargs_guided_request_with_negative_prompt_guides_against_it(
    family: str, tiny_base: Callable[[str], Path]
) -> None:
    import torch

    fam = families.get(family)
    pipe = fam.pipeline_class().from_pretrained(str(tiny_base(family)), local_files_only=True)
    kwargs = families.call_kwargs(pipe, PROMPTS, "blurry", 4.0)
    assert "guidance_scale" not in kwargs or family == "flux2"
    out = pipe(**kwargs, height=32, width=32, num_inference_steps=1, output_type="pt",
               generator=torch.Generator().manual_seed(0))  # fmt: skip
    unguided = pipe(**families.call_kwargs(pipe, PROMPTS, None, 1.0), height=32, width=32, num_inference_steps=1,
                    output_type="pt", generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert out.images.shape == (2, 3, 32, 32)
    assert not torch.allclose(out.images, unguided.images)


def test_evaluate_family_adapter_scores_trained_against_base(adapter: dict[str, Any], tmp_path: Path) -> None:
    from sdflow_image.evaluation import evaluate

    args = evaluate.parse_args(
        [
            "--model_dir", str(adapter["out"]),
            "--base_model_dir", str(adapter["base"]),
            "--output_dir", str(tmp_path / "evaluation"),
            "--work_dir", str(tmp_path / "work"),
            "--prompts", json.dumps(PROMPTS[:1]),
            "--num_inference_steps", "2",
        ]
    )  # fmt: skip
    document = evaluate.evaluate(args)
    assert 0 <= document["prompt_adherence"] <= 1
    assert 0 <= document["base_prompt_adherence"] <= 1
    assert (tmp_path / "evaluation" / "adherence.png").is_file()
