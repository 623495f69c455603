"""Training throughput: our `train` (Booster + streaming webdataset loader, through
`sdflow_image.training.train.main`) against a plain diffusers + torch loop, side by side.

Both use the same tiny model (built offline), the same webdataset shards and the SAME
loader (`sdflow_image.training.data.make_dataloader`), so the ratio measures what train adds around
the step: the Booster (torch_ddp, world of one), the loss all-reduce/stop bookkeeping, the
per-step logging. Both sides time each optimizer step (data wait included) and report
batch / median step time, and the best round of each side is compared: on a shared
machine, other load only ever slows a round down, so the best round is the closest to
what each side can do (all rounds are printed too).
Setup and the first (warm-up) step are excluded on both sides.

usage: python bench/bench_train.py [--steps 40] [--batch 4] [--resolution 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "training_image"), str(REPO / "tests" / "image")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from train_fixtures import write_dataset_channel  # noqa: E402

from sdflow_image.builders.tiny_model import build_tiny_pipeline  # noqa: E402
from sdflow_image.training import train  # noqa: E402
from sdflow_image.training.data import make_dataloader  # noqa: E402


def plain_loop(base: Path, dataset: Path, steps: int, batch: int, resolution: int, workers: int) -> float:
    """diffusers' text-to-image step with plain torch: no Booster, no process group."""
    import torch
    import torch.nn.functional as F
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    torch.manual_seed(0)
    kw = {"local_files_only": True}
    tokenizer = CLIPTokenizer.from_pretrained(base, subfolder="tokenizer", **kw)
    text_encoder = CLIPTextModel.from_pretrained(base, subfolder="text_encoder", **kw).requires_grad_(False).eval()
    vae = AutoencoderKL.from_pretrained(base, subfolder="vae", **kw).requires_grad_(False).eval()
    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet", **kw).train()
    scheduler = DDPMScheduler.from_pretrained(base, subfolder="scheduler", **kw)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4, weight_decay=1e-2)
    data_args = SimpleNamespace(
        dataset_dir=str(dataset),
        dataset_index="index.json",
        resolution=resolution,
        train_batch_size=batch,
        dataloader_num_workers=workers,
        interleave_shards=4,
        seed=0,
        center_crop=True,
        random_flip=False,
    )
    loader = make_dataloader(data_args, tokenizer, rank=0, world_size=1)
    batches = iter(loader)
    step_times = []
    for step in range(steps):
        start = time.perf_counter()
        b = next(batches)
        with torch.no_grad():
            latents = vae.encode(b["pixel_values"]).latent_dist.sample() * vae.config.scaling_factor
            hidden = text_encoder(b["input_ids"], return_dict=False)[0]
        noise = torch.randn_like(latents)
        t = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],)).long()
        pred = unet(scheduler.add_noise(latents, noise, t), t, hidden, return_dict=False)[0]
        loss = F.mse_loss(pred.float(), noise.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        print(f"step={step + 1} loss={loss.item():.6f}", file=io.StringIO())  # same per-step sync as ours
        step_times.append(time.perf_counter() - start)
    return batch / statistics.median(step_times[1:])


def ours(base: Path, dataset: Path, work: Path, steps: int, batch: int, resolution: int, workers: int) -> float:
    args = train.parse_args(
        [
            f"--pretrained_model_name_or_path={base}",
            f"--dataset_dir={dataset}",
            f"--output_dir={work / 'model'}",
            f"--checkpoints_dir={work / 'checkpoints'}",
        ],
        hyperparameters={
            "plugin": "torch_ddp",
            "resolution": str(resolution),
            "train_batch_size": str(batch),
            "max_train_steps": str(steps),
            "checkpointing_steps": str(steps * 10),
            "learning_rate": "1e-4",
            "validation_prompts": '["a red square"]',
            "validation_inference_steps": "1",
            "dataloader_num_workers": str(workers),
            "interleave_shards": "4",
        },
    )
    with contextlib.redirect_stdout(io.StringIO()):
        summary = train.main(args)
    return float(summary["median_samples_per_second"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per measurement")
    parser.add_argument("--batch", type=int, default=4, help="batch size")
    parser.add_argument("--resolution", type=int, default=64, help="image size")
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers (both sides)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds; the best of each side is compared")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sdflow-bench-train-") as tmp:
        root = Path(tmp)
        base = build_tiny_pipeline(root / "base")
        dataset = write_dataset_channel(root / "dataset", shards=4, samples_per_shard=32)
        plain_runs, our_runs = [], []
        for r in range(a.rounds):
            plain_runs.append(plain_loop(base, dataset, a.steps, a.batch, a.resolution, a.workers))
            our_runs.append(ours(base, dataset, root / f"run{r}", a.steps, a.batch, a.resolution, a.workers))
            print(f"round {r + 1}: plain {plain_runs[-1]:.1f} samples/s, train {our_runs[-1]:.1f} samples/s")
    plain, mine = max(plain_runs), max(our_runs)
    print(
        f"tiny SD, {a.resolution}px, batch {a.batch}, {a.steps} steps, {a.workers} loader worker(s), CPU\n"
        f"plain diffusers+torch loop : {plain:8.1f} samples/s\n"
        f"sdflow train (Booster)     : {mine:8.1f} samples/s\n"
        f"ratio train/plain          : {mine / plain:8.3f}  (goal >= 0.95)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
