"""S3: an output prefix as a Store, resumable readers of inputs, one client per endpoint. Credentials and
endpoint follow boto3's chain (a job's --s3-endpoint-url wins); AWS_MAX_ATTEMPTS / AWS_RETRY_MODE tune
botocore's retries (default: standard, 5 attempts); past those the worker retries the whole shard."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import boto3
import botocore.exceptions
from botocore.config import Config

log = logging.getLogger(__name__)
_clients_lock = threading.Lock()

# Errors while reading a response body: the connection broke, not the request.
_STREAM_ERRORS = (botocore.exceptions.ReadTimeoutError, botocore.exceptions.ResponseStreamingError,
                  botocore.exceptions.IncompleteReadError, botocore.exceptions.ConnectionError,
                  ConnectionError, TimeoutError)
STREAM_RESUMES = 8  # reopen attempts for a broken GET (about 40 s of backoff) before giving up
RESUME_RESET_BYTES = 64 << 20  # progress after which the resume budget is full again
MISSING = ("NoSuchKey", "404", "NotFound")
CHANGED = ("PreconditionFailed", "412")


class S3UriError(ValueError):
    pass


def parse_uri(uri: str) -> tuple[str, str]:
    """s3://bucket/some/key -> ("bucket", "some/key"); the key may be empty."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if not uri.startswith("s3://") or not bucket:
        raise S3UriError(f"not an s3://bucket/key URI: {uri!r}")
    return bucket, key


def client(endpoint_url: str | None = None) -> Any:
    """One boto3 S3 client per (process, endpoint), made under a lock (sessions are not thread-safe)."""
    with _clients_lock:
        return _client(os.getpid(), endpoint_url or None)


@functools.cache
def _client(pid: int, endpoint_url: str | None) -> Any:
    options: dict[str, Any] = {
        "retries": {"mode": os.environ.get("AWS_RETRY_MODE") or "standard",
                    "max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS") or 5)},
        "connect_timeout": 10, "read_timeout": 120, "max_pool_connections": 32,
    }
    if endpoint_url:
        options["s3"] = {"addressing_style": "path"}  # S3-compatible stores (MinIO, Ceph, moto) want it
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=Config(**options))


def error_code(exc: BaseException) -> str | None:
    if isinstance(exc, botocore.exceptions.ClientError):
        return str(exc.response.get("Error", {}).get("Code"))
    return None


def is_s3_error(exc: BaseException) -> bool:
    """An error of botocore's (the request failed), not of genq's."""
    return isinstance(exc, S3UriError) or type(exc).__module__.startswith("botocore")


def describe(exc: BaseException, uri: str) -> str:
    """A one-line reason that names the object, for CLI errors."""
    code = error_code(exc)
    if code == "NoSuchBucket":
        return f"{uri}: no such bucket"
    if code in MISSING:
        return f"{uri}: no such object"
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return f"{uri}: access denied ({code}); check the AWS credentials"
    if isinstance(exc, botocore.exceptions.NoCredentialsError):
        return f"{uri}: no AWS credentials found (env AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile or a role)"
    return f"{uri}: {exc}" if isinstance(exc, S3UriError) else f"{uri}: {type(exc).__name__}: {exc}"


class S3Store:
    """An s3://bucket/prefix output as a truth.Store; create() is a conditional PUT (If-None-Match: *)."""

    def __init__(self, uri: str, endpoint_url: str | None = None) -> None:
        self.uri_root = uri.rstrip("/")  # parsed when used: building a sink never raises
        self.endpoint_url = endpoint_url

    def uri(self, rel: str) -> str:
        return f"{self.uri_root}/{rel}"

    def read(self, rel: str) -> bytes | None:
        try:
            return read_object(self.uri(rel), self.endpoint_url)
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) in MISSING:
                return None
            raise

    def create(self, rel: str, data: bytes) -> bool:
        try:
            self.put(rel, data, IfNoneMatch="*")
            return True
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) in (*CHANGED, "ConditionalRequestConflict", "409"):
                return False
            raise

    def put(self, rel: str, data: bytes, **conditions: str) -> None:
        # No Content-Encoding for .gz: clients would unzip on download, and the size would no longer
        # match the marker's byte count.
        kinds = {"gz": "application/gzip", "json": "application/json"}
        kind = kinds.get(rel.rsplit(".", 1)[-1], "application/x-ndjson")
        bucket, key = parse_uri(self.uri(rel))
        client(self.endpoint_url).put_object(Bucket=bucket, Key=key, Body=data, ContentType=kind, **conditions)

    def swap(self, rel: str, change: Callable[[bytes | None], bytes | None]) -> None:
        """`rel` replaced by change(what is there) (None: left) by a PUT conditional on the ETag read (If-Match;
        If-None-Match: * where there was none): another writer's change meanwhile is read and changed again."""
        bucket, key = parse_uri(self.uri(rel))
        while True:
            try:
                got = client(self.endpoint_url).get_object(Bucket=bucket, Key=key)
                old, unchanged = got["Body"].read(), {"IfMatch": got["ETag"]}
            except botocore.exceptions.ClientError as exc:
                if error_code(exc) not in MISSING:
                    raise
                old, unchanged = None, {"IfNoneMatch": "*"}
            if (new := change(old)) is None:
                return
            try:
                return self.put(rel, new, **unchanged)
            except botocore.exceptions.ClientError as exc:
                if error_code(exc) not in (*CHANGED, "ConditionalRequestConflict", "409"):
                    raise

    def names(self, rel_dir: str) -> list[str]:
        bucket, prefix = parse_uri(self.uri(rel_dir) + "/")
        pages = client(self.endpoint_url).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        found = (item["Key"][len(prefix):] for page in pages for item in page.get("Contents", []))
        return [name for name in found if "/" not in name]

    def open(self, rel: str) -> io.BufferedReader:
        return open_stream(self.uri(rel), self.endpoint_url)


class ObjectReader(io.RawIOBase):
    """An S3 object read by GETs pinned to its ETag; a body that breaks is resumed where it left off (backoff
    0.5 s .. 8 s); a seek starts the next GET there. Without a window one GET streams to the end; with one
    (Parquet seeks), each GET asks for the window or the read's size, whichever is more, and is read whole,
    so a seek never abandons a body (which would drop its connection)."""

    def __init__(self, s3: Any, bucket: str, key: str, window: int | None = None) -> None:
        super().__init__()
        self.s3, self.bucket, self.key, self.window = s3, bucket, key, window
        head = s3.head_object(Bucket=bucket, Key=key)
        self.size, self.etag = int(head["ContentLength"]), head.get("ETag")
        self.pos = self.end = self.resumes = self._resumed_at = 0
        self._body: Any = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        pos = max(0, offset + {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence])
        if pos != self.pos:
            self._drop()
            self.pos = pos
        return pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        while self.pos < self.size:
            try:
                if self._body is None:
                    self.end = min(self.size, self.pos + max(self.window, len(view))) if self.window else self.size
                    pinned = {"IfMatch": self.etag} if self.etag else {}
                    self._body = self.s3.get_object(Bucket=self.bucket, Key=self.key, **pinned,
                                                    Range=f"bytes={self.pos}-{self.end - 1}")["Body"]
                data = self._body.read(min(len(view), self.end - self.pos))
            except _STREAM_ERRORS as exc:
                self._resume(exc)
                continue
            if not data:
                self._resume(EOFError(f"body ended at byte {self.pos:,} of {self.size:,}"))
                continue
            view[: len(data)] = data
            self.pos += len(data)
            if self.pos == self.end:
                self._drop()  # read whole: its connection is back in the pool
            if self.resumes and self.pos - self._resumed_at > RESUME_RESET_BYTES:
                self.resumes = 0  # a long object may meet several blips over hours
            return len(data)
        return 0

    def _resume(self, exc: BaseException) -> None:
        self._drop()
        self.resumes += 1
        if self.resumes > STREAM_RESUMES:
            raise OSError(f"s3://{self.bucket}/{self.key}: reading failed at byte {self.pos:,} "
                          f"after {STREAM_RESUMES} resumes: {exc}") from exc
        log.warning("s3://%s/%s: %s at byte %s; resuming", self.bucket, self.key, exc, f"{self.pos:,}")
        time.sleep(min(0.5 * 2 ** (self.resumes - 1), 8))
        self._resumed_at = self.pos

    def _drop(self) -> None:
        if self._body is not None:
            with contextlib.suppress(Exception):  # the connection may be broken already
                self._body.close()
            self._body = None

    def close(self) -> None:
        self._drop()
        super().close()


def open_stream(uri: str, endpoint_url: str | None = None, buffer_size: int = 1 << 20, *,
                seekable: bool = False) -> io.BufferedReader:
    """A buffered reader of an S3 object; a seeking one reads 8 MiB windows (a Parquet reader's reads share them)."""
    bucket, key = parse_uri(uri)
    window = 8 << 20 if seekable else None
    return io.BufferedReader(ObjectReader(client(endpoint_url), bucket, key, window), window or buffer_size)


def read_object(uri: str, endpoint_url: str | None = None, byte_range: tuple[int, int] | None = None) -> bytes:
    """A small object (a shard, a marker), or bytes [start, end) of one, in one GET."""
    bucket, key = parse_uri(uri)
    ranged = {"Range": f"bytes={byte_range[0]}-{byte_range[1] - 1}"} if byte_range else {}
    return client(endpoint_url).get_object(Bucket=bucket, Key=key, **ranged)["Body"].read()
