"""Opening an input, a local file or an S3 object, as a binary stream; errors name the input."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO


class SourceError(Exception):
    pass


@dataclass(frozen=True)
class ColumnMap:
    """Which Parquet columns carry the request (--messages-column / --prompt-column / --id-column)."""

    messages: str | None = None
    prompt: str | None = None
    id: str | None = None

    def given(self) -> bool:
        return any((self.messages, self.prompt, self.id))


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def open_binary(uri: str, *, s3_endpoint_url: str | None = None, seekable: bool = False) -> BinaryIO:
    if is_s3(uri):
        from genq.output import s3  # boto3 only when an input is on S3

        try:
            return (s3.open_seekable if seekable else s3.open_stream)(uri, s3_endpoint_url)
        except s3.S3UriError as exc:
            raise SourceError(str(exc)) from None
        except Exception as exc:  # botocore: no such key/bucket, access denied, endpoint down
            raise SourceError(f"cannot read input {s3.describe(exc, uri)}") from None
    if "://" in uri:
        raise SourceError(f"unsupported input {uri!r}: use a local path or s3://bucket/key")
    path = Path(uri)
    if not path.exists():
        raise SourceError(f"input file not found: {uri}")
    if path.is_dir():
        raise SourceError(f"input is a directory, expected a file: {uri}")
    return open(path, "rb")
