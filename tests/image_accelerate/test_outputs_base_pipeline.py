"""The pipelines a training job builds after training (samples, adherence) from bases saved the way
real ones are: in bf16, and SD 3.5 without T5. Both failed on an H200 (bench/gpu_acceptance.py
--quick, 2026-11-28) after training had finished, where the CPU's tiny fp32 bases passed:

- FLUX.2 [klein] LoRA: the base loaded without a dtype gave an fp32 transformer beside a bf16 text
  encoder (transformers 5 keeps a model's saved dtype), and the first sample's prompt embedding
  met the fp32 context_embedder;
- SD 3.5 full: a base saved without T5 (`text_encoder_3: [null, null]`) trains without it, but the
  exported pipeline was loaded from it without passing T5 as None, which diffusers refuses.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from sdflow_image import families  # noqa: E402
from sdflow_image.builders import tiny_families_next  # noqa: E402
from sdflow_image.training import outputs  # noqa: E402


def run_args(base: Path, family: str, **extra: object) -> argparse.Namespace:
    values = {"pretrained_model_name_or_path": str(base), "mixed_precision": "bf16", "model_family": family}
    return argparse.Namespace(**{**values, **extra})


def module_dtypes(pipe: object) -> dict[str, object]:
    return {name: part.dtype for name, part in pipe.components.items() if isinstance(part, torch.nn.Module)}


def test_lora_base_pipeline_bf16_base_loads_every_model_in_the_training_precision(tmp_path: Path) -> None:
    pipe = diffusers.Flux2KleinPipeline(**tiny_families_next.build_flux2_components(0)).to(torch.bfloat16)
    pipe.save_pretrained(tmp_path, safe_serialization=True)

    loaded = outputs.base_pipeline(run_args(tmp_path, "flux2"), families.get("flux2"))

    dtypes = module_dtypes(loaded)
    assert set(dtypes) == {"transformer", "text_encoder", "vae"}
    assert set(dtypes.values()) == {torch.bfloat16}, dtypes


def test_sd35_base_saved_without_t5_is_left_out_whatever_sd3_t5_says(tmp_path: Path) -> None:
    tiny_families_next.build_tiny_next("sd35", tmp_path, with_t5=False)
    family = families.get("sd35")
    args = run_args(tmp_path, "sd35", sd3_t5=True, resolution=32)

    assert family.left_out(args) == ("text_encoder_3", "tokenizer_3")
    loaded = outputs.base_pipeline(args, family)
    assert loaded.text_encoder_3 is None
    assert loaded.tokenizer_3 is None
    # ...and serving, which reads the trained model's info, leaves it out too.
    assert outputs.model_info(args, steps=1)["left_out"] == ["text_encoder_3", "tokenizer_3"]


def test_sd35_base_with_t5_keeps_it_unless_sd3_t5_is_false(tmp_path: Path) -> None:
    tiny_families_next.build_tiny_next("sd35", tmp_path)
    family = families.get("sd35")

    assert family.left_out(run_args(tmp_path, "sd35", sd3_t5=True)) == ()
    assert family.left_out(run_args(tmp_path, "sd35", sd3_t5=False)) == ("text_encoder_3", "tokenizer_3")
