"""A tiny CLIP model built offline, for the evaluation's CLIP score and KID in tests and the demo.

The evaluation job loads any transformers `CLIPModel` folder (`evaluation.clip_model_uri`: openai's
ViT-L/14, LAION's, a preference model such as PickScore) with its processor, from disk. This builds
one of the same shape, small: a ViT image tower on 32-pixel images and a text tower over the scene
captions' BPE (`tiny_model.write_clip_bpe`), saved with `save_pretrained` beside its
`CLIPProcessor` (tokenizer + image processor), so the job's real loading path reads it unchanged.

Random weights score nothing; so that the demo's scores mean something, `train_steps` fits it to the
demo's scenes contrastively (CLIP's symmetric InfoNCE over image-caption pairs drawn with
`scenes.draw`), on the CPU: after it, a scene image's embedding is nearest its own caption's, so a
model that draws what its prompt asks scores above one that does not.

CLI: `python -m sdflow_image.builders OUT_DIR --clip [--clip_steps N]`."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
from typing import Any

from sdflow_image import scenes
from sdflow_image.builders.tiny_model import CAPTIONS, TOKENIZER_MAX_LENGTH, clip_tokenizer, write_clip_bpe

IMAGE_SIZE = 32  # the demo's training resolution: the processor resizes anything else to it
PATCH_SIZE = 8
EMBED_DIM = 32  # projection_dim: the features KID and FID are computed on
TRAIN_BATCH = 64
TRAIN_LEARNING_RATE = 3e-3
TRAIN_POOL = 1024  # scene images drawn once and sampled from, each step
DEFAULT_TRAIN_STEPS = 300
# CLIP's processor normalises with OpenAI's dataset statistics; the tiny model keeps them, so the
# image path is the real one.
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def build_clip_model(seed: int = 0) -> tuple[Any, Any]:
    """(CLIPModel, CLIPProcessor), randomly initialised from `seed` (deterministic)."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix="sdflow-tiny-clip-bpe-") as tok_dir:
        _, _, vocab_size = write_clip_bpe(tok_dir, CAPTIONS)
        tokenizer = clip_tokenizer(tok_dir)
    config = CLIPConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": TOKENIZER_MAX_LENGTH,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "image_size": IMAGE_SIZE,
            "patch_size": PATCH_SIZE,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
        },
        projection_dim=EMBED_DIM,
    )
    model: Any = CLIPModel(config)
    model.eval()
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
    )
    return model, CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)


def _scene_pairs(count: int, seed: int) -> tuple[list[Any], list[str]]:
    rnd = random.Random(seed)
    every = scenes.all_scenes()
    chosen = [rnd.choice(every) for _ in range(count)]
    return [scenes.draw(scene, IMAGE_SIZE, IMAGE_SIZE, rnd) for scene in chosen], [s.caption for s in chosen]


def fit_to_scenes(model: Any, processor: Any, steps: int, seed: int = 0) -> float:
    """Train `model` contrastively on scene image-caption pairs for `steps` AdamW steps (CLIP's own
    loss: `return_loss=True`); returns the last loss. Captions repeat within a batch (there are 192
    scenes), which the loss counts as negatives: it still separates colours and shapes, which is all
    the demo's scores read."""
    import torch

    images, captions = _scene_pairs(TRAIN_POOL, seed)
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    tokens = processor.tokenizer(captions, padding="max_length", max_length=TOKENIZER_MAX_LENGTH, return_tensors="pt")
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=TRAIN_LEARNING_RATE)
    loss = torch.zeros(())
    model.train()
    for _ in range(steps):
        pick = torch.randint(0, TRAIN_POOL, (TRAIN_BATCH,), generator=generator)
        out = model(
            input_ids=tokens["input_ids"][pick],
            attention_mask=tokens["attention_mask"][pick],
            pixel_values=pixels[pick],
            return_loss=True,
        )
        loss = out.loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return float(loss)


def build_tiny_clip(out_dir: str | Path, seed: int = 0, train_steps: int = 0) -> Path:
    """Write a CLIPModel folder (config.json, model.safetensors, the processor's files) to `out_dir`;
    `train_steps` > 0 fits it to the scenes first (see the module docstring)."""
    out = Path(out_dir)
    model, processor = build_clip_model(seed)
    if train_steps > 0:
        fit_to_scenes(model, processor, train_steps, seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    return out
