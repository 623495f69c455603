"""Memory before money on the accelerate backend: the new families' parameter counts, FSDP2 sharding what trains
across every GPU of every instance (the frozen encoders whole on each), ddp replicating everything, and
Validate run refusing what cannot fit, naming what would."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sdflow_common import memory_estimate
from sdflow_common.errors import InvalidRunDocument
from sdflow_common.memory_estimate import GIB, Gpu, Setup, estimate, fits, remedies
from sdflow_common.validate_run import ValidateRunRequest, validate_run
from tests.constants import ACCOUNT, REGION
from tests.unit.helpers import DATA_BUCKET, STATE_MACHINE_NAME, AwsWorld
from tests.unit.parquet_files import parquet_bytes

H100 = memory_estimate.gpu_of("ml.p5.48xlarge")
assert H100 is not None
ONE_H100 = Gpu(H100.name, H100.gib, 1)
EXECUTION = "memory-0123456789abcdef"
EXECUTION_ARN = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:{STATE_MACHINE_NAME}:{EXECUTION}"


def flux2(method: str = "full", plugin: str = "fsdp2", gpus: int = 1, **changes: Any) -> Setup:
    """FLUX.2 [klein] 9B at 512 px, batch 1, bf16, gradient checkpointing."""
    return Setup("flux2", method, plugin, "bf16", 1, 512, gradient_checkpointing=True, gpus=gpus, **changes)


def test_flux2_9b_full_on_one_80_gb_gpu_is_refused_and_sharded_across_8_fits() -> None:
    alone = estimate(flux2(gpus=1))
    assert alone.states_gib > 135  # 9.08 B x 16 B of fp32 weights, gradients and Adam state, unsharded
    assert not fits(flux2(gpus=1), ONE_H100)
    assert fits(flux2(gpus=8), H100)
    # 9.08 B x 16 B / 8, FSDP2's gathered root and blocks, Qwen3-8B and the VAE in bf16, the traced activations
    # (24.74 GiB at 512 px) x the traced checkpointing share 0.55
    assert estimate(flux2(gpus=8)).total_gib == pytest.approx(50.7, abs=0.1)


def test_fsdp2_shards_what_trains_and_keeps_the_frozen_encoders_whole() -> None:
    one, eight = estimate(flux2(gpus=1)), estimate(flux2(gpus=8))
    assert eight.frozen_gib == one.frozen_gib == pytest.approx((8190.7e6 + 84.0e6) * 2 / GIB)
    # The root (354.4 M) and two of the LARGEST blocks (double blocks, 436.2 M; the single ones are half) in
    # bf16, one block's gradients in bf16 and as the fp32 reduce-scatter input.
    transient = (2 * (354.4e6 + 2 * 436.2e6) + 6 * 436.2e6) / GIB
    assert eight.states_gib == pytest.approx(9078.6e6 * 16 / 8 / GIB + transient)


def test_fsdp2_transient_counts_the_largest_block_not_the_average() -> None:
    setup = flux2(gpus=8)
    average = memory_estimate.replace(setup.model, largest_block=9078.6e6 / 32)
    assert memory_estimate.fsdp_transient_bytes(setup, 2) > (2 * (354.4e6 + 2 * average.largest_block)) + 6 * (
        average.largest_block
    )


def test_fsdp2_accumulation_adds_a_whole_fp32_gradient_per_gpu_only_on_several_gpus() -> None:
    added = estimate(flux2(gpus=8, gradient_accumulation_steps=4)).states_gib - estimate(flux2(gpus=8)).states_gib
    # 4 B x every parameter, not divided by the 8 GPUs, in place of the sharded gradients' 4/8 B
    assert added == pytest.approx(9078.6e6 * (4 - 4 / 8) / GIB)
    assert estimate(flux2(gpus=1, gradient_accumulation_steps=4)) == estimate(flux2(gpus=1))  # no sync skipped
    assert estimate(flux2(plugin="ddp", gradient_accumulation_steps=4)) == estimate(flux2(plugin="ddp"))


def test_remedies_under_fsdp2_do_not_suggest_accumulation_that_does_not_fit() -> None:
    # FLUX.2 9B at batch 2 on 8 H100s: batch 1 fits, batch 1 x 2 accumulation steps adds 33.8 GiB per GPU.
    setup = Setup("flux2", "full", "fsdp2", "bf16", 2, 512, gpus=8)
    assert not fits(setup, H100)
    found = remedies(setup, H100, 1)
    smaller = [change for change in found if change.startswith("training.train_batch_size 1")]
    assert smaller
    assert "gradient_accumulation_steps 2" not in smaller[0]
    assert "unsharded fp32 gradient" in smaller[0]


def test_ddp_replicates_everything_as_torch_ddp_does() -> None:
    assert estimate(flux2(plugin="ddp", gpus=8)) == estimate(flux2(plugin="ddp", gpus=1))
    assert estimate(flux2(plugin="ddp")).states_gib == pytest.approx(9078.6e6 * 20 / GIB)


@pytest.mark.parametrize(
    ("family", "variant", "denoiser"),
    [
        ("sd35", "", 8056.6e6),
        ("sd35", "medium", 2243.2e6),
        ("flux2", "", 9078.6e6),
        ("flux2", "4b", 3875.5e6),
        ("qwenimage", "", 20430.4e6),
    ],
)
def test_new_family_reference_models_are_the_published_configs(family: str, variant: str, denoiser: float) -> None:
    assert memory_estimate.reference(family, variant).denoiser == denoiser


def test_flux2_4b_needs_less_than_9b() -> None:
    assert estimate(flux2(variant="4b")).total_gib < estimate(flux2()).total_gib / 2


def test_qwenimage_lora_fits_one_h100_not_one_a10g() -> None:
    lora = Setup("qwenimage", "lora", "ddp", "bf16", 1, 512, gradient_checkpointing=True)
    assert fits(lora, ONE_H100)
    a10g = memory_estimate.gpu_of("ml.g5.xlarge")
    assert a10g is not None
    assert not fits(lora, a10g)


def test_sd35_saved_without_t5_frees_its_4_8_b_parameters() -> None:
    with_t5 = Setup("sd35", "lora", "ddp", "bf16", 1, 512)
    without = Setup("sd35", "lora", "ddp", "bf16", 1, 512, with_t5=False)
    assert estimate(with_t5).frozen_gib - estimate(without).frozen_gib == pytest.approx(4762.3e6 * 2 / GIB)


def test_remedies_of_fsdp2_name_more_instances_and_of_ddp_name_fsdp2_and_lora() -> None:
    l40s = memory_estimate.gpu_of("ml.g6e.xlarge")
    assert l40s is not None
    found = remedies(flux2(gpus=1), l40s, 1)
    assert "training.method lora (with plugin ddp)" in found
    assert any(change.startswith("training.instance_count ") for change in found)
    found = remedies(flux2(plugin="ddp", gpus=8), H100, 1)
    assert found[0].startswith("training.plugin fsdp2")
    assert "training.method lora (with plugin ddp)" in found


def validate(world: AwsWorld, training: dict[str, Any]) -> dict[str, Any]:
    world.put_json("models/base/model_index.json", {"_class_name": "Flux2KleinPipeline"})
    world.put_json("models/base/transformer/config.json", {"num_attention_heads": 32, "num_layers": 8})
    world.s3.put_object(Bucket=DATA_BUCKET, Key="datasets/a.parquet", Body=parquet_bytes(8))  # a row per GPU
    run = {
        "dataset": {"parquet_uris": [f"s3://{DATA_BUCKET}/datasets/a.parquet"]},
        "base_model_uri": f"s3://{DATA_BUCKET}/models/base/",
        "training": {"resolution": 512, "train_batch_size": 1, **training},
        "download": {"image_size": 512},
        # FLUX.2 9B's evaluation (float32) and endpoint (bf16) outgrow the default ml.g5.xlarge (model_family
        # check_instances): these tests are about the training instance.
        # ml.p5.4xlarge: one H100, which a processing job may ask for (ml.p4de.24xlarge: no, ProcessingClusterConfig).
        "evaluation": {"instance_type": "ml.p5.4xlarge"},
        "endpoint": {"instance_type": "ml.g6e.xlarge"},
    }
    request = ValidateRunRequest(
        run=run, execution_name=EXECUTION, execution_arn=EXECUTION_ARN, start_time="2026-11-27T09:15:43.512Z"
    )
    return validate_run(request, data_bucket=DATA_BUCKET, max_shards=10)


def test_validate_run_flux2_9b_full_on_one_l40s_is_refused_naming_instances_and_lora(mocked_aws: AwsWorld) -> None:
    with pytest.raises(InvalidRunDocument) as caught:
        validate(mocked_aws, {"instance_type": "ml.g6e.xlarge"})
    [problem] = json.loads(str(caught.value))
    assert problem["field"] == "training"
    message = problem["message"]
    assert message.startswith("this FLUX.2 [klein] 9B full run with plugin fsdp2, bf16, batch 1 at 512 px needs")
    assert "training.instance_count" in message
    assert "training.method lora (with plugin ddp)" in message


def test_validate_run_flux2_9b_full_sharded_across_8_h100_is_accepted(mocked_aws: AwsWorld) -> None:
    run = validate(mocked_aws, {"instance_type": "ml.p5.48xlarge"})["run"]
    assert (run["base_model_family"], run["training"]["plugin"]) == ("flux2", "fsdp2")
