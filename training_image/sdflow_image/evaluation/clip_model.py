"""The CLIP model of the evaluation's CLIP score, KID and FID: any transformers `CLIPModel` folder
(openai's ViT-L/14, LAION's, a preference model such as PickScore; the demo's tiny one) with its
processor files, mounted by the job at --clip_model_dir and read from disk only.

`check_clip_dir` reads config.json before anything heavy is imported, so a wrong folder fails in
seconds, as the run document's validation checks it (contract §4: model_type "clip" or a
text_config + vision_config; projection_dim, default 512 as transformers' CLIPConfig has it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdflow_image.evaluation.errors import ClipModelError

CLIP_FIX = (
    "mount a transformers CLIPModel folder there (config.json, its weights and processor files): "
    "set evaluation.clip_model_uri"
)
DEFAULT_PROJECTION_DIM = 512  # transformers.CLIPConfig's default
DEFAULT_INPUT_SIDE = 224  # CLIPImageProcessor's default crop (openai's ViT-B and ViT-L/14)
# The processor's settings: preprocessor_config.json (transformers 4), or the image_processor entry of
# processor_config.json (transformers 5 saves them there).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


@dataclass(frozen=True)
class ClipConfig:
    path: Path
    projection_dim: int
    input_side: int = DEFAULT_INPUT_SIDE  # the square the processor feeds the vision tower


def _side(settings: dict[str, Any]) -> int | None:
    crop = settings.get("crop_size")
    if isinstance(crop, dict):
        crop = crop.get("height")
    if isinstance(crop, int) and not isinstance(crop, bool) and crop > 0:
        return crop
    size = settings.get("size")
    if isinstance(size, dict):
        size = size.get("shortest_edge", size.get("height"))
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def input_side(path: Path) -> int:
    """The side of the images the CLIP processor feeds its vision tower (its crop size): what the
    evaluation shrinks images to beyond the grid's rows, since the processor would anyway."""
    for name in PROCESSOR_FILES:
        try:
            settings = json.loads((path / name).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        if isinstance(settings, dict):
            nested = settings.get("image_processor")
            side = _side(nested if isinstance(nested, dict) else settings)
            if side is not None:
                return side
    return DEFAULT_INPUT_SIDE


@dataclass
class ClipModel:
    """The loaded model and processor; `projection_dim` is the feature dimension KID and FID see."""

    model: Any  # transformers.CLIPModel, in eval mode, on `device`
    processor: Any  # transformers.CLIPProcessor
    projection_dim: int
    device: str


def check_clip_dir(path: Path) -> ClipConfig:
    """--clip_model_dir holds a CLIP config; its projection dimension."""
    flag = f"--clip_model_dir {path}"
    if not path.is_dir():
        raise ClipModelError(f"{flag} does not exist or is not a folder; {CLIP_FIX}")
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ClipModelError(f"{flag} holds no config.json; {CLIP_FIX}") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ClipModelError(f"{flag}: config.json is not readable JSON ({exc}); {CLIP_FIX}") from exc
    if not isinstance(config, dict) or not (
        config.get("model_type") == "clip" or ("text_config" in config and "vision_config" in config)
    ):
        kind = config.get("model_type") if isinstance(config, dict) else type(config).__name__
        raise ClipModelError(f"{flag}: config.json describes a {kind!r} model, not a CLIP model; {CLIP_FIX}")
    dim = config.get("projection_dim", DEFAULT_PROJECTION_DIM)
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
        raise ClipModelError(f"{flag}: config.json's projection_dim {dim!r} is not a positive integer; {CLIP_FIX}")
    return ClipConfig(path, dim, input_side(path))


def load_clip(config: ClipConfig, device: str) -> ClipModel:
    """The model and processor from the folder, nothing from a hub, in float32 (the scores should
    not depend on a precision), in eval mode, on `device`."""
    from transformers import CLIPModel, CLIPProcessor

    try:
        model = CLIPModel.from_pretrained(config.path, local_files_only=True)
        processor = CLIPProcessor.from_pretrained(config.path, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for a bad folder
        raise ClipModelError(
            f"--clip_model_dir {config.path}: the CLIP model does not load ({type(exc).__name__}: {exc}); {CLIP_FIX}"
        ) from exc
    model = model.float().eval().to(device)
    return ClipModel(model, processor, config.projection_dim, device)
