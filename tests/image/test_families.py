"""Model families (SD, SDXL, SD3) x training methods (full, LoRA) on CPU with tiny models built
in code: train, stop and resume, save, serve an image, evaluate; and the rules that pick a family
and refuse what cannot train."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from family_fixtures import (
    FAMILY_METHODS,
    STEPS,
    FamilyRun,
    hyperparameters,
    model_info,
    run_family,
    train_in_process,
)
from safetensors.torch import load_file

from sdflow_image import families
from sdflow_image.evaluation import evaluate
from sdflow_image.families.base import lora_plugin_refusal
from sdflow_image.serving import serve_model
from sdflow_image.training import lora, train
from sdflow_image.training.checkpoints import CheckpointError
from sdflow_image.training.data import original_size

pytestmark = pytest.mark.image

PROMPT = "a red square on a blue background"


@pytest.fixture(scope="module", params=FAMILY_METHODS, ids=[f"{f}-{m}{'-te' * t}" for f, m, t in FAMILY_METHODS])
def family_run(
    request: pytest.FixtureRequest,
    family_base: Any,
    family_dataset: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> FamilyRun:
    family, method, text_encoder = request.param
    root = tmp_path_factory.mktemp(f"run-{family}-{method}")
    return run_family(family, method, family_base(family), family_dataset, root, text_encoder)


# --- train, checkpoint, resume, save ----------------------------------------------------------


def test_train_family_method_resumed_from_checkpoint_repeats_uninterrupted_losses(family_run: FamilyRun) -> None:
    assert sorted(family_run.losses) == list(range(1, STEPS + 1))
    assert sorted(family_run.resumed_losses) == [3, 4]
    for step, loss in family_run.resumed_losses.items():
        assert loss == pytest.approx(family_run.losses[step], rel=1e-5, abs=1e-7), step


def test_train_family_method_checkpoint_holds_only_trainable_state(family_run: FamilyRun) -> None:
    family = families.get(family_run.family)
    checkpoint = family_run.out.parent / "checkpoints" / "checkpoint-00000002"
    names = {p.name for p in checkpoint.iterdir()}
    if family_run.method == "full":
        assert family.denoiser_name in names
        assert lora.ADAPTER_FILE not in names
        return
    assert family.denoiser_name not in names
    adapter = load_file(str(checkpoint / lora.ADAPTER_FILE))
    assert adapter
    assert all(".lora_A." in key or ".lora_B." in key for key in adapter), sorted(adapter)[:4]
    encoders = {"adapter_text_encoder.safetensors", "adapter_text_encoder_2.safetensors"}
    assert (encoders <= names) == family_run.text_encoder


def test_train_resumed_with_other_method_raises_naming_both(
    family_base: Any, family_dataset: Path, tmp_path: Path
) -> None:
    hp = hyperparameters("sd", "full", family_base("sd"), family_dataset, tmp_path)
    train_in_process({**hp, "max_train_steps": "2", "checkpointing_steps": "1"})
    lora_hp = {**hyperparameters("sd", "lora", family_base("sd"), family_dataset, tmp_path), "max_train_steps": "3"}
    with pytest.raises(CheckpointError, match="training_method=full run, this one is lora"):
        train_in_process(lora_hp)


def test_train_family_method_writes_model_info_of_the_contract(family_run: FamilyRun) -> None:
    info = model_info(family_run.out)
    assert (info["format"], info["family"], info["method"]) == (1, family_run.family, family_run.method)
    assert info["base_model_uri"] == f"s3://bucket/models/tiny-{family_run.family}/"
    if family_run.method == "lora":
        assert info["lora"] == {
            "rank": 4,
            "alpha": 8.0,
            "target_modules": ["to_k", "to_q", "to_v", "to_out.0"],
            "text_encoder": family_run.text_encoder,
        }
    else:
        assert "lora" not in info


def test_train_family_method_output_lora_is_adapter_alone_full_is_pipeline(family_run: FamilyRun) -> None:
    out = family_run.out
    reports = {"loss.png", "samples.png", "sdflow_model.json", "training_summary.json"}
    if family_run.method == "full":
        index = json.loads((out / "model_index.json").read_text())
        assert index["_class_name"] == families.get(family_run.family).pipeline_class_name
        return
    assert {p.name for p in out.iterdir()} == reports | {lora.LORA_WEIGHTS}
    weights = load_file(str(out / lora.LORA_WEIGHTS))
    assert all("lora" in key for key in weights), "base weights in the adapter file"
    components = {key.split(".")[0] for key in weights}
    denoiser = families.get(family_run.family).denoiser_name
    assert components == ({denoiser, "text_encoder", "text_encoder_2"} if family_run.text_encoder else {denoiser})
    base_bytes = sum(p.stat().st_size for p in (family_run.base / denoiser).glob("*.safetensors"))
    assert family_run.summary["model_bytes"] * 10 < base_bytes
    assert "model output:" in family_run.stdout


# --- serve and evaluate what was saved ----------------------------------------------------------


def test_serve_family_method_loads_saved_model_and_draws_image(family_run: FamilyRun) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    settings = serve_model.ServeSettings(model_dir=family_run.out, base_model_dir=family_run.base, device="cpu")
    pipe = serve_model.load_pipeline(settings)
    if family_run.method == "lora":
        layers = [m for m in pipe.components[families.get(family_run.family).denoiser_name].modules()
                  if isinstance(m, BaseTunerLayer)]  # fmt: skip
        # Trained and served in float32: fused (serve_model.attach_adapter).
        assert layers
        assert all(layer.merged for layer in layers)
    image = pipe(PROMPT, num_inference_steps=2, height=32, width=32, output_type="pil").images[0]
    assert image.size == (32, 32)


def test_evaluate_family_method_scores_trained_model_against_base(family_run: FamilyRun, tmp_path: Path) -> None:
    args = evaluate.parse_args(
        [
            "--model_dir", str(family_run.out),
            "--base_model_dir", str(family_run.base),
            "--output_dir", str(tmp_path / "evaluation"),
            "--work_dir", str(tmp_path / "work"),
            "--prompts", json.dumps([PROMPT]),
            "--num_inference_steps", "2",
        ]
    )  # fmt: skip
    document = evaluate.evaluate(args)
    assert 0 <= document["prompt_adherence"] <= 1
    assert 0 <= document["base_prompt_adherence"] <= 1
    assert (tmp_path / "evaluation" / "adherence.png").is_file()


def test_serve_lora_without_base_model_raises_naming_the_channel(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    info = {"format": 1, "family": "sd", "method": "lora", "resolution": 32, "dtype": "float32"}
    (model_dir / "sdflow_model.json").write_text(json.dumps(info))
    settings = serve_model.ServeSettings(model_dir=model_dir, base_model_dir=tmp_path / "nothing", device="cpu")
    with pytest.raises(serve_model.ModelNotFoundError, match="AdditionalModelDataSources channel 'base_model'"):
        serve_model.load_pipeline(settings)


# --- the adapter file: what diffusers loads is what trained ---------------------------------------


def _denoise(family: str, denoiser: Any) -> Any:
    """One forward pass of `denoiser` on fixed random inputs of the tiny models' shapes."""
    import torch

    g = torch.Generator().manual_seed(3)
    latents = torch.randn(2, 4, 8, 8, generator=g)
    t = torch.tensor([10, 500])
    with torch.no_grad():
        if family == "sd3":
            hidden, pooled = torch.randn(2, 32, 64, generator=g), torch.randn(2, 64, generator=g)
            return denoiser(hidden_states=latents, timestep=t, encoder_hidden_states=hidden,
                            pooled_projections=pooled, return_dict=False)[0]  # fmt: skip
        width = 64 if family == "sdxl" else 32
        hidden = torch.randn(2, 16, width, generator=g)
        extra = {}
        if family == "sdxl":
            time_ids = torch.tensor([[40.0, 48.0, 0.0, 4.0, 32.0, 32.0]] * 2)
            extra = {"added_cond_kwargs": {"text_embeds": torch.randn(2, 32, generator=g), "time_ids": time_ids}}
        return denoiser(latents, t, hidden, return_dict=False, **extra)[0]


@pytest.mark.parametrize("family", ["sd", "sdxl", "sd3"])
def test_lora_adapter_saved_then_loaded_on_base_computes_as_trained_also_fused(
    family: str, family_base: Any, tmp_path: Path
) -> None:
    """alpha != rank and non-zero B: the file holds the trained scale, so diffusers' loader (which
    reads no alpha) rebuilds the same function, and fusing it keeps it."""
    import torch

    fam = families.get(family)
    base = family_base(family)
    parts = fam.load_parts(str(base))
    args = argparse.Namespace(
        lora_rank=4, lora_alpha=12.0, lora_dropout=0.0, lora_target_modules=[], train_text_encoder_lora=False
    )
    lora.add_adapters(parts, args, fam)
    with torch.no_grad():
        for name, param in parts.denoiser.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    parts.denoiser.eval()
    trained = _denoise(family, parts.denoiser)
    lora.save_adapter(fam, lora.adapter_layers(fam, parts, args), tmp_path)

    pipe = fam.pipeline_class().from_pretrained(str(base), local_files_only=True, **fam.pipeline_kwargs)
    untouched = _denoise(family, getattr(pipe, fam.denoiser_name))
    lora.load_adapter(pipe, tmp_path)
    loaded = _denoise(family, getattr(pipe, fam.denoiser_name))
    lora.fuse(pipe)
    fused = _denoise(family, getattr(pipe, fam.denoiser_name))
    assert not torch.allclose(untouched, trained, atol=1e-3), "the adapter changes nothing: test is void"
    torch.testing.assert_close(loaded, trained, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(fused, trained, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_lora_text_encoder_adapters_saved_then_loaded_encode_as_trained(
    family: str, family_base: Any, tmp_path: Path
) -> None:
    import torch

    fam = families.get(family)
    base = family_base(family)
    parts = fam.load_parts(str(base))
    args = argparse.Namespace(
        lora_rank=4, lora_alpha=2.0, lora_dropout=0.0, lora_target_modules=[], train_text_encoder_lora=True
    )
    encoders = lora.add_adapters(parts, args, fam)
    assert sorted(encoders) == (["text_encoder"] if family == "sd" else ["text_encoder", "text_encoder_2"])
    ids = torch.tensor([[0, 5, 9, 12] + [1] * 12])
    with torch.no_grad():
        for encoder in encoders.values():
            encoder.eval()
            for param_name, param in encoder.named_parameters():
                if "lora_B" in param_name:
                    param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(param_name)))
        trained = {name: encoder(ids)[0] for name, encoder in encoders.items()}
    lora.save_adapter(fam, lora.adapter_layers(fam, parts, args), tmp_path)

    pipe = fam.pipeline_class().from_pretrained(str(base), local_files_only=True, **fam.pipeline_kwargs)
    with torch.no_grad():
        untouched = {name: getattr(pipe, name)(ids)[0] for name in encoders}
        lora.load_adapter(pipe, tmp_path)
        loaded = {name: getattr(pipe, name)(ids)[0] for name in encoders}
    for name in encoders:
        assert not torch.allclose(untouched[name], trained[name], atol=1e-3), name
        torch.testing.assert_close(loaded[name], trained[name], atol=1e-5, rtol=1e-4)


# --- which family, which plugin: the early checks -------------------------------------------------


def _args(base: Path, **hp: str) -> argparse.Namespace:
    return train.parse_args([], {"pretrained_model_name_or_path": str(base), **hp})


def test_check_base_model_family_other_than_asked_raises_naming_both(family_base: Any) -> None:
    with pytest.raises(train.HyperparameterError, match=r"model_family=sdxl but the base model .* is sd"):
        train.check_base_model(_args(family_base("sd"), model_family="sdxl"))
    assert train.check_base_model(_args(family_base("sd3"))) == "sd3"


def test_check_base_model_unsupported_pipeline_class_raises_naming_class_and_families(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "PixArtAlphaPipeline"}))
    with pytest.raises(train.ChannelError, match=r"PixArtAlphaPipeline; the families supported are .*sdxl"):
        train.check_base_model(_args(tmp_path))


@pytest.mark.parametrize("plugin", ["gemini", "low_level_zero"])
def test_check_plugin_lora_on_plugin_without_lora_raises_with_the_reason(plugin: str, tmp_path: Path) -> None:
    hp = {"plugin": plugin, "training_method": "lora", "mixed_precision": "bf16"}
    with pytest.raises(train.PluginError, match=f"plugin={plugin} cannot train training_method=lora: .*Colossal-AI"):
        train.check_plugin(_args(tmp_path, **hp), cuda=True)
    assert lora_plugin_refusal("torch_ddp") is None


@pytest.mark.parametrize(
    ("family", "hp", "message"),
    [
        ("sd3", {"snr_gamma": "5"}, "rectified flow"),
        ("sd3", {"training_method": "lora", "train_text_encoder_lora": "true"}, "transformer only"),
        ("sdxl", {"cache_latents": "true", "random_flip": "false", "center_crop": "true"}, "cache_latents=false"),
        ("sd", {"sd3_t5": "false"}, "sd3_t5=false is for model_family=sd3"),
    ],
)
def test_check_family_setting_the_family_cannot_train_raises_naming_it(
    family: str, hp: dict[str, str], message: str, family_base: Any
) -> None:
    args = _args(family_base(family), **hp)
    args.model_family = train.check_base_model(args)
    with pytest.raises(train.HyperparameterError, match=message):
        train.check_family(args)


def test_parse_args_lora_with_ema_raises_and_alpha_defaults_to_rank(tmp_path: Path) -> None:
    with pytest.raises(train.HyperparameterError, match="use_ema=true is for training_method=full"):
        _args(tmp_path, training_method="lora", use_ema="true")
    args = _args(tmp_path, training_method="lora", lora_rank="16", lora_target_modules="to_q, to_v")
    assert (args.lora_alpha, args.lora_target_modules) == (16.0, ["to_q", "to_v"])


# --- data: what SDXL's time ids read ----------------------------------------------------------


def test_original_size_reads_img2dataset_json_else_the_image() -> None:
    from PIL import Image

    image = Image.new("RGB", (48, 40))
    meta = {"original_width": 1024, "original_height": 768}
    assert original_size({"json": json.dumps(meta).encode()}, image) == (768, 1024)
    assert original_size({"json": b'{"caption": "x"}'}, image) == (40, 48)
    assert original_size({}, image) == (40, 48)


def test_sdxl_batches_carry_each_sample_size_and_crop_into_time_ids(family_base: Any, family_dataset: Path) -> None:
    import torch

    from sdflow_image.training import data

    fam = families.get("sdxl")
    parts = fam.load_parts(str(family_base("sdxl")))
    args = _args(family_base("sdxl"), dataset_dir=str(family_dataset), resolution="32", train_batch_size="2",
                 dataloader_num_workers="0", center_crop="false")  # fmt: skip
    loader = data.make_dataloader(args, parts.tokenizer, rank=0, world_size=1, tokenize=fam.caption_ids(parts))
    batch = next(iter(loader))
    assert {"input_ids", "input_ids_2", "original_size", "crop_top_left"} <= set(batch)
    # The shards' images are 32..40 px a side (no img2dataset json sizes): resized to 32 on the
    # short side, cropped at random on the long one.
    assert ((batch["original_size"] >= 32) & (batch["original_size"] <= 40)).all()
    encoded = fam.encode_batch(batch, parts, torch.device("cpu"), torch.Generator().manual_seed(0), 0.0)
    expected = torch.cat([batch["original_size"], batch["crop_top_left"], torch.tensor([[32, 32]] * 2)], dim=1)
    assert torch.equal(encoded.extra["time_ids"], expected.float())
    assert encoded.hidden.shape == (2, 16, 64)
    assert encoded.extra["text_embeds"].shape == (2, 32)


def test_tiny_model_cli_family_builds_that_pipeline(tmp_path: Path) -> None:
    from sdflow_image.builders.__main__ import main

    assert main([str(tmp_path / "sd3"), "--family", "sd3"]) == 0
    index = json.loads((tmp_path / "sd3" / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert index["tokenizer_3"] == ["transformers", "T5TokenizerFast"]


def test_train_sd3_lora_without_t5_is_served_without_it(family_base: Any, family_dataset: Path, tmp_path: Path) -> None:
    hp = {**hyperparameters("sd3", "lora", family_base("sd3"), family_dataset, tmp_path), "sd3_t5": "false"}
    train_in_process({**hp, "max_train_steps": "2"})
    out = Path(hp["output_dir"])
    assert model_info(out)["left_out"] == ["text_encoder_3", "tokenizer_3"]
    settings = serve_model.ServeSettings(model_dir=out, base_model_dir=family_base("sd3"), device="cpu")
    pipe = serve_model.load_pipeline(settings)
    assert pipe.text_encoder_3 is None  # the base has T5; the adapter was trained without it
    assert pipe(PROMPT, num_inference_steps=2, height=32, width=32).images[0].size == (32, 32)


def test_sd3_without_t5_conditions_on_zeros_in_its_place(tmp_path: Path) -> None:
    import torch

    from sdflow_image.builders import tiny

    base = tiny.build_tiny("sd3", tmp_path / "no-t5", with_t5=False)
    fam = families.get("sd3")
    parts = fam.load_parts(str(base))
    assert parts.text_encoder_3 is None
    ids = fam.caption_ids(parts)(PROMPT)
    batch = {
        "pixel_values": torch.zeros(1, 3, 32, 32),
        **{key: value[None] for key, value in ids.items()},
    }
    encoded = fam.encode_batch(batch, parts, torch.device("cpu"), torch.Generator().manual_seed(0), 0.0)
    assert encoded.hidden.shape == (1, 32, 64)  # CLIP's 16 tokens, then 16 zero rows for T5
    assert torch.count_nonzero(encoded.hidden[:, 16:]) == 0
