"""Memory before money: the peak GPU memory a training run needs, estimated before any job starts.

Validate run (and start_pipeline, through validate_run.check_inputs) refuses a run whose estimate
does not fit its instance type's GPUs, naming what to change. The estimate is per GPU:

    states   the trained weights, their gradients and Adam's two moments, per plugin x precision:
             torch_ddp     20 B/param: fp32 weights, gradients, Adam m and v (16) and DDP's gradient
                           buckets (4; torch's default gradient_as_bucket_view=False copies them);
             low_level_zero (ZeRO stage 2, as the image builds it) 2 B/param of half-precision working
                           weights on every GPU + 16 B/param (fp32 master, m, v, fp32 gradient) / N;
             gemini        (static placement, nothing offloaded) 16 B/param / N: chunks of half weights
                           and gradients, fp32 master, m and v, all sharded across the N GPUs;
             fp32 ("no"): working weights are the masters (low_level_zero 4 + 12/N B/param);
             the accelerate backend's plugins (torch's own DDP and FSDP2):
             ddp           20 B/param, everything replicated, as torch_ddp;
             fsdp2         16 B/param / N: fp32 sharded parameters, gradients (reduce_dtype fp32) and
                           Adam's m and v, all sharded across the N GPUs; plus, unsharded for the
                           moment a block runs, two blocks' parameters in the training precision and
                           their fp32 gradients (the block that runs and the one prefetched:
                           FSDP_TRANSIENT_BLOCKS x (2 + 4) B x the LARGEST block's parameters) and the
                           root unit's (what no block holds: embedders, final layers), gathered for the
                           whole step; with gradient_accumulation_steps > 1 on several GPUs, a whole
                           fp32 gradient of every trained parameter (4 B/param, not divided by N:
                           `accumulated_gradient_bytes`).
    frozen   the denoiser's buffers (fp32, never sharded: SD 3.5's positional table, 0.9 GB in Medium);
             what does not train, in the training precision (fp32 with "no"): VAE and text
             encoders (SD 3's T5, 4.8 B, only when model_index.json names one); with LoRA also
             the whole denoiser (UNet / SD 3 transformer).
             FSDP2 shards only what trains: the frozen text encoder(s) and VAE are whole on every GPU.
    EMA      an fp32 copy of the trained weights (use_ema; refused with fsdp2).
    acts     activations: per sample at 512 px, the family's traced figure (Family.activation_gib) where
             there is one, else ACTIVATION_GIB_PER_SAMPLE x the denoiser's size relative to SD 1.5; x
             (resolution / 512)² x batch; x TRACED_LORA_SHARE for LoRA (traced families); x the
             gradient-checkpointing share (TRACED_CHECKPOINTING_SHARE, measured, for traced families;
             GRADIENT_CHECKPOINTING_SHARE, assumed, for the rest); x 2 in fp32. Under ddp and fsdp2 at
             least AdamW's foreach temporary (4 B per local trained parameter), which the step
             allocates once the activations are freed.

N is every GPU of the job (GPUs per instance x training.instance_count): both sharding plugins shard
across the whole data-parallel group. The fit test keeps CUDA_RESERVE_GIB of each GPU for the CUDA
context and the caching allocator's fragmentation: the figures are `torch.cuda.max_memory_allocated`,
which counts neither (as the GPU acceptance measures: training/loop.py `_peak_gpu_memory_gib`).

Calibration (README "GPU acceptance", one H100, SD 1.5 at full size, 512 px, batch 4, bf16, no gradient
checkpointing): low_level_zero with EMA measured 20.01 GiB, gemini without EMA 15.85 GiB. The one
free constant, activations per sample, is fitted to those two rows (0.58 GiB), so they check the
split between states and activations, not the model as a whole: the estimate gives 20.33 (+1.6 %)
and 15.52 (-2.1 %). Nothing else here has been measured on a GPU: SDXL, SD 3, LoRA, torch_ddp,
fp16, fp32 and gradient checkpointing are the rules above with stated assumptions, no more.

Traced, not measured (bench/trace_memory.py: torch's memory trackers count a step of the published
model on fake tensors, on a CPU; README "Families x methods x plugins x precisions"): the accelerate
backend's FLUX.2 [klein] 4B and 9B, SD 3.5 Medium and Qwen-Image rows. They set those families' activations, the
LoRA and checkpointing shares and FSDP2's root and largest block, and the estimate stays within 0.9-1.15
of them (tests/image_accelerate/test_memory_trace.py holds FLUX.2 [klein] 4B's two rows). SD 3.5 Large
is not traced yet: its activations follow the SD 1.5 rule, which gave a third of FLUX.2's traced
activations, so its estimate is likely low."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from sdflow_common.instance_types import GPU_INSTANCES, Gpu, runs_on

# The GPU table moved to instance_types (one table for training, evaluation and endpoints); kept importable here.
from sdflow_common.instance_types import gpu_of as gpu_of

GIB = 1024**3
# Fitted to the GPU acceptance's two SD 1.5 rows (see the module docstring): half precision, 512², no
# gradient checkpointing, one sample, SD 1.5's UNet.
ACTIVATION_GIB_PER_SAMPLE = 0.58
REFERENCE_RESOLUTION = 512
# Assumed, not measured: the share of activation memory left with gradient checkpointing (diffusers'
# models checkpoint each transformer / resnet block and keep only the block inputs).
GRADIENT_CHECKPOINTING_SHARE = 0.35
# Measured (bench/trace_memory.py --gradient-checkpointing): the share of the traced activations left
# with gradient checkpointing in the transformer families (diffusers checkpoints each block and keeps
# its inputs), where the trace gives them.
TRACED_CHECKPOINTING_SHARE = 0.55  # FLUX.2 [klein] 4B, fsdp2, 512 px: 7.57 of 13.64 GiB
# Measured likewise (the lora ddp row against the full fsdp2 row of FLUX.2 [klein] 4B, 512 px: 5.53 of 13.64
# GiB): a frozen Linear keeps no input for the backward (only its weight's gradient would need it), so a
# LoRA run keeps the adapted layers' inputs and the nonlinearities' only.
TRACED_LORA_SHARE = 0.41
# Kept free on every GPU: the CUDA context (~0.5 GiB) and the caching allocator's fragmentation.
CUDA_RESERVE_GIB = 1.0
ADAM_AND_MASTER_BYTES = 16  # fp32 master (or gradient) 4 + Adam m 4 + v 4 + fp32 gradient 4
HALF_BYTES, FULL_BYTES = 2, 4
# FSDP2 gathers a block's parameters before it runs and prefetches the next (torch's fully_shard default):
# two blocks unsharded at a time, each with its parameters in the training precision and fp32 gradients
# until they are reduce-scattered. Assumed, not measured.
FSDP_TRANSIENT_BLOCKS = 2
ACCELERATE_PLUGINS = ("ddp", "fsdp2")


@dataclass(frozen=True)
class Family:
    """Parameter counts of a family's reference model (diffusers' configs of the released weights)."""

    label: str
    denoiser: float  # trained by a full run: the UNet, or SD 3's transformer
    frozen: float  # VAE and text encoders
    lora_per_rank: float  # LoRA parameters per unit of rank on the default targets (to_q/k/v/out.0)
    text_lora_per_rank: float  # the same on the CLIP text encoder(s) (q/k/v/out_proj)
    blocks: int = 0  # the denoiser's transformer blocks: FSDP2 shards (and gathers) one at a time
    largest_block: float = 0.0  # parameters of the largest (FLUX.2's double blocks are twice its single ones)
    root: float = 0.0  # parameters outside the blocks: FSDP2's root unit, gathered for the whole step
    buffers: float = 0.0  # bytes of the denoiser's buffers (fp32, never sharded): SD 3.5's positional table
    # Activations of one sample at 512 px in half precision without gradient checkpointing, in GiB, as
    # traced (bench/trace_memory.py: the Activation and Temp of the full fsdp2 row's peak); 0: the SD 1.5
    # calibration scaled by the denoiser's size (ACTIVATION_GIB_PER_SAMPLE).
    activation_gib: float = 0.0


# SD 1.5: UNet 859.5 M, CLIP ViT-L text encoder 123.1 M, VAE 83.7 M (SD 2.x: UNet 865.9 M and an
# OpenCLIP ViT-H text encoder of 340.4 M, 0.4 GiB more frozen in half precision). SDXL base 1.0: UNet
# 2,567.5 M, CLIP ViT-L 123.1 M + OpenCLIP ViT-bigG 694.7 M, VAE 83.7 M. SD 3 medium: transformer
# 2,028.3 M, CLIP-L 123.7 M + CLIP-G 694.7 M + T5-XXL encoder 4,762.3 M, VAE 83.8 M (SD 3.5 large's
# transformer is 8.1 B: not told apart by model_index.json, so a 3.5 large run is underestimated).
# LoRA per rank, counted from the attention layers' shapes: SD 1.5 16 transformer blocks (r·(14·C + 2·768)
# each over C = 320/640/1280), SDXL 70 (cross-attention width 2048), SD 3 24 joint blocks of width 1536.
SD3_T5 = 4762.3e6
FAMILIES = {
    "sd": Family("SD 1.x/2.x", 859.5e6, 123.1e6 + 83.7e6, 199_296, 73_728),
    "sdxl": Family("SDXL", 2567.5e6, 123.1e6 + 694.7e6 + 83.7e6, 1_451_520, 401_408),
    "sd3": Family("SD 3", 2028.3e6, 123.7e6 + 694.7e6 + SD3_T5 + 83.8e6, 294_912, 401_408),
}
# The accelerate backend's families, each model counted from its published config (diffusers 0.42.1's classes
# built on the meta device; the LoRA counts the same way, r·(in + out) over every to_q/to_k/to_v/to_out.0):
# - SD 3.5 Large (and Large Turbo): transformer 8,056.6 M (38 joint blocks of width 2432, qk_norm rms_norm; the
#   "8.1 B" of Stability's model card). SD 3.5 Medium: 2,243.2 M (24 blocks of width 1536, dual attention in
#   the first 13; Stability says "2.5 B", counting otherwise). Text encoders and VAE are SD 3's.
# - FLUX.2 [klein] 4B: Flux2Transformer2DModel 3,875.5 M (5 double + 20 single blocks of width 3072,
#   joint_attention_dim 7680), text encoder Qwen3-4B 4,022.5 M (Qwen3ForCausalLM, tied embeddings).
#   FLUX.2 [klein] 9B: 9,078.6 M (8 double + 24 single blocks of width 4096, joint_attention_dim 12288), text
#   encoder Qwen3-8B 8,190.7 M. VAE AutoencoderKLFlux2 84.0 M. (Black Forest Labs: "4B" / "9B"; NVIDIA's
#   model card of the 4B: transformer ~4 B + Qwen3 ~4 B.)
# - Qwen-Image: QwenImageTransformer2DModel 20,430.4 M (60 blocks of width 3072: the "20B MMDiT"), text
#   encoder Qwen2.5-VL-7B-Instruct 8,292.2 M (its vision tower, 676.6 M, included: the pipeline loads the whole
#   model), VAE AutoencoderKLQwenImage 126.9 M.
# The text encoders are decoders of a chat model, not CLIP: their LoRA is not offered (text_lora_per_rank 0).
SD3_VAE_AND_CLIP = 123.7e6 + 694.7e6 + 83.8e6
# The traced activations (the last field, GiB at 512 px): FLUX.2's from its full fsdp2 rows; SD 3.5 Medium's
# from its lora ddp row (2.01 GiB / TRACED_LORA_SHARE), since its fsdp2 trace peaks outside the backward with
# 12.6 GiB the tracker files as activations, the signature of its overcount of foreach ops on fake DTensors
# (bench/memory_trace.py), while one of its blocks keeps 158 MiB (24 blocks: 3.7 GiB). Qwen-Image's likewise
# from its lora ddp row (7.23 GiB / TRACED_LORA_SHARE; its fsdp2 trace has the same signature). SD 3.5 Large,
# not traced yet, keeps 0: the SD 1.5 rule.
# Blocks as backends/accelerate.py `shard_units` finds them, on the meta device: the largest block's and the
# root's parameters and the buffers' bytes (SD 3.5's pos_embed table, pos_embed_max_size² x width in fp32).
FAMILIES |= {
    "sd35": Family("SD 3.5 Large", 8056.6e6, SD3_VAE_AND_CLIP + SD3_T5, 739_328, 0.0, 38, 213.0e6, 39.6e6, 358.6e6),
    "sd35-medium": Family(
        "SD 3.5 Medium", 2243.2e6, SD3_VAE_AND_CLIP + SD3_T5, 454_656, 0.0, 24, 101.5e6, 19.5e6, 906.0e6, 4.9
    ),
    "flux2": Family("FLUX.2 [klein] 9B", 9078.6e6, 8190.7e6 + 84.0e6, 262_144, 0.0, 32, 436.2e6, 354.4e6, 0, 24.74),
    "flux2-4b": Family("FLUX.2 [klein] 4B", 3875.5e6, 4022.5e6 + 84.0e6, 122_880, 0.0, 25, 245.4e6, 195.0e6, 0, 13.64),
    "qwenimage": Family("Qwen-Image", 20430.4e6, 8292.2e6 + 126.9e6, 1_474_560, 0.0, 60, 339.8e6, 40.5e6, 0, 17.6),
}
# Families saved with SD 3's optional T5 encoder ("text_encoder_3" in model_index.json).
T5_FAMILIES = ("sd3", "sd35")
SD15_DENOISER = FAMILIES["sd"].denoiser


def reference(family: str, variant: str = "") -> Family:
    """The reference model of a family's variant (model_family reads the variant from transformer/config.json):
    "" is the family's largest, so an unknown variant is not underestimated."""
    return FAMILIES.get(f"{family}-{variant}", FAMILIES[family]) if variant else FAMILIES[family]


@dataclass(frozen=True)
class Setup:
    """What the estimate depends on (a run document's training block plus the base model's family)."""

    family: str
    method: str  # full | lora
    plugin: str  # torch_ddp | low_level_zero | gemini (colossalai); ddp | fsdp2 (accelerate)
    precision: str  # no | fp16 | bf16
    batch: int
    resolution: int
    gradient_checkpointing: bool = False
    use_ema: bool = False
    lora_rank: int = 4
    text_encoder_lora: bool = False
    gpus: int = 1  # every GPU of the job: the data-parallel group the sharding plugins shard across
    with_t5: bool = True  # SD 3 saved without T5 (model_index.json "text_encoder_3": [null, null])
    variant: str = ""  # the family's model: "" its largest, "medium" (SD 3.5), "4b" (FLUX.2 [klein])
    gradient_accumulation_steps: int = 1

    @property
    def model(self) -> Family:
        return reference(self.family, self.variant)


@dataclass(frozen=True)
class Estimate:
    states_gib: float
    frozen_gib: float
    ema_gib: float
    activations_gib: float

    @property
    def total_gib(self) -> float:
        return self.states_gib + self.frozen_gib + self.ema_gib + self.activations_gib

    def breakdown(self) -> str:
        return (
            f"weights, gradients and optimizer {self.states_gib:.1f}, frozen parts {self.frozen_gib:.1f}, "
            f"EMA {self.ema_gib:.1f}, activations {self.activations_gib:.1f}"
        )


def state_bytes_per_param(plugin: str, precision: str, gpus: int) -> float:
    """Bytes per trained parameter on one GPU: weights, gradients, Adam (see the module docstring)."""
    if plugin in ("torch_ddp", "ddp"):
        return 20.0
    if plugin == "fsdp2":  # the fp32 parameters are the masters whatever the precision: nothing else is kept
        return ADAM_AND_MASTER_BYTES / gpus
    if plugin == "gemini":
        return ADAM_AND_MASTER_BYTES / gpus
    if precision == "no":  # low_level_zero in fp32: the working weights are the masters
        return FULL_BYTES + 12 / gpus
    return HALF_BYTES + ADAM_AND_MASTER_BYTES / gpus


def accumulated_gradient_bytes(setup: Setup) -> float:
    """FSDP2's unsharded gradients kept between the micro-batches of one update: 4 B x every trained
    parameter on every GPU, not divided by N. The backend skips the gradient sync on the micro-batches
    before the last (backends/accelerate.py `no_sync`: `set_requires_gradient_sync(False)`, only with
    more than one GPU, backends/base.py `skips_sync`); torch 2.15's `FSDPParamGroup.post_backward` then
    neither reduce-scatters nor frees the gradients: `_set_unsharded_grad_dtypes(defer_upcast=False)`
    upcasts each to the parameter's `unsharded_grad_dtype` (the policy's reduce_dtype, fp32) and the
    whole-shaped gradient stays on `_unsharded_param.grad` (`FSDPParam.unsharded_accumulated_grad`)
    after the parameters are resharded, until the last micro-batch reduces it."""
    if setup.plugin != "fsdp2" or setup.gradient_accumulation_steps < 2 or setup.gpus < 2:
        return 0.0
    return FULL_BYTES * trained_parameters(setup)


def fsdp_transient_bytes(setup: Setup, half: int) -> float:
    """What FSDP2 holds whole at its peak (early in the backward): the root unit's parameters (fully_shard's
    root keeps them gathered from forward to backward) and FSDP_TRANSIENT_BLOCKS blocks (the one that runs
    and the one prefetched) in the training precision, and one block's gradients, in that precision and
    as the fp32 reduce-scatter input. Blocks are counted at the LARGEST block's size: FLUX.2's double
    blocks are twice its single ones."""
    family = setup.model
    if setup.method != "full":  # LoRA under fsdp2 is refused before the estimate; an average share
        return (half + FULL_BYTES) * FSDP_TRANSIENT_BLOCKS * trained_parameters(setup) / max(family.blocks, 1)
    block = family.largest_block or family.denoiser / max(family.blocks, 1)
    return half * (family.root + FSDP_TRANSIENT_BLOCKS * block) + (half + FULL_BYTES) * block


def trained_parameters(setup: Setup) -> float:
    family = setup.model
    if setup.method == "full":
        return family.denoiser
    text = family.text_lora_per_rank if setup.text_encoder_lora else 0.0
    return (family.lora_per_rank + text) * setup.lora_rank


def estimate(setup: Setup) -> Estimate:
    """Peak GPU memory per GPU, in GiB, split into its parts."""
    family = setup.model
    frozen_bytes = FULL_BYTES if setup.precision == "no" else HALF_BYTES
    trained = trained_parameters(setup)
    frozen = family.frozen + (family.denoiser if setup.method == "lora" else 0.0)
    if setup.family in T5_FAMILIES and not setup.with_t5:
        frozen -= SD3_T5
    states = trained * state_bytes_per_param(setup.plugin, setup.precision, setup.gpus)
    ema = trained * FULL_BYTES if setup.use_ema else 0.0
    # The kept gradients stand in for the sharded ones (4/N B/param, counted above), which appear only as
    # the last micro-batch reduce-scatters them and frees the kept ones, block by block.
    kept = accumulated_gradient_bytes(setup)
    states += kept - (FULL_BYTES * trained / setup.gpus if kept else 0.0)
    if setup.plugin == "fsdp2":
        states += fsdp_transient_bytes(setup, frozen_bytes)

    traced = family.activation_gib > 0
    share = TRACED_CHECKPOINTING_SHARE if traced else GRADIENT_CHECKPOINTING_SHARE
    activations = (
        (family.activation_gib if traced else ACTIVATION_GIB_PER_SAMPLE * family.denoiser / SD15_DENOISER)
        * (setup.resolution / REFERENCE_RESOLUTION) ** 2
        * setup.batch
        * (share if setup.gradient_checkpointing else 1.0)
        * (TRACED_LORA_SHARE if traced and setup.method == "lora" else 1.0)
        * (2.0 if setup.precision == "no" else 1.0)
    )
    if setup.plugin in ACCELERATE_PLUGINS:
        # torch's AdamW on CUDA parameters takes the foreach path, whose step allocates one fp32 temporary of
        # the (local) trained parameters (torch/optim/adam.py `_multi_tensor_adam`: `exp_avg_sq_sqrt =
        # torch._foreach_sqrt(device_exp_avg_sqs)`), once the backward has freed the activations: the peak
        # is the larger of the two.
        shards = setup.gpus if setup.plugin == "fsdp2" else 1
        activations = max(activations, FULL_BYTES * trained / shards / GIB)
    return Estimate(
        states_gib=states / GIB,
        frozen_gib=(frozen * frozen_bytes + family.buffers) / GIB,
        ema_gib=ema / GIB,
        activations_gib=activations,
    )


def usable_gib(gpu: Gpu) -> float:
    return gpu.gib - CUDA_RESERVE_GIB


def fits(setup: Setup, gpu: Gpu) -> bool:
    return estimate(setup).total_gib <= usable_gib(gpu)


def largest_fitting_batch(setup: Setup, gpu: Gpu) -> int:
    """The largest batch below the setup's that fits (0: not even one sample)."""
    batch = setup.batch - 1
    while batch > 0 and not fits(_with(setup, batch=batch), gpu):
        batch -= 1
    return batch


def _with(setup: Setup, **changes: Any) -> Setup:
    return replace(setup, **changes)


def bigger_instance(setup: Setup, current: Gpu, instance_count: int) -> str | None:
    """The instance type with the least GPU memory above the current one's that fits (same count), among those the
    run's image starts on and, for a bf16 run, whose GPUs compute in bf16 (instance_types)."""
    backend = "accelerate" if setup.plugin in ACCELERATE_PLUGINS else "colossalai"
    candidates = sorted(
        (gpu.gib, gpu.count, name)
        for name, gpu in GPU_INSTANCES.items()
        if gpu.gib > current.gib
        and runs_on(name, backend)
        and (gpu.bf16 or setup.precision != "bf16")
        and fits(_with(setup, gpus=gpu.count * instance_count), gpu)
    )
    return candidates[0][2] if candidates else None


MAX_INSTANCE_COUNT = 64  # training.instance_count's maximum


def more_instances(setup: Setup, gpu: Gpu, instance_count: int) -> int | None:
    """The fewest instances of this type above the current count that shard the run small enough (FSDP2)."""
    for count in range(instance_count + 1, MAX_INSTANCE_COUNT + 1):
        if fits(_with(setup, gpus=gpu.count * count), gpu):
            return count
    return None


def _smaller_batch(setup: Setup, gpu: Gpu, batch: int) -> str:
    """A smaller batch, with the accumulation steps that keep the samples per update where that still
    fits: under fsdp2 on several GPUs accumulating keeps a whole fp32 gradient per GPU
    (`accumulated_gradient_bytes`), which may not."""
    samples = setup.batch * setup.gradient_accumulation_steps
    steps = -(-samples // batch)
    if fits(_with(setup, batch=batch, gradient_accumulation_steps=steps), gpu):
        return (
            f"training.train_batch_size {batch} with training.gradient_accumulation_steps {steps} (about the same "
            "samples per update)"
        )
    kept = accumulated_gradient_bytes(_with(setup, gradient_accumulation_steps=steps)) / GIB
    return (
        f"training.train_batch_size {batch} (fewer samples per update: accumulating {steps} steps under fsdp2 "
        f"keeps an unsharded fp32 gradient of {kept:.1f} GiB on every GPU, which does not fit)"
    )


def remedies(setup: Setup, gpu: Gpu, instance_count: int) -> list[str]:
    """What would make the run fit, each change alone, as run-document fields."""
    found: list[str] = []
    batch = largest_fitting_batch(setup, gpu)
    if batch > 0:
        found.append(_smaller_batch(setup, gpu, batch))
    if not setup.gradient_checkpointing and fits(_with(setup, gradient_checkpointing=True), gpu):
        found.append("training.gradient_checkpointing true")
    if setup.use_ema and fits(_with(setup, use_ema=False), gpu):
        found.append("training.use_ema false")
    sharding, lora_plugin = ("fsdp2", "ddp") if setup.plugin in ACCELERATE_PLUGINS else ("gemini", "torch_ddp")
    if setup.method == "full" and setup.plugin != sharding and fits(_with(setup, plugin=sharding), gpu):
        found.append(f"training.plugin {sharding} (shards weights and optimizer state across the {setup.gpus} GPU(s))")
    if setup.method == "full" and fits(_with(setup, method="lora", plugin=lora_plugin, use_ema=False), gpu):
        found.append(f"training.method lora (with plugin {lora_plugin})")
    if setup.plugin == "fsdp2":
        more = more_instances(setup, gpu, instance_count)
        if more is not None:
            found.append(f"training.instance_count {more} (FSDP2 shards across every GPU of every instance)")
    larger = bigger_instance(setup, gpu, instance_count)
    if larger is not None:
        found.append(f"training.instance_type {larger} ({GPU_INSTANCES[larger].name})")
    return found
