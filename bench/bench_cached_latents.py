"""cache_latents: training steps with each image and caption encoded once against encoding them
at every step, side by side, plus the saving counted for SD 1.5 at 512².

1. Measured, on this CPU, with the tiny model: `sdflow_image.training.train.main` over the same shards,
   several epochs, `cache_latents` off and on in alternating rounds; the best round of each side
   is compared (other load only slows a round down). Samples/s is the median step's, so the
   first epoch (which fills the cache) weighs little once the run is a few epochs long.
2. Counted, for SD 1.5 at 512² (no weights: shapes on the meta device, FLOPs by
   torch.utils.flop_counter): per sample, the VAE encoder and the text encoder forward against
   the UNet forward + backward. That share of a step's arithmetic is what the cache removes
   after the first epoch on a GPU, where the step is compute-bound.

usage: python bench/bench_cached_latents.py [--steps 60] [--batch 8] [--resolution 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "training_image"), str(REPO / "tests" / "image"), str(REPO)]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from train_fixtures import write_dataset_channel  # noqa: E402

from sdflow_image.builders import random_sd15  # noqa: E402
from sdflow_image.builders.tiny_model import build_tiny_pipeline  # noqa: E402
from sdflow_image.training import train  # noqa: E402


def run(base: Path, dataset: Path, work: Path, a: argparse.Namespace, cache: bool) -> dict[str, Any]:
    args = train.parse_args(
        [
            f"--pretrained_model_name_or_path={base}",
            f"--dataset_dir={dataset}",
            f"--output_dir={work / 'model'}",
            f"--checkpoints_dir={work / 'checkpoints'}",
        ],
        hyperparameters={
            "plugin": "torch_ddp",
            "resolution": str(a.resolution),
            "train_batch_size": str(a.batch),
            "max_train_steps": str(a.steps),
            "checkpointing_steps": str(a.steps * 10),
            "learning_rate": "1e-4",
            "validation_prompts": '["a red square"]',
            "validation_inference_steps": "1",
            "dataloader_num_workers": "1",
            "interleave_shards": "4",
            "cache_latents": str(cache).lower(),
        },
    )
    with contextlib.redirect_stdout(io.StringIO()):
        return train.main(args)


def sd15_flops_per_sample() -> dict[str, float]:
    """GFLOPs per 512² sample: VAE encoder, text encoder (forward), UNet (forward + backward)."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import CLIPTextConfig, CLIPTextModel

    def counted(work: Any) -> float:
        with FlopCounterMode(display=False) as counter:
            work()
        return counter.get_total_flops() / 1e9

    with torch.device("meta"):
        unet: Any = UNet2DConditionModel(**random_sd15.UNET_CONFIG).train()
        vae: Any = AutoencoderKL(**random_sd15.VAE_CONFIG).eval()
        text: Any = CLIPTextModel(CLIPTextConfig(**random_sd15.TEXT_CONFIG)).eval()
        pixels = torch.randn(1, 3, 512, 512)
        ids = torch.zeros(1, 77, dtype=torch.long)
        latents, hidden, t = torch.randn(1, 4, 64, 64), torch.randn(1, 77, 768), torch.tensor([500])

        def unet_step() -> None:
            unet(latents, t, hidden, return_dict=False)[0].float().pow(2).mean().backward()

        with torch.no_grad():
            vae_gflops = counted(lambda: vae.encode(pixels))
            text_gflops = counted(lambda: text(ids))
        unet_gflops = counted(unet_step)
    return {"vae_encoder": vae_gflops, "text_encoder": text_gflops, "unet_fwd_bwd": unet_gflops}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    parser.add_argument("--batch", type=int, default=8, help="batch size")
    parser.add_argument("--resolution", type=int, default=64, help="image size (tiny model)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best of each side is compared")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sdflow-bench-cache-") as tmp:
        root = Path(tmp)
        base = build_tiny_pipeline(root / "base")
        dataset = write_dataset_channel(root / "dataset", shards=4, samples_per_shard=16, image_size=a.resolution)
        best: dict[bool, float] = {False: 0.0, True: 0.0}
        for r in range(a.rounds):
            for cache in (False, True):
                summary = run(base, dataset, root / f"run{r}-{cache}", a, cache)
                rate = float(summary["median_samples_per_second"])
                best[cache] = max(best[cache], rate)
                print(f"round {r + 1}: cache_latents={str(cache).lower():5} {rate:8.1f} samples/s "
                      f"(cache: {summary['latent_cache']})", flush=True)  # fmt: skip
    epochs = a.steps * a.batch / 64
    print(
        f"tiny SD, {a.resolution}px, batch {a.batch}, {a.steps} steps over 64 samples ({epochs:.1f} epochs), CPU\n"
        f"encode every step : {best[False]:8.1f} samples/s\n"
        f"cache_latents     : {best[True]:8.1f} samples/s\n"
        f"ratio cached/uncached: {best[True] / best[False]:.3f}"
    )
    flops = sd15_flops_per_sample()
    encode = flops["vae_encoder"] + flops["text_encoder"]
    total = encode + flops["unet_fwd_bwd"]
    print(
        f"SD 1.5 at 512², GFLOPs per sample: VAE encoder {flops['vae_encoder']:.0f}, text encoder "
        f"{flops['text_encoder']:.1f}, UNet forward+backward {flops['unet_fwd_bwd']:.0f}\n"
        f"share of a step that cache_latents removes after the first epoch: {encode / total:.1%} "
        f"(steps up to {total / flops['unet_fwd_bwd']:.2f}x faster where compute-bound)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
