"""The precision a GPU serves and evaluates a model in: one rule by family (serve_model.serving_dtype).
FLUX.2, Qwen-Image and SD 3.5 in bf16 whatever they were saved in (fp16 overflows them); SD, SDXL
and SD 3 in half precision, bf16 only where saved in bf16 and the GPU has bf16 tensor cores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sdflow_image.evaluation import evaluate
from sdflow_image.serving import serve_model
from sdflow_image.serving.serve_model import ModelInfo, ServeSettings, torch_placement

H100, A10G, T4 = (9, 0), (8, 6), (7, 5)


@pytest.mark.parametrize(
    ("family", "saved", "capability", "served"),
    [
        pytest.param("flux2", "float32", H100, torch.bfloat16, id="flux2-full-fp32"),
        pytest.param("flux2", "float16", A10G, torch.bfloat16, id="flux2-saved-fp16"),
        pytest.param("qwenimage", "float32", H100, torch.bfloat16, id="qwenimage"),
        pytest.param("sd35", "float32", A10G, torch.bfloat16, id="sd35"),
        pytest.param("flux2", "bfloat16", T4, torch.bfloat16, id="flux2-on-t4-slow-not-wrong"),
        pytest.param("sd", "float32", H100, torch.float16, id="sd-fp32-serves-fp16"),
        pytest.param("sdxl", "bfloat16", A10G, torch.bfloat16, id="sdxl-bf16"),
        pytest.param("sd3", "float32", H100, torch.float16, id="sd3-fp16"),
    ],
)
def test_torch_placement_gpu_serves_flux2_qwenimage_sd35_in_bf16_whatever_they_were_saved_in(
    family: str, saved: str, capability: tuple[int, int], served: torch.dtype
) -> None:
    info = ModelInfo(resolution=256, dtype=saved, family=family)
    assert torch_placement(ServeSettings(device="cuda"), info, capability) == ("cuda", served)
    # A model whose sdflow_model.json names no family: the pipeline's family decides.
    unnamed = ModelInfo(resolution=256, dtype=saved)
    assert torch_placement(ServeSettings(device="cuda"), unnamed, capability, family=family) == ("cuda", served)


def test_evaluate_loads_both_models_in_the_endpoints_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded: list[ServeSettings] = []

    def load(settings: ServeSettings) -> Any:
        loaded.append(settings)
        return object()

    monkeypatch.setattr(serve_model, "load_pipeline", load)
    evaluate._loader(tmp_path / "model", "--model_dir", "fix", "cuda", tmp_path / "base")()
    evaluate._loader(tmp_path / "base", "--base_model_dir", "fix", "cuda")()
    assert [s.dtype for s in loaded] == ["auto", "auto"]
    info = ModelInfo(resolution=256, dtype="float32", family="qwenimage")
    assert torch_placement(loaded[0], info, H100) == ("cuda", torch.bfloat16)
