"""S3 for genq: an output prefix as a Store, streaming and seekable readers of inputs, cheap clients.

Credentials and endpoint follow boto3's chain (env, profile, instance role; AWS_ENDPOINT_URL /
AWS_ENDPOINT_URL_S3); a job's --s3-endpoint-url wins when set. AWS_MAX_ATTEMPTS / AWS_RETRY_MODE tune
botocore's retries (default: standard mode, 5 attempts); past those, the worker keeps the batch's
results in Redis and retries the whole shard with its own backoff.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import boto3
import botocore.exceptions
from botocore.config import Config

from genq.output import layout

log = logging.getLogger(__name__)

_clients: dict[tuple[int, str | None], Any] = {}
_clients_lock = threading.Lock()

# Errors while reading a response body: the connection broke, not the request.
_STREAM_ERRORS = (
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ResponseStreamingError,
    botocore.exceptions.IncompleteReadError,
    botocore.exceptions.ConnectionError,
    ConnectionError,
    TimeoutError,
)
STREAM_RESUMES = 8  # reopen attempts for a broken GET (about 40 s of backoff) before giving up
RESUME_RESET_BYTES = 64 << 20  # progress after which the resume budget is full again
_MISSING = ("NoSuchKey", "404", "NotFound")


class S3UriError(ValueError):
    pass


def parse_uri(uri: str) -> tuple[str, str]:
    """s3://bucket/some/key -> ("bucket", "some/key"); the key may be empty."""
    if not uri.startswith("s3://"):
        raise S3UriError(f"not an s3:// URI: {uri!r}")
    bucket, _, key = uri[len("s3://"):].partition("/")
    if not bucket:
        raise S3UriError(f"no bucket in {uri!r}: expected s3://bucket/key")
    return bucket, key


def client(endpoint_url: str | None = None) -> Any:
    """One boto3 S3 client per (process, endpoint): making one costs tens of milliseconds. Clients are
    thread-safe, sessions are not (one each, made under a lock); the pid keeps a forked child off its
    parent's connection pool."""
    key = (os.getpid(), endpoint_url or None)
    with _clients_lock:
        if key not in _clients:
            options: dict[str, Any] = {
                "retries": {"mode": os.environ.get("AWS_RETRY_MODE") or "standard",
                            "max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS") or 5)},
                "connect_timeout": 10, "read_timeout": 120, "max_pool_connections": 32,
            }
            if endpoint_url:
                options["s3"] = {"addressing_style": "path"}  # S3-compatible stores (MinIO, Ceph, moto) want it
            _clients[key] = boto3.session.Session().client("s3", endpoint_url=endpoint_url or None,
                                                           config=Config(**options))
        return _clients[key]


def error_code(exc: BaseException) -> str | None:
    if isinstance(exc, botocore.exceptions.ClientError):
        return str(exc.response.get("Error", {}).get("Code"))
    return None


def describe(exc: BaseException, uri: str) -> str:
    """A one-line reason that names the object, for CLI errors."""
    code = error_code(exc)
    if code in _MISSING:
        return f"{uri}: no such object"
    if code == "NoSuchBucket":
        return f"{uri}: no such bucket"
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return f"{uri}: access denied ({code}); check the AWS credentials"
    if isinstance(exc, botocore.exceptions.NoCredentialsError):
        return f"{uri}: no AWS credentials found (env AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile or a role)"
    return f"{uri}: {type(exc).__name__}: {exc}"


class S3Store:
    """An s3://bucket/prefix output as a truth.Store; create() is a conditional PUT (If-None-Match: *),
    so a marker is created once even with two writers."""

    def __init__(self, uri: str, endpoint_url: str | None = None) -> None:
        self.uri_root = uri.rstrip("/")  # parsed when used: building a sink never raises
        self.endpoint_url = endpoint_url

    def _key(self, rel: str) -> tuple[str, str]:
        bucket, prefix = parse_uri(self.uri_root)
        return bucket, layout.join(prefix, rel)

    def uri(self, rel: str) -> str:
        bucket, key = self._key(rel)
        return f"s3://{bucket}/{key}"

    def read(self, rel: str) -> bytes | None:
        bucket, key = self._key(rel)
        try:
            return client(self.endpoint_url).get_object(Bucket=bucket, Key=key)["Body"].read()
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) in _MISSING:
                return None
            raise

    def create(self, rel: str, data: bytes) -> bool:
        try:
            self._put(rel, data, IfNoneMatch="*")
            return True
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return False
            raise

    def put(self, rel: str, data: bytes) -> None:
        self._put(rel, data)

    def _put(self, rel: str, data: bytes, **conditions: str) -> None:
        # No Content-Encoding for .gz: clients would unzip on download, and the size would no longer
        # match the marker's byte count.
        kind = "application/gzip" if rel.endswith(".gz") else "application/json" if rel.endswith(".json") \
            else "application/x-ndjson"
        bucket, key = self._key(rel)
        client(self.endpoint_url).put_object(Bucket=bucket, Key=key, Body=data, ContentType=kind, **conditions)

    def names(self, rel_dir: str) -> list[str]:
        base = self._key(rel_dir)[1] + "/"
        return [key[len(base):] for key, _ in list_keys(self.uri(rel_dir) + "/", self.endpoint_url)
                if "/" not in key[len(base):]]

    def open(self, rel: str) -> io.BufferedReader:
        return open_stream(self.uri(rel), self.endpoint_url)


class ObjectReader(io.RawIOBase):
    """An S3 object read by one streaming GET (window None) or by ranged GETs of `window` bytes, which
    can seek (Parquet's footer is at the end). Every GET is pinned to the object's ETag, so two versions
    of it are never mixed, and a body that breaks is resumed where it left off (backoff 0.5 s .. 8 s):
    a many-GB input survives a network blip."""

    def __init__(self, s3: Any, bucket: str, key: str, window: int | None = None) -> None:
        super().__init__()
        self.s3, self.bucket, self.key, self.window = s3, bucket, key, window
        head = s3.head_object(Bucket=bucket, Key=key)
        self.size, self.etag = int(head["ContentLength"]), head.get("ETag")
        self.pos = self.resumes = self._resumed_at = self._until = 0
        self._body: Any = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self.window is not None

    def tell(self) -> int:
        return self.pos

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
                    self._body = self._open()
                data = self._body.read(len(view))
            except _STREAM_ERRORS as exc:
                self._resume(exc)
                continue
            if not data:  # this GET's range is read, or its body ended early
                early = self.pos < self._until
                self._drop()
                if early:
                    self._resume(EOFError(f"body ended at byte {self.pos:,} of {self.size:,}"))
                continue
            view[: len(data)] = data
            self.pos += len(data)
            if self.resumes and self.pos - self._resumed_at > RESUME_RESET_BYTES:
                self.resumes = 0  # a long object may meet several blips over hours
            return len(data)
        return 0

    def _open(self) -> Any:
        self._until = self.size if self.window is None else min(self.size, self.pos + self.window)
        pinned = {"IfMatch": self.etag} if self.etag else {}
        return self.s3.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes={self.pos}-{self._until - 1}",
                                  **pinned)["Body"]

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
            try:
                self._body.close()
            except Exception:  # the connection is already broken
                pass
            self._body = None

    def close(self) -> None:
        self._drop()
        super().close()


def open_stream(uri: str, endpoint_url: str | None = None, buffer_size: int = 1 << 20) -> io.BufferedReader:
    """A buffered, forward-only reader of an S3 object. Raises botocore errors (see describe)."""
    bucket, key = parse_uri(uri)
    return io.BufferedReader(ObjectReader(client(endpoint_url), bucket, key), buffer_size=buffer_size)


def open_seekable(uri: str, endpoint_url: str | None = None, buffer_size: int = 8 << 20) -> io.BufferedReader:
    """A seekable reader with an 8 MiB read-ahead: small reads share one GET."""
    bucket, key = parse_uri(uri)
    return io.BufferedReader(ObjectReader(client(endpoint_url), bucket, key, window=buffer_size),
                             buffer_size=buffer_size)


def list_keys(uri: str, endpoint_url: str | None = None) -> Iterator[tuple[str, int]]:
    """(key, size) of every object under an s3:// prefix, in key order."""
    bucket, prefix = parse_uri(uri)
    for page in client(endpoint_url).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            yield item["Key"], int(item["Size"])


def read_object(uri: str, endpoint_url: str | None = None) -> bytes:
    """A small object (a shard, a marker) in one GET."""
    bucket, key = parse_uri(uri)
    return client(endpoint_url).get_object(Bucket=bucket, Key=key)["Body"].read()


def upload_file(path: str, uri: str, endpoint_url: str | None = None) -> None:
    """Upload a local file (multipart when large), e.g. an export written locally first."""
    bucket, key = parse_uri(uri)
    client(endpoint_url).upload_file(path, bucket, key)
