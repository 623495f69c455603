"""The second stack's full-size random pipelines (bench/gpu_acceptance.py's rows): the published
configs build the published sizes, counted on the meta device (nothing allocated)."""

from __future__ import annotations

import pytest

from sdflow_image.builders import random_families_next

pytestmark = pytest.mark.image


@pytest.mark.parametrize("variant", random_families_next.VARIANTS)
def test_random_variant_built_on_meta_has_the_published_parameter_counts(variant: str) -> None:
    components = random_families_next.build_components(variant, device="meta")
    assert random_families_next.component_counts(components) == random_families_next.PARAMETERS[variant]
    random_families_next.check_parameters(variant, components)


def test_random_variant_unknown_raises_naming_the_variants() -> None:
    with pytest.raises(ValueError, match="flux2-klein-9b"):
        random_families_next.build_components("flux2-klein-12b")


def test_check_parameters_wrong_size_raises_naming_component() -> None:
    import torch

    components = {"transformer": torch.nn.Linear(2, 2)}
    with pytest.raises(ValueError, match="transformer has 6 parameters, the published model 3,875,544,576"):
        random_families_next.check_parameters("flux2-klein-4b", components)
