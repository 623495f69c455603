"""Stable Diffusion 3.5 (Large, Large Turbo, Medium): SD 3's pipeline and parts (two CLIP encoders
and T5, optional as for SD 3), whose transformer normalises queries and keys (`qk_norm`) and, in
Medium, has a second attention in its first blocks (`dual_attention_layers`). diffusers 0.29's
SD3Transformer2DModel has neither, so it trains on the second stack only.

Prompt encoding, the VAE's shift and scale and the preconditioned rectified-flow loss are SD 3's
(the `sd3` family, subclassed). What diffusers 0.42.1's examples/dreambooth/
train_dreambooth_lora_sd3.py, the script that trains SD 3.5, does otherwise, followed here:
- timesteps are drawn logit-normally (its default `weighting_scheme=logit_normal`, mean 0, std 1:
  the SD 3 paper's choice, which favours the middle of the schedule), and then weighted 1
  (`compute_loss_weighting_for_sd3` for that scheme) where 0.29's script weighted sigma ** -2;
- its LoRA adapts the joint attention's text-side projections too (`add_{q,k,v}_proj`,
  `to_add_out`), which 0.29's left out.
"""

from __future__ import annotations

from typing import Any

from sdflow_image.families import flow
from sdflow_image.families.sd3 import StableDiffusion3


class StableDiffusion35(StableDiffusion3):
    name = "sd35"
    # train_dreambooth_lora_sd3.py's default target_modules, as written there: `attn.` keeps
    # Medium's second attention (`attn2`, dual_attention_layers) out of the adapter.
    lora_targets = (
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
        "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
    )  # fmt: skip

    def sample_timesteps(self, scheduler: Any, batch: int, device: Any, generator: Any) -> tuple[Any, Any]:
        return flow.sample_sigmas(scheduler, batch, device, generator, flow.LOGIT_NORMAL)

    def loss_weighting(self, sigmas: Any) -> Any:
        import torch

        return torch.ones_like(sigmas)


FAMILY = StableDiffusion35()
