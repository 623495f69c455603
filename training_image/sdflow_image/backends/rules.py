"""Which training backend and plugin a run gets, and why an impossible pair is refused: the one
rule set of the image's early checks (`train.check_backend`). No torch here, and the constants
are plain tuples and dicts, so that the orchestration's Validate run can hold the same values
and a test can compare the two for equality.

- colossalai: Colossal-AI 0.5.0's Booster on the first stack (torch 2.5.1, diffusers 0.29.0),
  plugins torch_ddp | low_level_zero | gemini; the backend of SD 1.x/2.x, SDXL and SD 3.
- accelerate: the second stack (torch 2.15, diffusers 0.42.1, accelerate 1.15); plugin `ddp`
  (accelerate's Accelerator: replicated, for LoRA and full fine-tunes that fit one GPU) or
  `fsdp2` (torch's fully_shard: sharded full fine-tunes). The backend of the families that
  diffusers 0.29 cannot load (SD 3.5, FLUX.2 [klein], Qwen-Image); SD, SDXL and SD 3 may run on
  it too when a run asks for it.
"""

from __future__ import annotations

from sdflow_image.families.base import LORA_REFUSALS as COLOSSALAI_LORA_REFUSALS

BACKENDS = ("colossalai", "accelerate")
COLOSSALAI, ACCELERATE = BACKENDS
# The families' default backends. The new families need the second stack: diffusers 0.29 has
# no Flux2KleinPipeline or QwenImagePipeline, and its SD3Transformer2DModel has no qk_norm.
BACKEND_OF_FAMILY = {
    "sd": COLOSSALAI,
    "sdxl": COLOSSALAI,
    "sd3": COLOSSALAI,
    "sd35": ACCELERATE,
    "flux2": ACCELERATE,
    "qwenimage": ACCELERATE,
}
NEW_STACK_FAMILIES = ("sd35", "flux2", "qwenimage")
PLUGINS_OF_BACKEND = {
    COLOSSALAI: ("torch_ddp", "low_level_zero", "gemini"),
    ACCELERATE: ("ddp", "fsdp2"),
}
PLUGINS = (*PLUGINS_OF_BACKEND[COLOSSALAI], *PLUGINS_OF_BACKEND[ACCELERATE])
# backend -> training_method -> plugin when the run names none.
DEFAULT_PLUGIN = {
    COLOSSALAI: {"full": "torch_ddp", "lora": "torch_ddp"},
    ACCELERATE: {"full": "fsdp2", "lora": "ddp"},
}
MIXED_PRECISIONS_OF_BACKEND = {COLOSSALAI: ("no", "fp16", "bf16"), ACCELERATE: ("no", "bf16")}

NEW_FAMILY_ON_COLOSSALAI = (
    "Colossal-AI 0.5.0 holds its image at diffusers 0.29.0, which cannot load this model "
    "(no such pipeline or transformer options there): set backend=accelerate"
)
FP16_ON_ACCELERATE = (
    "the accelerate backend trains in bf16 or fp32: FSDP2's mixed precision keeps no loss scaler, "
    "so fp16 gradients would underflow, and diffusers' examples train these models in bf16: set "
    "mixed_precision=bf16"
)
EMA_ON_FSDP2 = (
    "use_ema=true is not supported with plugin=fsdp2: each rank holds a shard of every weight, and the "
    "average is kept whole on one rank; use plugin=ddp where the model fits one GPU, or use_ema=false"
)
# LoRA: Colossal-AI's refusals (families.base) and the second backend's.
LORA_REFUSALS = {
    **COLOSSALAI_LORA_REFUSALS,
    "fsdp2": (
        "sharding saves nothing for an adapter of a few MB (its weights, gradients and Adam state are "
        "what FSDP2 would shard), while the frozen base would be gathered for every block's forward; "
        "use plugin=ddp for LoRA"
    ),
}


def default_backend(family: str | None) -> str:
    """The family's backend; colossalai when the family is not known yet (today's default)."""
    return BACKEND_OF_FAMILY.get(family or "", COLOSSALAI)


def default_plugin(backend: str, method: str) -> str:
    return DEFAULT_PLUGIN[backend][method]


def refusal(family: str | None, backend: str, plugin: str, method: str, mixed_precision: str) -> str | None:
    """Why this combination cannot train (the message names the setting and the fix), or None."""
    if family in NEW_STACK_FAMILIES and backend == COLOSSALAI:
        return f"model_family={family} cannot train with backend=colossalai: {NEW_FAMILY_ON_COLOSSALAI}"
    if plugin not in PLUGINS_OF_BACKEND[backend]:
        other = next(b for b, plugins in PLUGINS_OF_BACKEND.items() if plugin in plugins)
        return (
            f"plugin={plugin} belongs to backend={other}, and backend={backend} has "
            f"{' | '.join(PLUGINS_OF_BACKEND[backend])}: set plugin={default_plugin(backend, method)} or "
            f"backend={other}"
        )
    if mixed_precision not in MIXED_PRECISIONS_OF_BACKEND[backend]:
        return f"mixed_precision={mixed_precision} with backend={backend}: {FP16_ON_ACCELERATE}"
    if method == "lora" and plugin in LORA_REFUSALS:
        return f"plugin={plugin} cannot train training_method=lora: {LORA_REFUSALS[plugin]}"
    return None
