"""Memory before money, after training: the peak GPU memory of the evaluation job and of the endpoint.

Both run a diffusers pipeline on one GPU (`pipe.to("cuda")`: the pipeline is not sharded, so only the memory of
one GPU counts, whatever the instance's count). What each holds at once (read from the image's code):

    evaluation  one whole pipeline at a time: sdflow_image.evaluation.adherence.compare renders the trained model,
                drops it (`del pipe`, gc, torch.cuda.empty_cache) and only then loads the base; a LoRA model is the
                base with its adapter attached. Both load as the endpoint serves them
                (evaluation.evaluate.EVALUATION_DTYPE "auto": serving.serve_model.serving_dtype on a GPU, bf16 or
                fp16): 2 bytes a parameter (EVALUATION_BYTES).
    endpoint    one pipeline, in the served dtype: bf16 or fp16 on a GPU (serving.serve_model.serving_dtype),
                2 bytes a parameter (SERVING_BYTES).

The weights are the family's reference model (memory_estimate.FAMILIES: denoiser + text encoders + VAE; without
SD 3's T5 when the model has none). A LoRA adapter is a few MB and is left out.

Activations (assumed, not measured): a forward pass without gradients keeps no activations for a backward, so
what it adds at its peak is the VAE decode of the image, at the image's resolution (the decoder's full-resolution
feature maps of 128 channels and its mid-block attention: VAE_DECODE_GIB at 512 px in half precision) and one
denoiser step over a classifier-free-guidance pair (DENOISER_STEP_GIB for SD 1.5's UNet at 512 px, scaled by the
denoiser's size as the training estimate scales its activations), both x (resolution / 512)² and x 2 in float32.
The evaluation job also holds the CLIP model of `evaluation.clip_model_uri` (the CLIP score's and KID's image and
text features) beside the pipeline, in float32 (CLIP_BYTES, transformers' default dtype): its parameters are
counted from the safetensors headers of its weight files (Validate run reads them with ranged GETs,
evaluation_checks.read_clip_model), or, for a pytorch_model.bin folder, taken as the files' sizes. Its
activations (a ViT forward over a batch of small images) are left out, as small beside the VAE decode's.
The fit test keeps memory_estimate.CUDA_RESERVE_GIB free, as the training estimate does."""

from __future__ import annotations

from dataclasses import dataclass, replace

from sdflow_common import memory_estimate
from sdflow_common.memory_estimate import GIB, REFERENCE_RESOLUTION, SD3_T5, SD15_DENOISER, T5_FAMILIES

EVALUATION_BYTES = 2  # evaluate.EVALUATION_DTYPE "auto": the served dtype, bf16 or fp16 on a GPU
SERVING_BYTES = 2  # serve_model.serving_dtype on a GPU: bf16 or fp16
VAE_DECODE_GIB = 1.0  # assumed: the VAE decode's peak at 512 px in half precision
DENOISER_STEP_GIB = 0.1  # assumed: one SD 1.5 UNet step over a guidance pair at 512 px, half precision
CLIP_BYTES = 4  # the evaluation's CLIP model in float32


@dataclass(frozen=True)
class InferenceEstimate:
    weights_gib: float
    activations_gib: float
    clip_gib: float = 0.0  # the evaluation's CLIP model, beside the pipeline

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.activations_gib + self.clip_gib

    def breakdown(self) -> str:
        clip = f", CLIP model {self.clip_gib:.1f}" if self.clip_gib else ""
        return f"weights {self.weights_gib:.1f}{clip}, VAE decode and one denoising step {self.activations_gib:.1f}"


def estimate(
    family: str, resolution: int, bytes_per_param: int, *, variant: str = "", with_t5: bool = True
) -> InferenceEstimate:
    """One pipeline's peak on one GPU, in GiB (see the module docstring)."""
    model = memory_estimate.reference(family, variant)
    parameters = model.denoiser + model.frozen
    if family in T5_FAMILIES and not with_t5:
        parameters -= SD3_T5
    scale = (resolution / REFERENCE_RESOLUTION) ** 2 * bytes_per_param / 2
    activations = (VAE_DECODE_GIB + DENOISER_STEP_GIB * model.denoiser / SD15_DENOISER) * scale
    return InferenceEstimate(weights_gib=parameters * bytes_per_param / GIB, activations_gib=activations)


def evaluation_estimate(
    family: str, resolution: int, *, clip_bytes: int = 0, variant: str = "", with_t5: bool = True
) -> InferenceEstimate:
    """The evaluation job's peak on one GPU: one pipeline at a time (EVALUATION_BYTES) plus the CLIP model's
    `clip_bytes` of float32 weights (0: no CLIP model)."""
    found = estimate(family, resolution, EVALUATION_BYTES, variant=variant, with_t5=with_t5)
    return replace(found, clip_gib=clip_bytes / GIB)
