"""DynamoDB: table settings from the template (TTL, point-in-time recovery) as AWS reports them."""

from __future__ import annotations

from typing import Any

import pytest

from sdflow.local import runtime as runtime_module
from sdflow.local.services import dynamodb
from tests.unit.local.helpers import client, stack


def _table(**extra: Any) -> dict[str, Any]:
    return {
        "Type": "AWS::DynamoDB::Table",
        "Properties": {
            "TableName": "tokens",
            "BillingMode": "PAY_PER_REQUEST",
            "AttributeDefinitions": [{"AttributeName": "resource_name", "AttributeType": "S"}],
            "KeySchema": [{"AttributeName": "resource_name", "KeyType": "HASH"}],
            **extra,
        },
    }


TTL = {"TimeToLiveSpecification": {"AttributeName": "expires_at", "Enabled": True}}


def _table_name() -> str:
    return str(client("dynamodb").list_tables()["TableNames"][0])


def test_moto_gap_dynamodb_table_ttl_from_template_reads_disabled(aws: None) -> None:
    stack({"Tokens": _table(**TTL)})
    described = client("dynamodb").describe_time_to_live(TableName=_table_name())
    assert described["TimeToLiveDescription"]["TimeToLiveStatus"] == "DISABLED"


def test_patch_dynamodb_table_ttl_from_template_reads_enabled(runtime: runtime_module.Runtime) -> None:
    stack({"Tokens": _table(**TTL)})
    described = client("dynamodb").describe_time_to_live(TableName=_table_name())
    assert described["TimeToLiveDescription"] == {"TimeToLiveStatus": "ENABLED", "AttributeName": "expires_at"}


def test_patch_dynamodb_table_without_ttl_reads_disabled(runtime: runtime_module.Runtime) -> None:
    stack({"Tokens": _table(TimeToLiveSpecification={"Enabled": False})})
    described = client("dynamodb").describe_time_to_live(TableName=_table_name())
    assert described["TimeToLiveDescription"]["TimeToLiveStatus"] == "DISABLED"


def test_patch_dynamodb_table_point_in_time_recovery_from_template_enabled(runtime: runtime_module.Runtime) -> None:
    stack({"Tokens": _table(PointInTimeRecoverySpecification={"PointInTimeRecoveryEnabled": True})})
    backups = client("dynamodb").describe_continuous_backups(TableName=_table_name())
    status = backups["ContinuousBackupsDescription"]["PointInTimeRecoveryDescription"]["PointInTimeRecoveryStatus"]
    assert status == "ENABLED"


def test_patch_dynamodb_table_ttl_enabled_without_attribute_fails_naming_field(
    runtime: runtime_module.Runtime,
) -> None:
    with pytest.raises(dynamodb.TableSettingError, match=r"TimeToLiveSpecification\.AttributeName is required"):
        stack({"Tokens": _table(TimeToLiveSpecification={"Enabled": True})})


def test_patch_dynamodb_expired_item_still_readable_like_aws(runtime: runtime_module.Runtime) -> None:
    # AWS deletes expired items within days and serves them until then; the local cloud never deletes them.
    stack({"Tokens": _table(**TTL)})
    ddb = client("dynamodb")
    item = {"resource_name": {"S": "job"}, "expires_at": {"N": "1"}}
    ddb.put_item(TableName=_table_name(), Item=item)
    assert ddb.get_item(TableName=_table_name(), Key={"resource_name": {"S": "job"}})["Item"] == item
