"""SNS: every published message also kept in <workdir>/sns/<topic>.jsonl, where the CLI and the user read it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sdflow.local.patching import Patch, wrap
from sdflow.local.runtime import current_clock, runtime_or_none


def sns_topic_publish(
    inner: Any,
    self: Any,
    message: str,
    subject: str | None = None,
    message_attributes: dict[str, Any] | None = None,
    group_id: str | None = None,
    deduplication_id: str | None = None,
    message_structure: str | None = None,
) -> str:
    """Wraps moto/sns/models.py Topic.publish (every publish path: API, Step Functions, S3).

    moto keeps messages in memory only for subscriptions; locally there is nobody to e-mail, so
    each message is also appended to <workdir>/sns/<topic name>.jsonl, where the CLI and the
    user read it."""
    message_id = inner(self, message, subject, message_attributes, group_id, deduplication_id, message_structure)
    runtime = runtime_or_none()
    if runtime is not None:
        record = {
            "message_id": message_id,
            "topic_arn": self.arn,
            "subject": subject,
            "message": message,
            "attributes": {
                key: value.get("Value", value.get("StringValue")) if isinstance(value, dict) else value
                for key, value in (message_attributes or {}).items()
            },
            "timestamp": current_clock().now().isoformat(timespec="milliseconds"),
        }
        with runtime.sns_lock:
            runtime.sns_dir.mkdir(parents=True, exist_ok=True)
            with open(runtime.sns_dir / f"{self.name}.jsonl", "a", encoding="utf-8") as out:
                out.write(json.dumps(record) + "\n")
    return str(message_id)


def read_sns_messages(workdir: Path, topic_name: str | None = None) -> list[dict[str, Any]]:
    """The messages published so far (one topic, or all), oldest first."""
    folder = Path(workdir) / "sns"
    files = [folder / f"{topic_name}.jsonl"] if topic_name else sorted(folder.glob("*.jsonl"))
    messages: list[dict[str, Any]] = []
    for path in files:
        if path.exists():
            # Only whole lines: a publish in another thread or process may be half-way through writing
            # a long message (one write of many kilobytes is not atomic), and it ends its line last.
            lines = path.read_text(encoding="utf-8").split("\n")[:-1]
            messages += [json.loads(line) for line in lines if line.strip()]
    return sorted(messages, key=lambda m: m["timestamp"])


def patches() -> list[Patch]:
    from moto.sns.models import Topic

    return [wrap(Topic, "publish", sns_topic_publish)]
