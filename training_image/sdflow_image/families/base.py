"""What every model family provides, and the rules about families that need no torch.

A family is read off the base model: its `model_index.json` names the pipeline class that
diffusers' `save_pretrained` wrote (`_class_name`), and that class decides how prompts are
encoded, what the denoiser is and which loss trains it (`PIPELINE_FAMILIES`).

`Family` is the one interface training, sampling, evaluation and serving go through; each
family module (`sd`, `sdxl`, `sd3`) fills it in after the diffusers 0.29 example that trains
that model; `sd35`, `flux2` and `qwenimage` after diffusers 0.42.1's, and run only on the second
stack (`NEW_STACK_FAMILIES`: diffusers 0.29 has none of their classes). Everything imports torch and
diffusers lazily, inside the methods: `train.py`'s early checks call `detect_family` and
`lora_plugin_refusal` before torch loads, on either stack.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FAMILIES = ("sd", "sdxl", "sd3", "sd35", "flux2", "qwenimage")
# The families only the second stack (torch 2.15, diffusers 0.42.1) can load and train.
NEW_STACK_FAMILIES = ("sd35", "flux2", "qwenimage")
METHODS = ("full", "lora")
PIPELINE_FAMILIES = {
    "StableDiffusionPipeline": "sd",
    "StableDiffusionXLPipeline": "sdxl",
    "StableDiffusion3Pipeline": "sd3",  # or sd35: `detect_family` reads the transformer's config
    "Flux2KleinPipeline": "flux2",
    "QwenImagePipeline": "qwenimage",
}

# Which Colossal-AI 0.5.0 plugin can train a LoRA adapter here, and why the others cannot (read
# in colossalai/booster/plugin/*.py; the orchestration's Validate run applies the same rule).
LORA_REFUSALS = {
    "gemini": (
        "Colossal-AI 0.5.0's GeminiPlugin.support_lora() is False: Gemini packs every parameter, frozen "
        "or not, into its chunks, and Booster.enable_lora refuses it"
    ),
    "low_level_zero": (
        "Colossal-AI 0.5.0's LowLevelZero takes LoRA only as a peft PeftModel made by Booster.enable_lora, "
        "whose wrapper renames every weight (base_model.model.*) away from the diffusers LoRA format this image "
        "writes; and ZeRO shards optimizer state, which for an adapter of a few MB saves nothing. "
        "Use plugin=torch_ddp for LoRA"
    ),
}


def second_stack(module: str) -> Any:
    """`module` (diffusers, transformers) typed Any, for the classes only the second stack has
    (diffusers 0.42.1, transformers 5): the image's type check runs against the first stack's
    packages, where they do not exist (and where 4.51's tokenizers take other arguments)."""
    import importlib

    return importlib.import_module(module)


class FamilyError(ValueError):
    """The base model is not of a supported family, or not of the family the run asked for."""


def detect_family(base_dir: str | Path) -> str:
    """The family of the diffusers pipeline in `base_dir`, from model_index.json's `_class_name`."""
    index = Path(base_dir) / "model_index.json"
    try:
        class_name = json.loads(index.read_text(encoding="utf-8")).get("_class_name")
    except (OSError, ValueError, AttributeError) as exc:
        raise FamilyError(f"base model {base_dir}: cannot read {index.name} ({exc})") from None
    family = PIPELINE_FAMILIES.get(str(class_name))
    if family is None:
        supported = ", ".join(f"{cls} ({fam})" for cls, fam in PIPELINE_FAMILIES.items())
        raise FamilyError(f"base model {base_dir} is a {class_name}; the families supported are {supported}")
    if family == "sd3" and is_sd35(base_dir):
        return "sd35"
    return family


def is_sd35(base_dir: str | Path) -> bool:
    """Whether a StableDiffusion3Pipeline is SD 3.5: its transformer normalises queries and keys
    (`qk_norm: "rms_norm"` in SD 3.5 Large, Large Turbo and Medium; SD 3 Medium has none), which
    diffusers 0.29's SD3Transformer2DModel cannot build. A missing or unreadable config reads as SD 3:
    loading it will then say what is wrong."""
    config = Path(base_dir) / "transformer" / "config.json"
    try:
        return bool(json.loads(config.read_text(encoding="utf-8")).get("qk_norm"))
    except (OSError, ValueError, AttributeError):
        return False


def resolve_family(requested: str | None, base_dir: str | Path) -> str:
    """The base model's family; FamilyError when `requested` (model_family) says another."""
    found = detect_family(base_dir)
    if requested and requested != found:
        raise FamilyError(
            f"model_family={requested} but the base model {base_dir} is {found} "
            f"(model_index.json's _class_name); set model_family={found} or pass a {requested} base model"
        )
    return found


def lora_plugin_refusal(plugin: str) -> str | None:
    """Why `plugin` cannot train LoRA here (None: it can). The one rule, for train.py and Validate run."""
    return LORA_REFUSALS.get(plugin)


@dataclass
class Parts:
    """A pipeline's parts as training uses them. SD fills the first five; SDXL adds the second
    tokenizer and text encoder; SD3 has all three (the third, T5, may be absent) and a
    `transformer` instead of a `unet`."""

    tokenizer: Any
    text_encoder: Any
    vae: Any
    unet: Any
    noise_scheduler: Any
    tokenizer_2: Any = None
    text_encoder_2: Any = None
    tokenizer_3: Any = None
    text_encoder_3: Any = None
    transformer: Any = None

    @property
    def denoiser(self) -> Any:
        return self.transformer if self.transformer is not None else self.unet

    @property
    def text_encoders(self) -> list[Any]:
        return [e for e in (self.text_encoder, self.text_encoder_2, self.text_encoder_3) if e is not None]


@dataclass(frozen=True)
class PartDtypes:
    """The dtype each part is loaded in (from_pretrained's torch_dtype), so that a part reaches the
    device in the precision it runs in and never first in fp32 (diffusers' training scripts load or
    cast the frozen parts to `weight_dtype` before they move). None: the loader's own default."""

    denoiser: Any = None
    text_encoders: Any = None
    vae: Any = None


LOADER_DTYPES = PartDtypes()  # every part as from_pretrained loads it by default


def diffusers_dtype(dtype: Any) -> dict[str, Any]:
    """A diffusers from_pretrained's dtype argument (0.29 and 0.42 both name it torch_dtype)."""
    return {} if dtype is None else {"torch_dtype": dtype}


def transformers_dtype(dtype: Any) -> dict[str, Any]:
    """A transformers from_pretrained's dtype argument: `dtype` on transformers 5 (which warns that
    `torch_dtype` is deprecated), `torch_dtype` on the first stack's 4.51."""
    if dtype is None:
        return {}
    import transformers

    return {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": dtype}


@dataclass
class Encoded:
    """A batch through the frozen parts: latents and what conditions the denoiser on the prompt."""

    latents: Any
    hidden: Any  # the prompt embeddings the denoiser attends to
    extra: dict[str, Any] = field(default_factory=dict)  # pooled embeddings, SDXL's time ids


IDS_KEYS = ("input_ids", "input_ids_2", "input_ids_3")


def grad_if_training(*modules: Any) -> Any:
    """Autograd on while any of `modules` has weights that train (a text encoder's LoRA adapter),
    else off: a frozen encoder keeps no activations for a backward that never reaches it."""
    import torch

    return torch.set_grad_enabled(any(p.requires_grad for m in modules for p in m.parameters()))


class Family:
    """The interface; the family modules subclass it. Defaults are SD's where families agree."""

    name = ""
    pipeline_class_name = ""
    denoiser_name = "unet"  # the pipeline component that trains, and its folder in checkpoints
    denoiser_class_name = "UNet2DConditionModel"
    # diffusers' LoRA examples: attention projections of the denoiser (train_text_to_image_lora*.py,
    # train_dreambooth_lora_sd3.py) and of the CLIP text encoders.
    lora_targets: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0")
    text_encoder_lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "out_proj")
    text_encoder_lora = True  # whether diffusers 0.29 saves and loads text-encoder LoRA for it
    # Whether its LoRA file holds diffusers' key names (lora.down/up: UNet loaders convert them
    # back) or peft's (lora_A/B: 0.29's SD3 loader reads only those, as its example saves them).
    lora_diffusers_keys = True
    pipeline_kwargs: dict[str, Any] = {}
    vae_fp32 = False  # whether the frozen VAE encodes in fp32 whatever the training precision
    # What the image side must be a multiple of: the VAE's factor (8), times the latent patch of a
    # transformer denoiser (2x2) where there is one. The layer's model_checks.RESOLUTION_MULTIPLE holds the same.
    resolution_multiple = 8

    def load_parts(self, base: str, left_out: tuple[str, ...] = (), dtypes: PartDtypes = LOADER_DTYPES) -> Parts:
        """The parts from a diffusers folder, without the optional components in `left_out`, each
        loaded in its `dtypes` entry."""
        raise NotImplementedError

    def left_out(self, args: Any) -> tuple[str, ...]:
        """The pipeline components a run leaves out (SD3: T5 with sd3_t5=false); none by default."""
        return ()

    def pipeline_class(self) -> Any:
        """The diffusers pipeline class (typed Any: diffusers ships no type information)."""
        import diffusers

        return getattr(diffusers, self.pipeline_class_name)

    def call_kwargs(self, pipe: Any, prompt: Any, negative_prompt: Any, guidance_scale: float) -> dict[str, Any]:
        """The pipeline call's prompt, negative prompt and classifier-free guidance arguments for a
        request's (by name: FLUX.2 [klein]'s first positional argument is an image). SD's are
        the request's own; the families whose pipelines name them otherwise say so."""
        return {"prompt": prompt, "negative_prompt": negative_prompt, "guidance_scale": guidance_scale}

    def denoiser_class(self) -> Any:
        import diffusers

        return getattr(diffusers, self.denoiser_class_name)

    def tokenizers(self, parts: Parts) -> list[Any]:
        return [t for t in (parts.tokenizer, parts.tokenizer_2, parts.tokenizer_3) if t is not None]

    def caption_ids(self, parts: Parts) -> Callable[[str], dict[str, Any]]:
        """Caption → {"input_ids", "input_ids_2", ...}: one padded row per tokenizer (runs in the
        DataLoader's workers, so the tokenizers are pickled there)."""
        tokenizers = self.tokenizers(parts)
        return CaptionIds(tokenizers, [int(t.model_max_length) for t in tokenizers])

    def frozen_modules(self, parts: Parts) -> list[Any]:
        return [parts.vae, *parts.text_encoders]

    def encode_batch(
        self, batch: dict[str, Any], parts: Parts, device: Any, generator: Any, proportion_empty_prompts: float
    ) -> Encoded:
        raise NotImplementedError

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
        raise NotImplementedError

    def drop_prompts(
        self, batch: dict[str, Any], parts: Parts, device: Any, generator: Any, proportion: float
    ) -> list[Any]:
        """Each tokenizer's ids on `device`, with a `proportion` of the rows (one draw for all
        tokenizers) replaced by the empty prompt's, for classifier-free guidance."""
        import torch

        tokenizers = self.tokenizers(parts)
        ids = [batch[key].to(device, non_blocking=True) for key in IDS_KEYS[: len(tokenizers)]]
        if proportion <= 0:
            return ids
        dropped = torch.rand(ids[0].shape[0], generator=generator, device=device) < proportion
        out = []
        for tokenizer, rows in zip(tokenizers, ids, strict=True):
            empty = CaptionIds.one(tokenizer, "", rows.shape[1]).to(device)
            out.append(torch.where(dropped[:, None], empty[None, :], rows))
        return out


class CaptionIds:
    """Picklable caption → ids for each tokenizer, padded (and truncated) to its `lengths` entry."""

    def __init__(self, tokenizers: list[Any], lengths: list[int]) -> None:
        self.tokenizers, self.lengths = tokenizers, lengths

    @staticmethod
    def one(tokenizer: Any, caption: str, length: int) -> Any:
        ids = tokenizer(caption, padding="max_length", truncation=True, max_length=length, return_tensors="pt")
        return ids.input_ids[0]

    def __call__(self, caption: str) -> dict[str, Any]:
        rows = zip(IDS_KEYS, self.tokenizers, self.lengths, strict=False)
        return {key: self.one(tok, caption, length) for key, tok, length in rows}
