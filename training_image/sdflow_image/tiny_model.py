"""A tiny Stable Diffusion pipeline built entirely offline, for tests and the demo.

Nothing comes from a hub: the UNet (~1M parameters), VAE and CLIP text encoder are
randomly initialised from small configs and the tokenizer's BPE vocabulary is learned
in code from a handful of captions. The result is saved in the diffusers layout with
safetensors, so the code that loads a real base model (`from_pretrained(dir,
local_files_only=True)`, whole or per subfolder) loads this one unchanged.

CLI: `python -m sdflow_image.tiny_model OUT_DIR [--seed N]`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

# Captions the BPE merges are learned from; the synthetic test images use the same words,
# so test captions tokenize into real merged tokens rather than single bytes.
CAPTIONS: tuple[str, ...] = (
    "a red square on a blue background",
    "a green circle on a white background",
    "a blue square on a red background",
    "a yellow circle on a black background",
    "a white square on a green background",
    "a black circle on a yellow background",
    "a red circle and a blue square",
    "a photo of a small green square",
)
TOKENIZER_MAX_LENGTH = 16
NUM_BPE_MERGES = 60
IMAGE_SIZE = 64  # pixels; the VAE downsamples by 2, so the UNet's sample_size is 32


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


def build_tiny_components(seed: int = 0) -> dict[str, Any]:
    """The pipeline's components, randomly initialised from `seed` (deterministic)."""
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(seed)
    # The tokenizer keeps its vocabulary in memory and writes it on save, so a temp dir is enough.
    with tempfile.TemporaryDirectory(prefix="sdflow-tiny-bpe-") as tok_dir:
        vocab_file, merges_file, vocab_size = write_clip_bpe(tok_dir)
        # transformers 4.51's (slow) CLIPTokenizer reads both files here, at construction.
        tokenizer = CLIPTokenizer(
            vocab_file=str(vocab_file), merges_file=str(merges_file), model_max_length=TOKENIZER_MAX_LENGTH
        )
    unet = UNet2DConditionModel(
        sample_size=IMAGE_SIZE // 2,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=32,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(32, 64),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=IMAGE_SIZE,
    )
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


def build_tiny_pipeline(out_dir: str | Path, seed: int = 0) -> Path:
    """Build the tiny pipeline and save it (diffusers layout, safetensors) to `out_dir`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from diffusers import StableDiffusionPipeline

    out = Path(out_dir)
    pipe: Any = StableDiffusionPipeline(
        **build_tiny_components(seed),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sdflow_image.tiny_model",
        description="Build a tiny Stable Diffusion pipeline offline in diffusers format.",
    )
    parser.add_argument("out_dir", type=Path, help="folder to write the pipeline to (created)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random weights (default 0)")
    args = parser.parse_args(argv)
    path = build_tiny_pipeline(args.out_dir, seed=args.seed)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
