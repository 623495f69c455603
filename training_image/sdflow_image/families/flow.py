"""The flow-matching pieces diffusers 0.42.1's training scripts share (train_dreambooth_lora_sd3.py,
train_dreambooth_lora_flux2_klein.py, train_dreambooth_lora_qwen_image.py), written so that every
draw comes from the run's generator: the scripts call `compute_density_for_timestep_sampling`,
which draws from torch's global generator, and a resumed run could not repeat its steps.

- `sample_sigmas`: u in [0, 1) per sample (uniform for `weighting_scheme="none"`, the FLUX.2 and
  Qwen-Image scripts' default; a sigmoid of a normal for `"logit_normal"`, the SD 3 script's), the
  index `u * num_train_timesteps` into the training scheduler's timesteps, and the sigma at that
  index (the scripts' `get_sigmas` looks the timestep up again to find the same index).
- the noisy input `(1 - sigma) * x0 + sigma * noise`; the weighting of both schemes is 1
  (`compute_loss_weighting_for_sd3`), so the loss is a plain mean squared error.
- `drop_captions`: caption dropout as the scripts' `--caption_dropout` (the prompt replaced by the
  empty prompt's), on the token ids and their attention mask alike.
"""

from __future__ import annotations

from typing import Any

UNIFORM = "none"
LOGIT_NORMAL = "logit_normal"


def sample_sigmas(
    scheduler: Any, batch: int, device: Any, generator: Any, scheme: str = UNIFORM, mean: float = 0.0, std: float = 1.0
) -> tuple[Any, Any]:
    """(timesteps, sigmas) of `batch` draws on the training schedule (each shape (batch,))."""
    import torch

    if scheme == LOGIT_NORMAL:
        u = torch.sigmoid(torch.normal(mean, std, size=(batch,), generator=generator, device=device))
    elif scheme == UNIFORM:
        u = torch.rand(batch, generator=generator, device=device)
    else:
        raise ValueError(f"weighting scheme {scheme!r}: {UNIFORM} or {LOGIT_NORMAL}")
    indices = (u * scheduler.config.num_train_timesteps).long().clamp_(max=len(scheduler.timesteps) - 1)
    timesteps = scheduler.timesteps.to(device)[indices]
    sigmas = scheduler.sigmas.to(device=device, dtype=torch.float32)[indices]
    return timesteps, sigmas


def noised(latents: Any, scheduler: Any, generator: Any) -> tuple[Any, Any, Any]:
    """(noise, timesteps, noisy input) of one step on the uniform schedule: the noise drawn first,
    then the timesteps, the order a resumed run must repeat."""
    import torch

    noise = torch.randn(latents.shape, generator=generator, device=latents.device, dtype=latents.dtype)
    timesteps, sigmas = sample_sigmas(scheduler, latents.shape[0], latents.device, generator)
    return noise, timesteps, noisy(latents, noise, sigmas)


def noisy(latents: Any, noise: Any, sigmas: Any) -> Any:
    """`(1 - sigma) * x0 + sigma * noise`, sigma broadcast over each sample's dimensions."""
    s = sigmas.reshape(-1, *([1] * (latents.ndim - 1))).to(latents.dtype)
    return (1.0 - s) * latents + s * noise


def mse(pred: Any, target: Any) -> Any:
    """The scripts' loss with weighting 1: each sample's mean squared error, then the batch's mean."""
    return ((pred.float() - target.float()) ** 2).reshape(target.shape[0], -1).mean(dim=1).mean()


def drop_captions(
    batch: dict[str, Any], empty: dict[str, Any], device: Any, generator: Any, proportion: float
) -> dict[str, Any]:
    """`batch`'s tensors named in `empty` on `device`, a `proportion` of the rows (one draw for all
    keys) replaced by `empty`'s row (the empty caption's ids and mask)."""
    import torch

    rows = {key: batch[key].to(device, non_blocking=True) for key in empty}
    if proportion <= 0:
        return rows
    first = next(iter(rows.values()))
    dropped = torch.rand(first.shape[0], generator=generator, device=device) < proportion
    return {key: torch.where(dropped[:, None], empty[key].to(device)[None, :], value) for key, value in rows.items()}
