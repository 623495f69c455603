"""moto's EC2 offerings of regions the local cloud does not serve are dropped (sdflow/local/moto_data.py)."""

from __future__ import annotations

from sdflow.local import moto_data
from tests.constants import REGION
from tests.unit.local.helpers import client


def test_moto_gap_ec2_import_loads_every_regions_offerings() -> None:
    from moto.ec2.models import instance_types

    # Once a local cloud ran in this process only its region is left; moto ships about thirty.
    shipped = instance_types.root / instance_types.offerings_path / "region"
    assert len(list(shipped.iterdir())) > 20


def test_keep_offerings_of_region_drops_the_others_and_region_still_answers(aws: None) -> None:
    from moto.ec2.models import instance_types

    moto_data.keep_offerings_of(REGION)

    for by_region in instance_types.INSTANCE_TYPE_OFFERINGS.values():
        assert list(by_region) == [REGION]
    offered = client("ec2").describe_instance_type_offerings(LocationType="region")["InstanceTypeOfferings"]
    assert offered
    assert {o["Location"] for o in offered} == {REGION}
    assert moto_data.keep_offerings_of(REGION) == 0, "nothing left to drop"
