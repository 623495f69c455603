"""SNS: published messages readable in the work folder."""

from __future__ import annotations

from pathlib import Path

from sdflow.local import runtime as runtime_module
from sdflow.local.services import sns as sns_service
from tests.unit.local.helpers import client


def test_moto_gap_sns_publish_keeps_nothing_readable(aws: None, tmp_path: Path) -> None:
    from moto.sns.models import Topic

    topic = client("sns").create_topic(Name="t")["TopicArn"]
    client("sns").publish(TopicArn=topic, Message="hello")
    assert "publish" in vars(Topic)
    assert not (tmp_path / "sns").exists()


def test_patch_sns_publish_appends_message_to_topic_file(runtime: runtime_module.Runtime) -> None:
    sns = client("sns")
    topic = sns.create_topic(Name="notifications")["TopicArn"]
    sns.publish(
        TopicArn=topic,
        Subject="[sdflow] Run rejected",
        Message="2 problems",
        MessageAttributes={"outcome": {"DataType": "String", "StringValue": "rejected"}},
    )
    sns.publish(TopicArn=topic, Message="second")
    messages = sns_service.read_sns_messages(runtime.workdir, "notifications")
    assert [m["message"] for m in messages] == ["2 problems", "second"]
    assert messages[0]["subject"] == "[sdflow] Run rejected"
    assert messages[0]["attributes"] == {"outcome": "rejected"}


# ------------------------------------------------------------------------------------ install
