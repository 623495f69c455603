"""`s3://bucket/prefix/` as the container's jobs name S3 locations (download output, dataset, checkpoints)."""

from __future__ import annotations

import re
from dataclasses import dataclass


class InvalidS3Uri(ValueError):
    pass


@dataclass(frozen=True)
class S3Prefix:
    bucket: str
    prefix: str  # "" or ends with "/"

    @classmethod
    def parse(cls, uri: str) -> S3Prefix:
        match = re.fullmatch(r"s3://([^/]+)/?(.*)", uri.strip())
        if match is None or not match.group(1):
            raise InvalidS3Uri(f"{uri!r} is not an S3 URI; expected s3://<bucket>/<shard prefix>/")
        prefix = match.group(2)
        return cls(match.group(1), prefix if not prefix or prefix.endswith("/") else prefix + "/")

    def key(self, name: str) -> str:
        return self.prefix + name

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"
