"""The one table of GPU instance types (instance_types) and what Validate run refuses with it: instance types the
run's image cannot start on, bf16 training without bf16 tensor cores, evaluation and endpoint GPUs too small for
one pipeline (model_family.check_instances); bigger_instance recommends only what the image runs; the accelerate
image's endpoints name the CUDA 13 inference AMI."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import botocore.session
import pytest

from sdflow_common import inference_memory, instance_types, memory_estimate, model_family, sagemaker_jobs
from sdflow_common.errors import InvalidRunDocument
from sdflow_common.memory_estimate import GIB, Setup, bigger_instance, gpu_of
from sdflow_common.run_document import EndpointOptions, RunDocument, parse_run_document
from tests.unit.helpers import DATA_BUCKET
from tests.unit.job_requests import assert_valid_request

# Every type the training estimate's table knew before the table moved (memory_estimate._TABLE).
KNOWN = {
    "g4dn": ("T4", 15.0, (7, 5)),
    "g5": ("A10G", 22.49, (8, 6)),
    "g6": ("L4", 22.49, (8, 9)),
    "g6e": ("L40S", 44.99, (8, 9)),
    "p3": ("V100", 16.0, (7, 0)),
    "p3dn": ("V100", 32.0, (7, 0)),
    "p4d": ("A100", 40.0, (8, 0)),
    "p4de": ("A100", 80.0, (8, 0)),
    "p5": ("H100", 79.65, (9, 0)),
    "p5e": ("H200", 140.4, (9, 0)),
    "p5en": ("H200", 140.4, (9, 0)),
}


def document(family: str, **blocks: Any) -> RunDocument:
    raw = {
        "dataset": {"parquet_uris": [f"s3://{DATA_BUCKET}/datasets/a.parquet"]},
        "base_model_uri": f"s3://{DATA_BUCKET}/models/base/",
        "base_model_family": family,
        **blocks,
    }
    return parse_run_document(raw)


def refused(run: RunDocument, family: str, **found: Any) -> dict[str, str]:
    with pytest.raises(InvalidRunDocument) as caught:
        model_family.check_instances(run, family, **found)
    return {problem["field"]: problem["message"] for problem in json.loads(str(caught.value))}


CPU_JOBS = {"evaluation": {"instance_type": "ml.m5.xlarge"}, "endpoint": {"instance_type": "ml.m5.large"}}


# --- the table --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(KNOWN))
def test_instance_table_family_has_gpu_memory_and_compute_capability(family: str) -> None:
    name, gib, capability = KNOWN[family]
    sizes = [gpu for instance, gpu in instance_types.GPU_INSTANCES.items() if instance.split(".")[1] == family]
    assert sizes, f"ml.{family}.* is missing"
    for gpu in sizes:
        assert (name in gpu.name, gpu.gib, gpu.capability) == (True, gib, capability)
        assert gpu.bf16 is (capability >= (8, 0))


def test_instance_table_is_the_one_memory_estimate_reads() -> None:
    assert memory_estimate.GPU_INSTANCES is instance_types.GPU_INSTANCES
    assert gpu_of("ml.g5.12xlarge") == instance_types.gpu_of("ml.g5.12xlarge")


def test_instance_table_inference_drivers_are_awss_documented_ones() -> None:
    # "Best practices to minimize interruptions during GPU driver upgrades": R470 g4dn/g5/p3/p4d/p4de, R535 p5/g6,
    # R550 p5e/p5en.
    drivers = {name: gpu.inference_driver for name, gpu in instance_types.GPU_INSTANCES.items()}
    assert drivers["ml.g5.xlarge"] == drivers["ml.g4dn.xlarge"] == drivers["ml.p4d.24xlarge"] == instance_types.R470
    assert drivers["ml.p5.48xlarge"] == drivers["ml.g6.xlarge"] == instance_types.R535
    assert drivers["ml.p5e.48xlarge"] == drivers["ml.p5en.48xlarge"] == instance_types.R550
    assert drivers["ml.g6e.xlarge"] is None  # not on AWS's list


def test_cuda13_inference_ami_is_a_value_of_botocores_enum() -> None:
    model = botocore.session.get_session().get_service_model("sagemaker")
    enum = model.shape_for("ProductionVariantInferenceAmiVersion").enum
    assert instance_types.CUDA13_INFERENCE_AMI in enum
    assert set(instance_types.AMI_DRIVERS) <= set(enum)


# --- which image starts where -----------------------------------------------------------------------------------


@pytest.mark.parametrize("instance_type", ["ml.p3.2xlarge", "ml.p3.16xlarge", "ml.p3dn.24xlarge"])
def test_accelerate_image_on_v100_cannot_start_naming_compute_capability(instance_type: str) -> None:
    reason = instance_types.why_not(instance_type, "accelerate")
    assert reason is not None
    assert "compute capability 7.0" in reason
    assert "pytorch/pytorch#172352" in reason
    assert instance_types.runs_on(instance_type, "colossalai")  # torch 2.5.1+cu124 builds sm_70


@pytest.mark.parametrize("instance_type", sorted(set(instance_types.GPU_INSTANCES) - {"ml.p3.2xlarge"}))
def test_accelerate_image_endpoint_runs_on_every_non_v100_gpu_with_the_cuda13_ami(instance_type: str) -> None:
    gpu = instance_types.gpu_of(instance_type)
    assert gpu is not None
    expected = gpu.capability >= (7, 5)
    assert instance_types.runs_on(instance_type, "accelerate", endpoint=True) is expected
    assert instance_types.host_driver(instance_type, "accelerate", endpoint=True) == instance_types.R580


def test_driver_older_than_compat_branch_cannot_start_the_image(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the CUDA 13 AMI an endpoint meets the default hosts' drivers: R470 (g5) is older than the R535 that
    # NVIDIA's forward compatibility bridges to CUDA 13; R535 (g6) is bridged.
    images = dict(instance_types.IMAGES)
    images["accelerate"] = replace(images["accelerate"], endpoint_ami=None)
    monkeypatch.setattr(instance_types, "IMAGES", images)
    reason = instance_types.why_not("ml.g5.xlarge", "accelerate", endpoint=True)
    assert reason is not None
    assert "R470" in reason
    assert "R535" in reason
    assert instance_types.runs_on("ml.g6.xlarge", "accelerate", endpoint=True)
    # Training and processing hosts' drivers are undocumented: nothing to refuse them by.
    assert instance_types.runs_on("ml.g5.xlarge", "accelerate")


def test_colossalai_image_on_r470_endpoint_is_bridged_by_cuda12_compat() -> None:
    assert instance_types.host_driver("ml.g5.xlarge", "colossalai", endpoint=True) == instance_types.R470
    assert instance_types.runs_on("ml.g5.xlarge", "colossalai", endpoint=True)


# --- bigger_instance --------------------------------------------------------------------------------------------


def test_bigger_instance_for_accelerate_run_skips_v100() -> None:
    # FLUX.2 [klein] 4B LoRA (ddp) at batch 2 outgrows an A10G; the next larger GPU is p3dn's 32 GB V100, which the
    # accelerate image has no kernels for: the recommendation before the table was ml.p3dn.24xlarge.
    setup = Setup("flux2", "lora", "ddp", "bf16", batch=2, resolution=512, variant="4b")
    g5 = gpu_of("ml.g5.xlarge")
    assert g5 is not None
    assert not memory_estimate.fits(setup, g5)
    assert memory_estimate.fits(setup, instance_types.GPU_INSTANCES["ml.p3dn.24xlarge"])
    larger = bigger_instance(setup, g5, 1)
    assert larger == "ml.p4d.24xlarge"


def test_bigger_instance_for_bf16_run_skips_gpus_without_bf16() -> None:
    # An SD 1.5 full run in bf16 that outgrows a T4 by a little fits a 16 GB V100 (p3.2xlarge), which has no bf16.
    t4 = gpu_of("ml.g4dn.xlarge")
    assert t4 is not None
    v100 = instance_types.GPU_INSTANCES["ml.p3.2xlarge"]
    setup = next(
        s
        for method in ("full", "lora")
        for resolution in (512, 576, 640, 768)
        for batch in range(1, 64)
        if not memory_estimate.fits(s := Setup("sd", method, "torch_ddp", "bf16", batch, resolution), t4)
        and memory_estimate.fits(s, v100)
    )
    larger = bigger_instance(setup, t4, 1)
    assert larger is not None
    assert instance_types.GPU_INSTANCES[larger].bf16
    assert bigger_instance(replace(setup, precision="fp16"), t4, 1) == "ml.p3.2xlarge"


@pytest.mark.parametrize("plugin", ["ddp", "fsdp2"])
def test_bigger_instance_never_recommends_a_type_the_accelerate_image_cannot_run(plugin: str) -> None:
    for family in ("sd35", "flux2", "qwenimage"):
        for batch in (1, 4, 16):
            setup = Setup(family, "full", plugin, "bf16", batch=batch, resolution=512)
            for current in {gpu.gib: gpu for gpu in instance_types.GPU_INSTANCES.values()}.values():
                larger = bigger_instance(setup, current, 1)
                assert larger is None or instance_types.runs_on(larger, "accelerate"), (family, batch, current)


# --- Validate run's checks --------------------------------------------------------------------------------------


def test_check_instances_accelerate_training_on_p3dn_is_refused_naming_field_and_a100() -> None:
    run = document("flux2", training={"instance_type": "ml.p3dn.24xlarge"}, **CPU_JOBS)
    message = refused(run, "flux2")["training.instance_type"]
    assert "compute capability 7.0" in message
    assert (
        "set training.instance_type to an instance type the accelerate image starts on, e.g. ml.p4d.24xlarge" in message
    )


def test_size_rank_orders_sizes_by_multiple_of_xlarge() -> None:
    names = ["ml.g5.16xlarge", "ml.g5.xlarge", "ml.g5.2xlarge", "ml.g5.48xlarge"]
    assert sorted(names, key=instance_types.size_rank) == [
        "ml.g5.xlarge",
        "ml.g5.2xlarge",
        "ml.g5.16xlarge",
        "ml.g5.48xlarge",
    ]


def test_check_instances_accelerate_endpoint_on_v100_is_refused_naming_field() -> None:
    run = document(
        "sd35",
        training={"instance_type": "ml.m5.xlarge"},
        evaluation={"instance_type": "ml.m5.xlarge"},
        endpoint={"instance_type": "ml.p3.2xlarge"},
    )
    problems = refused(run, "sd35", variant="medium")
    assert list(problems) == ["endpoint.instance_type"]
    assert "set endpoint.instance_type to" in problems["endpoint.instance_type"]


def test_check_instances_colossalai_run_on_v100_is_accepted() -> None:
    run = document("sd", training={"instance_type": "ml.p3.8xlarge", "mixed_precision": "fp16"})
    model_family.check_instances(run, "sd")


@pytest.mark.parametrize("instance_type", ["ml.g4dn.xlarge", "ml.p3.2xlarge"])
def test_check_instances_bf16_training_without_bf16_cores_is_refused(instance_type: str) -> None:
    run = document("sd", training={"instance_type": instance_type, "mixed_precision": "bf16"})
    message = refused(run, "sd")["training.mixed_precision"]
    assert "no bf16 tensor cores" in message
    assert "'no' or 'fp16'" in message
    assert "training.instance_type to e.g. ml.g5.xlarge" in message


def test_check_instances_bf16_training_on_a10g_is_accepted() -> None:
    model_family.check_instances(
        document("sd", training={"instance_type": "ml.g5.xlarge", "mixed_precision": "bf16"}), "sd"
    )


@pytest.mark.parametrize(("family", "variant"), [("qwenimage", ""), ("flux2", "")])
def test_check_instances_big_family_evaluation_on_g5_xlarge_is_refused_with_a_fitting_type(
    family: str, variant: str
) -> None:
    run = document(
        family,
        training={"instance_type": "ml.m5.xlarge"},
        evaluation={"instance_type": "ml.g5.xlarge"},
        endpoint={"instance_type": "ml.m5.large"},
    )
    message = refused(run, family, variant=variant)["evaluation.instance_type"]
    assert "pipeline at a time in bf16/fp16" in message
    assert "ml.g5.xlarge" in message
    suggested = message.split("set evaluation.instance_type to e.g. ")[1].split(" ")[0]
    need = inference_memory.estimate(family, 512, inference_memory.EVALUATION_BYTES, variant=variant).total_gib
    assert memory_estimate.usable_gib(instance_types.GPU_INSTANCES[suggested]) >= need
    assert instance_types.runs_on(suggested, "accelerate")


def test_check_instances_flux2_endpoint_suggests_one_gpu_l40s() -> None:
    run = document("flux2", training={"instance_type": "ml.m5.xlarge"}, evaluation={"instance_type": "ml.m5.xlarge"})
    message = refused(run, "flux2")["endpoint.instance_type"]
    assert "bf16/fp16" in message
    assert "set endpoint.instance_type to e.g. ml.g6e.xlarge" in message


def test_check_instances_sd15_defaults_are_accepted() -> None:
    model_family.check_instances(document("sd"), "sd")


def test_check_instances_cpu_instance_types_are_not_checked() -> None:
    model_family.check_instances(
        document("qwenimage", training={"instance_type": "ml.m5.xlarge"}, **CPU_JOBS), "qwenimage"
    )


# --- inference memory -------------------------------------------------------------------------------------------


def test_inference_estimate_weights_are_every_parameter_of_the_pipeline() -> None:
    found = inference_memory.estimate("qwenimage", 512, 4)
    assert found.weights_gib == pytest.approx((20430.4e6 + 8292.2e6 + 126.9e6) * 4 / GIB)
    without_t5 = inference_memory.estimate("sd3", 512, 2, with_t5=False)
    assert inference_memory.estimate("sd3", 512, 2).weights_gib - without_t5.weights_gib == pytest.approx(
        memory_estimate.SD3_T5 * 2 / GIB
    )


def test_inference_estimate_activations_grow_with_resolution_squared() -> None:
    small = inference_memory.estimate("sdxl", 512, 2).activations_gib
    assert inference_memory.estimate("sdxl", 1024, 2).activations_gib == pytest.approx(4 * small)
    assert inference_memory.estimate("sdxl", 512, 4).activations_gib == pytest.approx(2 * small)


# --- the endpoint request ---------------------------------------------------------------------------------------


def _config(backend: str, instance_type: str) -> Any:
    options = EndpointOptions(name="sdflow-test", instance_type=instance_type)
    return sagemaker_jobs.endpoint_config_request(
        config_name="c", model_name="m", run_id="run", run_hash="h" * 16, options=options, backend=backend
    )


def test_endpoint_config_of_accelerate_image_names_cuda13_ami() -> None:
    config = _config("accelerate", "ml.g5.2xlarge")
    assert_valid_request("CreateEndpointConfig", config)
    assert config["ProductionVariants"][0]["InferenceAmiVersion"] == "al2023-ami-sagemaker-inference-gpu-4-1"


@pytest.mark.parametrize(("backend", "instance_type"), [("colossalai", "ml.g5.2xlarge"), ("accelerate", "ml.m5.large")])
def test_endpoint_config_default_ami_for_first_image_and_cpu(backend: str, instance_type: str) -> None:
    assert "InferenceAmiVersion" not in _config(backend, instance_type)["ProductionVariants"][0]
