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


def test_read_sns_messages_line_being_written_is_left_for_the_next_read(tmp_path: Path) -> None:
    """A reader that meets a publish half-way through its write (a long message is not one atomic
    write) returns the whole messages before it, and the new one once its line is ended."""
    folder = tmp_path / "sns"
    folder.mkdir()
    whole = '{"message_id": "1", "subject": "s", "message": "m", "attributes": {}, "timestamp": "t1"}\n'
    half = '{"message_id": "2", "subject": "s", "message": "a long notifica'
    (folder / "topic.jsonl").write_text(whole + half, encoding="utf-8")

    assert [m["message_id"] for m in sns_service.read_sns_messages(tmp_path, "topic")] == ["1"]

    rest = 'tion", "attributes": {}, "timestamp": "t2"}\n'
    (folder / "topic.jsonl").write_text(whole + half + rest, encoding="utf-8")
    assert [m["message_id"] for m in sns_service.read_sns_messages(tmp_path, "topic")] == ["1", "2"]
