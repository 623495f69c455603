"""The one table of SageMaker GPU instance types: what each has, and which of the two images runs there and why.

Validate run reads it for the training, evaluation and endpoint instances alike (model_family.check_instances):
the memory estimates (memory_estimate) take a GPU's memory and count from here, the checks take its compute
capability, bf16 and host driver.

GPUs (Amazon SageMaker pricing and the EC2 accelerated-computing instance pages: GPU model, GPUs per instance,
memory per GPU as nvidia-smi reports it; compute capability from NVIDIA's CUDA GPUs list):

    g4dn  T4 16 GB     cc 7.5  no bf16        p3    V100 16 GB   cc 7.0  no bf16
    g5    A10G 24 GB   cc 8.6                 p3dn  V100 32 GB   cc 7.0  no bf16
    g6    L4 24 GB     cc 8.9                 p4d   A100 40 GB   cc 8.0
    g6e   L40S 48 GB   cc 8.9                 p4de  A100 80 GB   cc 8.0
    p5    H100 80 GB   cc 9.0                 p5e / p5en  H200 141 GB  cc 9.0

bf16 tensor cores came with Ampere (compute capability 8.0): T4 (Turing) and V100 (Volta) have none.

Host drivers, where AWS documents them: only for inference hosts ("Best practices to minimize interruptions
during GPU driver upgrades", docs.aws.amazon.com/sagemaker/latest/dg/inference-gpu-drivers.html, real-time
inference: NVIDIA 470 / CUDA 11.4 on ml.p3, ml.p4d, ml.p4de, ml.g4dn, ml.g5; 535 / CUDA 12.2 on ml.p5, ml.g6;
550 / CUDA 12.4 on ml.p5e, ml.p5en; ml.g6e is not listed). `ProductionVariant.InferenceAmiVersion` picks
another host image: botocore's SageMaker service model documents `al2023-ami-sagemaker-inference-gpu-4-1` as
"NVIDIA driver version: 580, CUDA version: 13.0, NVIDIA Container Toolkit with disabled CUDA-compat mounting".
Training and processing hosts' drivers are not documented: None here, and the image finds out at the job's
start (start_cuda_compat.sh, then sdflow_image.gpu_check fails the job at once, naming the driver).

The images (settings.image_uri: training, evaluation and endpoint of a run all run its backend's image):

    colossalai  torch 2.5.1+cu124 (training_image/Dockerfile: pytorch/pytorch:2.5.1-cuda12.4-cudnn9-devel, the
                same build as .venv-image): CUDA 12.4, kernels for sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90
                (torch._C._cuda_getArchFlags() of .venv-image): every GPU of the table.
    accelerate  torch 2.15.0 from PyPI (training_image/Dockerfile.accelerate): CUDA 13.2 (torch.version.cuda
                of .venv-accelerate; the nvidia-cuda-runtime wheel 13.2.86), kernels for sm_75 sm_80 sm_86 sm_90
                sm_100 sm_120 only: no sm_70, so nothing runs on a V100 (CUDA 13 dropped Maxwell, Pascal and Volta;
                pytorch/pytorch#172352). CUDA 13 needs an R580 driver or newer; the image ships cuda-compat (the
                forward-compatibility libcuda of driver 580, CUDA 13.0, which runs a 13.2 runtime by minor version
                compatibility) and puts it first when the host's driver is older, as AWS's own CUDA 13 containers do.
                NVIDIA's forward compatibility works only on data-center GPUs (every GPU of the table is one) and
                from a driver branch that still supports it: NVIDIA's support matrix ("Supported Drivers and CUDA
                Toolkit Versions") lists R535 (LTSB) as reaching CUDA 12 without the package and no branch older
                than R535 at all, so R470 (end of life 2024) is taken as one cuda-compat 13 cannot bridge (inferred
                from that matrix: the forward-compatibility page's own branch table could not be read here). Endpoints
                take the CUDA 13 inference AMI instead: no compatibility layer there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Driver:
    """An NVIDIA driver branch and the newest CUDA it runs without a compatibility package."""

    branch: int
    cuda: tuple[int, int]

    def __str__(self) -> str:
        return f"NVIDIA driver R{self.branch} (CUDA {self.cuda[0]}.{self.cuda[1]})"


R470, R535, R550, R580 = Driver(470, (11, 4)), Driver(535, (12, 2)), Driver(550, (12, 4)), Driver(580, (13, 0))


@dataclass(frozen=True)
class Gpu:
    name: str
    gib: float  # memory per GPU, as nvidia-smi reports it (MiB / 1024)
    count: int  # GPUs per instance
    capability: tuple[int, int] = (8, 0)  # CUDA compute capability
    inference_driver: Driver | None = None  # the inference hosts' default driver (None: AWS does not say)

    @property
    def bf16(self) -> bool:
        """bf16 tensor cores: Ampere (8.0) and later."""
        return self.capability >= BF16_MIN_CAPABILITY


BF16_MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class Image:
    """A training image: its CUDA, the compute capabilities its torch has kernels for, the oldest driver branch
    its compatibility package bridges (None: it ships none), and the endpoint AMI it needs (None: the default)."""

    label: str
    cuda: tuple[int, int]
    torch: str
    min_capability: tuple[int, int]
    compat_min_branch: int | None
    endpoint_ami: str | None = None


# The CUDA 13 inference AMI (botocore's ProductionVariantInferenceAmiVersion enum; driver 580 / CUDA 13.0).
CUDA13_INFERENCE_AMI = "al2023-ami-sagemaker-inference-gpu-4-1"
AMI_DRIVERS = {CUDA13_INFERENCE_AMI: R580}
IMAGES = {
    # NVIDIA's CUDA 12 images (the pytorch/pytorch -devel base is one) carry cuda-compat, which SageMaker's
    # default inference hosts mount (the newer AMIs say they "disable CUDA-compat mounting"); CUDA 12's forward
    # compatibility covered R470. Not refused anywhere: this image has run on these hosts as it is.
    "colossalai": Image("the Colossal-AI image", (12, 4), "torch 2.5.1+cu124", (5, 0), 470),
    "accelerate": Image("the accelerate image", (13, 2), "torch 2.15.0 (CUDA 13.2)", (7, 5), 535, CUDA13_INFERENCE_AMI),
}


def _sizes(gpu: Gpu, counts: dict[str, int]) -> dict[str, Gpu]:
    return {size: Gpu(gpu.name, gpu.gib, count, gpu.capability, gpu.inference_driver) for size, count in counts.items()}


_ONE = {"xlarge": 1, "2xlarge": 1, "4xlarge": 1, "8xlarge": 1, "16xlarge": 1}
_G_FAMILY = _ONE | {"12xlarge": 4, "24xlarge": 4, "48xlarge": 8}
_TABLE = {
    "g4dn": _sizes(Gpu("NVIDIA T4 16 GB", 15.0, 1, (7, 5), R470), _ONE | {"12xlarge": 4}),
    "g5": _sizes(Gpu("NVIDIA A10G 24 GB", 22.49, 1, (8, 6), R470), _G_FAMILY),
    "g6": _sizes(Gpu("NVIDIA L4 24 GB", 22.49, 1, (8, 9), R535), _G_FAMILY),
    "g6e": _sizes(Gpu("NVIDIA L40S 48 GB", 44.99, 1, (8, 9), None), _G_FAMILY),
    "p3": _sizes(Gpu("NVIDIA V100 16 GB", 16.0, 1, (7, 0), R470), {"2xlarge": 1, "8xlarge": 4, "16xlarge": 8}),
    "p3dn": _sizes(Gpu("NVIDIA V100 32 GB", 32.0, 1, (7, 0), None), {"24xlarge": 8}),
    "p4d": _sizes(Gpu("NVIDIA A100 40 GB", 40.0, 1, (8, 0), R470), {"24xlarge": 8}),
    "p4de": _sizes(Gpu("NVIDIA A100 80 GB", 80.0, 1, (8, 0), R470), {"24xlarge": 8}),
    # ml.p5.4xlarge: one H100, the only H100 size a processing job may ask for (ProcessingClusterConfig).
    "p5": _sizes(Gpu("NVIDIA H100 80 GB", 79.65, 1, (9, 0), R535), {"48xlarge": 8, "4xlarge": 1}),
    "p5e": _sizes(Gpu("NVIDIA H200 141 GB", 140.4, 1, (9, 0), R550), {"48xlarge": 8}),
    "p5en": _sizes(Gpu("NVIDIA H200 141 GB", 140.4, 1, (9, 0), R550), {"48xlarge": 8}),
}
GPU_INSTANCES = {f"ml.{family}.{size}": gpu for family, sizes in _TABLE.items() for size, gpu in sizes.items()}


def gpu_of(instance_type: str) -> Gpu | None:
    """The instance type's GPUs, or None for a type without GPUs (or one this table does not know)."""
    return GPU_INSTANCES.get(instance_type)


def image_of(backend: str) -> Image:
    """The image a backend's jobs run in (an unresolved backend is the first image, as settings.image_uri)."""
    return IMAGES["accelerate" if backend == "accelerate" else "colossalai"]


def host_driver(instance_type: str, backend: str, *, endpoint: bool) -> Driver | None:
    """The driver the image meets on that host: an endpoint's is its AMI's (the image's) or the inference hosts'
    default; a training or processing host's is not documented (None)."""
    gpu = gpu_of(instance_type)
    if gpu is None or not endpoint:
        return None
    ami = image_of(backend).endpoint_ami
    return AMI_DRIVERS[ami] if ami is not None else gpu.inference_driver


def why_not(instance_type: str, backend: str, *, endpoint: bool = False) -> str | None:
    """Why the backend's image cannot start on the instance type (None: it can, or nothing is known against it)."""
    gpu = gpu_of(instance_type)
    if gpu is None:
        return None
    image = image_of(backend)
    if gpu.capability < image.min_capability:
        have = ".".join(map(str, gpu.capability))
        need = ".".join(map(str, image.min_capability))
        return (
            f"{image.label}'s {image.torch} has no kernels for the {gpu.name}'s compute capability {have} (it "
            f"builds for {need} and newer: CUDA 13 dropped Volta, pytorch/pytorch#172352)"
        )
    driver = host_driver(instance_type, backend, endpoint=endpoint)
    if driver is None or driver.cuda >= (image.cuda[0], 0):
        return None  # the driver runs the image's CUDA major (minor version compatibility), or is unknown
    if image.compat_min_branch is None or driver.branch < image.compat_min_branch:
        return (
            f"its hosts run {driver}, older than {image.label}'s CUDA {image.cuda[0]}.{image.cuda[1]} needs, and "
            f"NVIDIA's forward compatibility package bridges R{image.compat_min_branch} and newer only"
        )
    return None


def endpoint_ami(backend: str) -> str | None:
    """ProductionVariant.InferenceAmiVersion for an endpoint of the backend's image (None: the default AMI)."""
    return image_of(backend).endpoint_ami


def runs_on(instance_type: str, backend: str, *, endpoint: bool = False) -> bool:
    return why_not(instance_type, backend, endpoint=endpoint) is None


def size_rank(instance_type: str) -> int:
    """The size's multiple of an xlarge (ml.g5.2xlarge: 2), to order sizes by cost rather than by name."""
    size = instance_type.rsplit(".", 1)[-1].removesuffix("xlarge")
    return int(size) if size.isdigit() else 1
