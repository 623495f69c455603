"""moto's static data the local cloud does not serve, dropped once moto has loaded it.

moto's CloudFormation imports every service's models (moto/cloudformation/parsing.py), which
imports EC2's, whose moto/ec2/models/instance_types.py loads at import the instance-type
offerings of every region and location type: ~60 MB of Python objects, parsed JSON, for the
life of the process. The local cloud is one account in one region (sdflow.local.account): the
other regions' offerings are never read. This keeps only that region's, in place (moto's
modules hold the same dict). Like moto's own module data it is not restored when the patches
are uninstalled: a process that started a local cloud has no other region's EC2 offerings."""

from __future__ import annotations


def keep_offerings_of(region: str) -> int:
    """Drop every other region's EC2 instance-type offerings; returns how many region lists went."""
    from moto.ec2.models import instance_types

    dropped = 0
    for by_region in instance_types.INSTANCE_TYPE_OFFERINGS.values():
        for other in [name for name in by_region if name != region]:
            del by_region[other]
            dropped += 1
    return dropped
