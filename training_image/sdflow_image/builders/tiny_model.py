"""A tiny Stable Diffusion pipeline built entirely offline, for tests and the demo.

Nothing comes from a hub: the UNet (~1M parameters), VAE and CLIP text encoder are built in
code from small configs and the tokenizer's BPE vocabulary is learned in code from the scene
captions (`sdflow_image.scenes`). The result is saved in the diffusers layout with safetensors,
so the code that loads a real base model (`from_pretrained(dir, local_files_only=True)`, whole
or per subfolder) loads this one unchanged.

A base model is more than random weights: a real one brings a VAE that reconstructs images and
a text encoder whose features tell words apart, and fine-tuning teaches the UNet. So that the
demo's fine-tuning can visibly learn in minutes on a CPU, the base model gets the same:
- the VAE is fitted here to reconstruct scene images (`vae_steps`; 0 keeps it random, which is
  all most tests need), and its `scaling_factor` is set from its latents' spread, as SD's was;
- the text encoder's token and position embeddings are drawn large and its layers start close to
  the identity, so each word and its place in the caption stay distinct in its output;
- the UNet pools the text into its time embedding too (`addition_embed_type="text"`, as
  DeepFloyd IF and Kandinsky do), besides cross-attention at the inner level: colours are
  global properties of an image, which that path carries directly (measured: held-out prompt
  adherence 0.85 after 600 steps of batch 64, against 0.62 after 900 steps of batch 32 with
  cross-attention alone at every level, which also costs twice the time per step on a CPU).
The UNet stays random: the untrained model follows prompts no better than chance.

CLI: `python -m sdflow_image.builders OUT_DIR [--seed N] [--vae_steps N] [--family ...]`
(builders/__main__.py; SDXL and SD3: sdflow_image.builders.tiny_families).
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from sdflow_image import scenes

# Captions the BPE merges are learned from: every scene caption, so each word of the grammar
# is one token and a caption is 7 tokens (+ start and end), well within TOKENIZER_MAX_LENGTH.
CAPTIONS: tuple[str, ...] = (*(scene.caption for scene in scenes.all_scenes()), "a photo of a cat")
TOKENIZER_MAX_LENGTH = 16
NUM_BPE_MERGES = 120
IMAGE_SIZE = 32  # pixels; the VAE downsamples by 4, so the UNet's sample_size is 8
VAE_SCALE = 4
VAE_BATCH = 16
VAE_LEARNING_RATE = 2e-3
TOKEN_EMBEDDING_STD = 1.0
POSITION_EMBEDDING_STD = 0.5
TEXT_LAYER_SCALE = 0.1  # residual branches start at a tenth: the encoder is close to the identity


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2/CLIP byte→printable-character table that CLIPTokenizer assumes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


def _merge_pair(symbols: tuple[str, ...], a: str, b: str) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if i < len(symbols) - 1 and symbols[i] == a and symbols[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)


def write_clip_bpe(
    out_dir: str | Path, corpus: tuple[str, ...] = CAPTIONS, num_merges: int = NUM_BPE_MERGES
) -> tuple[Path, Path, int]:
    """Learn a CLIP-style BPE (end-of-word suffix `</w>`) on `corpus`; write vocab.json and merges.txt.

    Every byte is in the base vocabulary, so any text tokenizes (unknown words fall back
    to byte symbols). Returns (vocab path, merges path, vocabulary size)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    byte_to_char = _bytes_to_unicode()
    chars = list(byte_to_char.values())
    vocab: list[str] = chars + [c + "</w>" for c in chars]
    words: Counter[tuple[str, ...]] = Counter()
    for line in corpus:
        for word in line.lower().split():
            symbols = tuple(byte_to_char[b] for b in word.encode("utf-8"))
            words[(*symbols[:-1], symbols[-1] + "</w>")] += 1
    merges: list[str] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for symbols, freq in words.items():
            for pair in itertools.pairwise(symbols):
                pairs[pair] += freq
        if not pairs:
            break
        (a, b), _freq = pairs.most_common(1)[0]
        merges.append(f"{a} {b}")
        vocab.append(a + b)
        merged: Counter[tuple[str, ...]] = Counter()
        for symbols, freq in words.items():
            merged[_merge_pair(symbols, a, b)] += freq
        words = merged
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    vocab_ids = {tok: i for i, tok in enumerate(dict.fromkeys(vocab))}
    vocab_path, merges_path = out / "vocab.json", out / "merges.txt"
    vocab_path.write_text(json.dumps(vocab_ids, ensure_ascii=False), encoding="utf-8")
    merges_path.write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    return vocab_path, merges_path, len(vocab_ids)


def tiny_vae(**extra: Any) -> Any:
    """The tiny models' VAE (every family's: SD 3 passes its own shift and scaling factors)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 32),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=IMAGE_SIZE,
        **extra,
    )


def clip_tokenizer(folder: str | Path) -> Any:
    """The CLIPTokenizer of the vocab.json and merges.txt in `folder` (write_clip_bpe), read at once.
    Through from_pretrained: transformers 5 (the accelerate stack) renamed the constructor's
    vocab_file/merges_file to vocab/merges and silently builds a two-token vocabulary from the old
    names; the files read the same way on both stacks (the same ids on 4.51 and 5)."""
    from transformers import CLIPTokenizer

    return CLIPTokenizer.from_pretrained(str(folder), model_max_length=TOKENIZER_MAX_LENGTH)


def build_tiny_components(seed: int = 0) -> dict[str, Any]:
    """The pipeline's components, randomly initialised from `seed` (deterministic)."""
    import torch
    from diffusers import DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    # The tokenizer keeps its vocabulary in memory and writes it on save, so a temp dir is enough.
    with tempfile.TemporaryDirectory(prefix="sdflow-tiny-bpe-") as tok_dir:
        _, _, vocab_size = write_clip_bpe(tok_dir)
        tokenizer = clip_tokenizer(tok_dir)
    unet = UNet2DConditionModel(
        sample_size=IMAGE_SIZE // VAE_SCALE,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=32,
        addition_embed_type="text",
        addition_embed_type_num_heads=4,
    )
    vae = tiny_vae()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=TOKENIZER_MAX_LENGTH,
            projection_dim=32,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    _separate_words(text_encoder)
    # Stable Diffusion v1's training schedule, so the train job's code path is the real one.
    scheduler = DDPMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        clip_sample=False,
    )
    return {
        "unet": unet,
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": scheduler,
    }


def _separate_words(text_encoder: Any) -> None:
    """Large token and position embeddings and near-identity layers (see the module docstring)."""
    import torch

    # transformers 5 (the accelerate stack) dropped CLIPTextModel's `text_model` wrapper.
    text_model = getattr(text_encoder, "text_model", text_encoder)
    embeddings = text_model.embeddings
    with torch.no_grad():
        embeddings.token_embedding.weight.normal_(0.0, TOKEN_EMBEDDING_STD)
        embeddings.position_embedding.weight.normal_(0.0, POSITION_EMBEDDING_STD)
        for layer in text_model.encoder.layers:
            for branch_out in (layer.self_attn.out_proj, layer.mlp.fc2):
                branch_out.weight.mul_(TEXT_LAYER_SCALE)
                branch_out.bias.mul_(TEXT_LAYER_SCALE)


def fit_vae(vae: Any, steps: int, seed: int = 0, size: int = IMAGE_SIZE) -> float:
    """Fit the VAE to reconstruct scene images for `steps` AdamW steps; set its scaling_factor
    so the latents have unit spread (SD's 0.18215 came from the same measurement). Returns the
    last reconstruction loss (MSE in [-1, 1] pixels)."""
    import random

    import numpy as np
    import torch
    import torch.nn.functional as F

    rnd = random.Random(seed)
    every = scenes.all_scenes()
    pixels = np.stack(
        [np.asarray(scenes.draw(rnd.choice(every), size, size, rnd), dtype=np.float32) for _ in range(512)]
    )
    images = torch.from_numpy(pixels / 127.5 - 1.0).permute(0, 3, 1, 2).contiguous()
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=VAE_LEARNING_RATE)
    loss = torch.zeros(())
    vae.train()
    for _ in range(steps):
        batch = images[torch.randint(0, len(images), (VAE_BATCH,), generator=generator)]
        posterior = vae.encode(batch).latent_dist
        reconstruction = vae.decode(posterior.sample(generator=generator)).sample
        loss = F.mse_loss(reconstruction, batch) + 1e-6 * posterior.kl().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    vae.eval()
    with torch.no_grad():
        spread = float(vae.encode(images).latent_dist.mean.std())
    vae.register_to_config(scaling_factor=1.0 / spread)
    return float(loss)


def build_tiny_pipeline(out_dir: str | Path, seed: int = 0, vae_steps: int = 0) -> Path:
    """Build the tiny pipeline and save it (diffusers layout, safetensors) to `out_dir`;
    `vae_steps` > 0 fits the VAE first (see `fit_vae`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from diffusers import DPMSolverMultistepScheduler, StableDiffusionPipeline

    out = Path(out_dir)
    components = build_tiny_components(seed)
    if vae_steps:
        fit_vae(components["vae"], vae_steps, seed)
    # Inference takes DPM-Solver (good images in ~20 steps) on the training schedule's betas;
    # training reads the same config as a DDPMScheduler, as diffusers' examples do with SD's PNDM.
    components["scheduler"] = DPMSolverMultistepScheduler.from_config(components["scheduler"].config)
    pipe: Any = StableDiffusionPipeline(
        **components,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    return out
