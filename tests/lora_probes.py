"""What peft, as the images call it, makes of a full-size denoiser: shared by the LoRA module-name tests of both
job stacks (tests/image, tests/image_accelerate), which differ only in their models and peft's version."""

from __future__ import annotations

import copy
from typing import Any

from sdflow_common import lora_modules


def split_module_names(model: Any, kinds: tuple[type, ...]) -> tuple[Any, Any]:
    """The model's module names split as lora_module_names holds them: those of a class peft adapts, the rest."""
    return lora_modules.split_names((n, isinstance(m, kinds)) for n, m in model.named_modules() if n)


def peft_problem(model: Any, target: str) -> str | None:
    """peft's refusal of `target` (inject_adapter_in_model with LoraConfig(target_modules=[target]), the image's
    add_adapter), or None when it adapts a module."""
    from peft import LoraConfig, inject_adapter_in_model

    try:
        inject_adapter_in_model(LoraConfig(r=4, target_modules=[target]), copy.deepcopy(model))
    except ValueError as exc:
        return str(exc)
    return None
