"""The model families a run can fine-tune, behind one interface (`base.Family`).

- `base`: the family a base model belongs to (from its model_index.json, no torch), the
  rules that need no torch (which plugins can train LoRA), and the interface itself.
- `sd`, `sdxl`, `sd3`: Stable Diffusion 1.x/2.x, SDXL and Stable Diffusion 3, each written
  after diffusers 0.29's training examples for that model.
- `sd35`, `flux2`, `qwenimage`: SD 3.5, FLUX.2 [klein] and Qwen-Image, after diffusers 0.42.1's
  (the second stack only: `NEW_STACK_FAMILIES`); `flow` holds their flow-matching loss.

`get(name)` imports a family's module only when it is asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

from sdflow_image.families.base import (
    FAMILIES,
    NEW_STACK_FAMILIES,
    PIPELINE_FAMILIES,
    Family,
    FamilyError,
    detect_family,
    lora_plugin_refusal,
)

__all__ = [
    "FAMILIES",
    "NEW_STACK_FAMILIES",
    "Family",
    "FamilyError",
    "call_kwargs",
    "detect_family",
    "get",
    "lora_plugin_refusal",
]  # fmt: skip


def get(name: str) -> Family:
    """The family object for `name` (one of FAMILIES)."""
    if name not in FAMILIES:
        raise FamilyError(f"model_family={name!r} is not one of {', '.join(FAMILIES)}")
    module = importlib.import_module(f"sdflow_image.families.{name}")
    family: Family = module.FAMILY
    return family


def call_kwargs(pipe: Any, prompt: Any, negative_prompt: Any, guidance_scale: float) -> dict[str, Any]:
    """The prompt and guidance arguments of a call to `pipe`, as its family's pipeline names them
    (`Family.call_kwargs`); a pipeline of no family here (a test's stand-in) takes SD's."""
    name = PIPELINE_FAMILIES.get(type(pipe).__name__)
    family = get(name) if name is not None else Family()
    return family.call_kwargs(pipe, prompt, negative_prompt, guidance_scale)
