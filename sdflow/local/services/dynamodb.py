"""DynamoDB: the template's table settings that moto's CloudFormation model drops.

Time to Live is reported as the template sets it; expiry itself is not emulated. AWS deletes
expired items in the background "typically within two days of expiration", and "items that have
expired and not been deleted will still show up in reads, queries, and scans" (DynamoDB API
Reference, UpdateTimeToLive). A local cloud that never deletes them is therefore one of the
behaviours AWS allows, and the code that reads a token table must already cope with it."""

from __future__ import annotations

from typing import Any

from sdflow.local.patching import Patch, wrap


class TableSettingError(ValueError):
    """A table property in the template is malformed (the field is named in the message)."""


def table_create_from_cloudformation_json(
    inner: Any,
    cls: Any,
    resource_name: str,
    cloudformation_json: dict[str, Any],
    account_id: str,
    region_name: str,
    **kwargs: Any,
) -> Any:
    """Wraps moto/dynamodb/models/table.py Table.create_from_cloudformation_json.

    moto creates the table but ignores TimeToLiveSpecification and
    PointInTimeRecoverySpecification, so `aws dynamodb describe-time-to-live` answers DISABLED
    for a table whose template enables TTL. Both are applied through moto's own API methods,
    which validate them as UpdateTimeToLive / UpdateContinuousBackups do."""
    from moto.dynamodb.models import dynamodb_backends

    table = inner(cls, resource_name, cloudformation_json, account_id, region_name, **kwargs)
    properties = cloudformation_json.get("Properties", {})
    backend = dynamodb_backends[account_id][region_name]
    ttl = properties.get("TimeToLiveSpecification")
    if ttl is not None and (spec := _ttl_spec(resource_name, ttl))["Enabled"]:
        backend.update_time_to_live(table.name, spec)
    pitr = properties.get("PointInTimeRecoverySpecification")
    if pitr is not None:
        enabled = pitr.get("PointInTimeRecoveryEnabled", False)
        backend.update_continuous_backups(table.name, {"PointInTimeRecoveryEnabled": _bool(enabled)})
    return table


def _ttl_spec(resource_name: str, ttl: Any) -> dict[str, Any]:
    # CloudFormation's AWS::DynamoDB::Table TimeToLiveSpecification: Enabled is required,
    # AttributeName is required when Enabled is true.
    if not isinstance(ttl, dict) or "Enabled" not in ttl:
        raise TableSettingError(
            f"{resource_name}.TimeToLiveSpecification needs Enabled (true/false), e.g. "
            "{AttributeName: expires_at, Enabled: true}"
        )
    enabled = _bool(ttl["Enabled"])
    if enabled and not ttl.get("AttributeName"):
        raise TableSettingError(f"{resource_name}.TimeToLiveSpecification.AttributeName is required when Enabled")
    return {"Enabled": enabled, "AttributeName": ttl.get("AttributeName", "")}


def _bool(value: Any) -> bool:
    # Template values reach moto as YAML booleans or, through !If / parameters, as strings.
    return value is True or str(value).lower() == "true"


def patches() -> list[Patch]:
    from moto.dynamodb.models.table import Table

    return [wrap(Table, "create_from_cloudformation_json", table_create_from_cloudformation_json)]
