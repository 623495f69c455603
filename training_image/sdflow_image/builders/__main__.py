"""`python -m sdflow_image.builders OUT_DIR [--family F]`: build a tiny pipeline of any family in
code (tiny_model's SD, tiny_families' SDXL and SD 3, tiny_families_next's SD 3.5, FLUX.2 and Qwen-Image).
Its own module so that tiny_model, which the family builders import, imports none of them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sdflow_image.builders.tiny import build_tiny


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sdflow_image.builders",
        description="Build a tiny Stable Diffusion pipeline offline in diffusers format.",
    )
    parser.add_argument("out_dir", type=Path, help="folder to write the pipeline to (created)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random weights (default 0)")
    parser.add_argument(
        "--vae_steps", type=int, default=0, help="fit the VAE to scene images for N steps first (default 0: random)"
    )
    parser.add_argument(
        "--family",
        choices=("sd", "sdxl", "sd3", "sd35", "flux2", "qwenimage"),
        default="sd",
        help="model family (default sd; sd35, flux2 and qwenimage on the second stack)",
    )
    parser.add_argument(
        "--clip",
        action="store_true",
        help="build a tiny CLIPModel folder instead (the evaluation's CLIP score and KID; builders.tiny_clip)",
    )
    parser.add_argument(
        "--clip_steps", type=int, default=0, help="with --clip: fit it to the scenes for N steps first (default 0)"
    )
    args = parser.parse_args(argv)
    if args.vae_steps < 0 or args.clip_steps < 0:
        parser.error(f"--vae_steps and --clip_steps must be >= 0, got {args.vae_steps} and {args.clip_steps}")
    if args.clip:
        from sdflow_image.builders.tiny_clip import build_tiny_clip

        print(build_tiny_clip(args.out_dir, seed=args.seed, train_steps=args.clip_steps))
        return 0
    path = build_tiny(args.family, args.out_dir, seed=args.seed, vae_steps=args.vae_steps)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
