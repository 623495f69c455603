"""GPU acceptance: every Colossal-AI plugin x mixed precision on a full-size SD 1.5 UNet.

For each plugin (torch_ddp, low_level_zero, gemini) and precision (fp16, bf16) it builds
Stable Diffusion 1.5's UNet from its config (written out below: random weights, nothing
downloaded), the optimizer and Booster exactly as training does
(`sdflow_image.training.model.build_optimizer` / `make_booster`), and runs a fixed number
of optimizer steps on random latents (4x64x64, SD 1.5 at 512^2) and text embeddings
(77x768) against random noise targets (MSE). It prints samples/s and peak GPU memory per
combination, and Gemini's peak memory as a fraction of torch_ddp's at the same batch.

    torchrun --nproc_per_node=N bench/gpu_acceptance.py --steps 20 --batch-size 4
    python bench/gpu_acceptance.py --plugins gemini --precisions bf16   # one GPU, one pair

Exit status: 0 every combination ran with a finite loss; 1 one did not (its row says why);
2 bad arguments, or no CUDA device (one line says so).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "training_image"))

from sdflow_image import flags  # noqa: E402  (no torch: the CPU exit path stays light)

PLUGINS = ("torch_ddp", "low_level_zero", "gemini")
PRECISIONS = ("fp16", "bf16")
EXIT_NO_CUDA = 2
GIB = 1024**3

# runwayml/stable-diffusion-v1-5 unet/config.json, the keys that shape the model
# (the rest are UNet2DConditionModel's defaults). 859,520,964 parameters.
SD15_UNET_CONFIG: dict[str, Any] = {
    "sample_size": 64,
    "in_channels": 4,
    "out_channels": 4,
    "center_input_sample": False,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    "block_out_channels": (320, 640, 1280, 1280),
    "layers_per_block": 2,
    "downsample_padding": 1,
    "mid_block_scale_factor": 1,
    "act_fn": "silu",
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "cross_attention_dim": 768,
    "attention_head_dim": 8,
}
SD15_UNET_PARAMETERS = 859_520_964
LATENT_SHAPE = (4, 64, 64)
TEXT_SHAPE = (77, 768)
NUM_TRAIN_TIMESTEPS = 1000


@dataclass
class Result:
    plugin: str
    precision: str
    batch_per_gpu: int
    gpus: int
    steps: int
    samples_per_s: float = math.nan
    peak_allocated_gib: float = math.nan  # max over ranks of torch.cuda.max_memory_allocated
    peak_reserved_gib: float = math.nan
    start_allocated_gib: float = math.nan  # left over from earlier combinations (should be ~0)
    final_loss: float = math.nan
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and math.isfinite(self.final_loss)


_positive_int = flags.argparse_type(flags.positive_int)
_non_negative_int = flags.argparse_type(flags.non_negative_int)


def _choices(allowed: tuple[str, ...]) -> Any:
    def parse(value: str) -> list[str]:
        picked = [v.strip() for v in value.split(",") if v.strip()]
        unknown = [v for v in picked if v not in allowed]
        if unknown or not picked:
            raise argparse.ArgumentTypeError(f"{value!r}: use a comma-separated subset of {','.join(allowed)}")
        return list(dict.fromkeys(picked))

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/gpu_acceptance.py",
        description="Each plugin x mixed precision on a full-size SD 1.5 UNet: samples/s and peak GPU memory.",
    )
    parser.add_argument("--steps", type=_positive_int, default=20, help="timed optimizer steps per combination")
    parser.add_argument(
        "--warmup-steps",
        type=_non_negative_int,
        default=3,
        help="untimed steps first (kernel autotuning, Gemini's first-step memory tracing, AMP's first scales)",
    )
    parser.add_argument("--batch-size", type=_positive_int, default=4, help="samples per GPU per step")
    parser.add_argument(
        "--plugins", type=_choices(PLUGINS), default=list(PLUGINS), help=f"comma-separated, of {','.join(PLUGINS)}"
    )
    parser.add_argument(
        "--precisions",
        type=_choices(PRECISIONS),
        default=list(PRECISIONS),
        help=f"comma-separated, of {','.join(PRECISIONS)}",
    )
    parser.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute UNet activations in backward (less memory)"
    )
    parser.add_argument("--learning-rate", type=float, default=1e-5, help="AdamW learning rate")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm, as in training")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and inputs")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here as JSON (rank 0)")
    return parser.parse_args(argv)


def cuda_missing_reason() -> str | None:
    """One line saying why this machine cannot run the bench, or None when it can."""
    import torch

    if not torch.cuda.is_available():
        return (
            "gpu_acceptance: a CUDA device is needed (torch.cuda.is_available() is False on this machine); "
            "run it on a GPU host, see the README's 'GPU acceptance'"
        )
    return None


def _free_device_memory() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _reduce(value: float, op: str) -> float:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(tensor, op={"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}[op])
    return float(tensor.item())


def run_combination(plugin: str, precision: str, args: argparse.Namespace, world_size: int) -> Result:
    """Build, boost and time one plugin x precision; every rank returns the same Result."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from diffusers import UNet2DConditionModel

    from sdflow_image.training.model import autocast_dtype, build_optimizer, loop_clips_gradients, make_booster

    result = Result(plugin, precision, args.batch_size, world_size, args.steps)
    _free_device_memory()
    result.start_allocated_gib = _reduce(torch.cuda.memory_allocated() / GIB, "max")
    torch.manual_seed(args.seed)
    # On the CPU, as training loads it; each plugin moves it (Gemini chunk by chunk).
    unet: Any = UNet2DConditionModel(**SD15_UNET_CONFIG)
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    unet.train()
    optimizer = build_optimizer(
        plugin, unet.parameters(), lr=args.learning_rate, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8
    )
    booster = make_booster(plugin, precision, max_grad_norm=args.max_grad_norm)
    model, optimizer, *_ = booster.boost(unet, optimizer)

    rank = dist.get_rank()
    generator = torch.Generator(device="cuda").manual_seed(args.seed + rank)
    b = args.batch_size

    def randn(*shape: int) -> Any:
        return torch.randn(shape, generator=generator, device="cuda")

    # fp32 inputs: the ZeRO plugins' wrappers cast them to their precision, torch_ddp's AMP autocasts.
    latents, hidden, target = randn(b, *LATENT_SHAPE), randn(b, *TEXT_SHAPE), randn(b, *LATENT_SHAPE)
    timesteps = torch.randint(0, NUM_TRAIN_TIMESTEPS, (b,), generator=generator, device="cuda")
    cast = autocast_dtype(plugin, precision)

    def step() -> Any:
        with torch.autocast("cuda", dtype=cast, enabled=cast is not None):
            prediction = model(latents, timesteps, hidden, return_dict=False)[0]
        loss = F.mse_loss(prediction.float(), target)
        booster.backward(loss, optimizer)
        if loop_clips_gradients(plugin, args.max_grad_norm):
            optimizer.clip_grad_by_norm(args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    for _ in range(args.warmup_steps):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    elapsed = _reduce(time.perf_counter() - started, "max")
    result.samples_per_s = args.steps * b * world_size / elapsed
    result.final_loss = _reduce(float(loss.float().item()), "sum") / world_size
    result.peak_allocated_gib = _reduce(torch.cuda.max_memory_allocated() / GIB, "max")
    result.peak_reserved_gib = _reduce(torch.cuda.max_memory_reserved() / GIB, "max")
    return result


def gemini_fractions(results: list[Result]) -> dict[str, float]:
    """Per precision: Gemini's peak allocated memory / torch_ddp's, where both ran."""
    by_key = {(r.plugin, r.precision): r for r in results if r.ok}
    fractions = {}
    for precision in PRECISIONS:
        gemini, ddp = by_key.get(("gemini", precision)), by_key.get(("torch_ddp", precision))
        if gemini and ddp and ddp.peak_allocated_gib > 0:
            fractions[precision] = gemini.peak_allocated_gib / ddp.peak_allocated_gib
    return fractions


def report(results: list[Result]) -> str:
    header = (
        f"{'plugin':<15}{'precision':<10}{'batch/GPU':>10}{'GPUs':>6}{'steps':>7}{'samples/s':>11}"
        f"{'peak alloc GiB':>16}{'peak resv GiB':>15}{'start GiB':>11}{'loss':>9}  status"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        status = "ok" if r.ok else f"FAILED: {r.error or f'loss {r.final_loss}'}"
        lines.append(
            f"{r.plugin:<15}{r.precision:<10}{r.batch_per_gpu:>10}{r.gpus:>6}{r.steps:>7}{r.samples_per_s:>11.2f}"
            f"{r.peak_allocated_gib:>16.2f}{r.peak_reserved_gib:>15.2f}{r.start_allocated_gib:>11.2f}"
            f"{r.final_loss:>9.4f}  {status}"
        )
    fractions = gemini_fractions(results)
    for precision in PRECISIONS:
        if precision in fractions:
            b, gpus = results[0].batch_per_gpu, results[0].gpus
            lines.append(
                f"gemini peak memory / torch_ddp peak memory ({precision}, batch {b}/GPU, {gpus} GPU): "
                f"{fractions[precision]:.2f}"
            )
    return "\n".join(lines)


def _environment_line(world_size: int) -> str:
    import colossalai
    import diffusers
    import torch

    return (
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), colossalai {colossalai.__version__}, "
        f"diffusers {diffusers.__version__}; {world_size} x {torch.cuda.get_device_name()}"
    )


def run_all(args: argparse.Namespace) -> list[Result]:
    import torch.distributed as dist

    world_size = dist.get_world_size()
    rank0 = dist.get_rank() == 0
    if rank0:
        print(_environment_line(world_size), flush=True)
    results = []
    for plugin in args.plugins:
        for precision in args.precisions:
            try:
                result = run_combination(plugin, precision, args, world_size)
            except Exception as exc:
                if world_size > 1:
                    raise  # the other ranks may be waiting in a collective: let torchrun stop them all
                traceback.print_exc()
                result = Result(plugin, precision, args.batch_size, world_size, args.steps)
                result.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            results.append(result)
            if rank0:
                print(f"{plugin} {precision}: {asdict(result)}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = cuda_missing_reason()
    if reason:
        print(reason, file=sys.stderr)
        return EXIT_NO_CUDA
    import torch.distributed as dist

    from sdflow_image.training.loop import distributed

    with distributed(args.seed, cuda=True):
        results = run_all(args)
        if dist.get_rank() == 0:
            print(report(results), flush=True)
            if args.json:
                summary = {"results": [asdict(r) for r in results], "gemini_fraction_of_ddp": gemini_fractions(results)}
                args.json.write_text(json.dumps(summary, indent=2))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
