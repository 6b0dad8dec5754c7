"""S3 for genq: the shard sink, streaming and seekable readers, and cheap clients.

Layout under a job's s3://bucket/prefix output (the same as genq.output.local.LocalSink):
  PREFIX/JOB/shards/BATCH.jsonl[.gz]   the batch's results, one JSON object a line,
                                       sorted by input index
  PREFIX/JOB/manifest/BATCH.json       a marker written after its shard succeeded:
                                       ShardInfo JSON {batch, uri, records, bytes, at}
A reader (a training job, `genq export`) lists PREFIX/JOB/manifest/ and reads only
the shards named there: a shard without a marker may still be being written, or
be an orphan of an attempt that failed between the two uploads. Keys depend only
on the batch id; a marker is created once (a conditional PUT) and a shard is never
overwritten with other bytes (genq.output.truth).

Credentials and endpoint follow boto3's standard chain (env, profile, instance
role; AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3); a job's --s3-endpoint-url wins
when set. AWS_MAX_ATTEMPTS / AWS_RETRY_MODE tune botocore's retries (default:
standard mode, 5 attempts); past those, the worker keeps the batch's results in
Redis and retries the whole shard with its own backoff, acknowledging the batch
only after both uploads succeeded.
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

from genq.core.records import ShardInfo
from genq.output import layout, truth

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


def join_key(*parts: str) -> str:
    return layout.join(*parts)


def client(endpoint_url: str | None = None) -> Any:
    """One boto3 S3 client per (process, endpoint).

    Creating a client costs tens of milliseconds and reads config files, so it
    is done once. Low-level clients are thread-safe (sessions are not: each
    client gets its own session, made under a lock); the pid in the key keeps a
    forked child from reusing its parent's connection pool.
    """
    endpoint_url = endpoint_url or None
    key = (os.getpid(), endpoint_url)
    found = _clients.get(key)
    if found is not None:
        return found
    with _clients_lock:
        found = _clients.get(key)
        if found is None:
            found = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=_config(endpoint_url))
            _clients[key] = found
        return found


def _config(endpoint_url: str | None) -> Config:
    retries = {
        "mode": os.environ.get("AWS_RETRY_MODE") or "standard",
        "max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS") or 5),
    }
    options: dict[str, Any] = {
        "retries": retries,
        "connect_timeout": 10,
        "read_timeout": 120,
        "max_pool_connections": 32,
    }
    if endpoint_url:
        # S3-compatible stores (MinIO, Ceph, moto) usually want path-style addressing.
        options["s3"] = {"addressing_style": "path"}
    return Config(**options)


def error_code(exc: BaseException) -> str | None:
    if isinstance(exc, botocore.exceptions.ClientError):
        return str(exc.response.get("Error", {}).get("Code"))
    return None


def describe(exc: BaseException, uri: str) -> str:
    """A one-line reason that names the object, for CLI errors."""
    code = error_code(exc)
    if code in ("NoSuchKey", "404", "NotFound"):
        return f"{uri}: no such object"
    if code == "NoSuchBucket":
        return f"{uri}: no such bucket"
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return f"{uri}: access denied ({code}); check the AWS credentials"
    if isinstance(exc, botocore.exceptions.NoCredentialsError):
        return f"{uri}: no AWS credentials found (env AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile or a role)"
    return f"{uri}: {type(exc).__name__}: {exc}"


class S3Store:
    """An s3://bucket/prefix output as a truth.Store; create() is a conditional PUT
    (If-None-Match: *), so a marker is created once even with two writers."""

    def __init__(self, uri: str, endpoint_url: str | None = None) -> None:
        self.uri_root = uri.rstrip("/")
        self.endpoint_url = endpoint_url

    def _key(self, rel: str) -> tuple[str, str]:
        bucket, prefix = parse_uri(self.uri_root)
        return bucket, join_key(prefix, rel)

    def uri(self, rel: str) -> str:
        bucket, key = self._key(rel)
        return f"s3://{bucket}/{key}"

    def read(self, rel: str) -> bytes | None:
        bucket, key = self._key(rel)
        try:
            return client(self.endpoint_url).get_object(Bucket=bucket, Key=key)["Body"].read()
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise

    def create(self, rel: str, data: bytes) -> bool:
        bucket, key = self._key(rel)
        try:
            client(self.endpoint_url).put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*",
                                                 ContentType=_content_type(rel))
            return True
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return False
            raise

    def put(self, rel: str, data: bytes) -> None:
        bucket, key = self._key(rel)
        client(self.endpoint_url).put_object(Bucket=bucket, Key=key, Body=data, ContentType=_content_type(rel))

    def names(self, rel_dir: str) -> list[str]:
        base = self._key(rel_dir)[1] + "/"
        return [key[len(base):] for key, _ in list_keys(self.uri(rel_dir) + "/", self.endpoint_url)
                if "/" not in key[len(base):]]


def _content_type(rel: str) -> str:
    # No Content-Encoding for .gz: clients would then unzip on download and the stored
    # size would no longer match the marker's byte count.
    if rel.endswith(".gz"):
        return "application/gzip"
    return "application/json" if rel.endswith(".json") else "application/x-ndjson"


class S3Sink:
    """Writes each batch's shard, then its manifest marker (see the module docstring)."""

    def __init__(self, uri: str, compression: str = "none", endpoint_url: str | None = None,
                 incarnation: str = "") -> None:
        # Nothing here may raise: the engine builds the sink outside its retry
        # loop. A bad URI or endpoint fails in write_shard, where the engine logs
        # it and retries (keeping the batch's results in Redis).
        self.uri = uri.rstrip("/")
        self.compression = compression
        self.endpoint_url = endpoint_url
        self.incarnation = incarnation
        self.store = S3Store(self.uri, endpoint_url)

    @property
    def bucket(self) -> str:
        return parse_uri(self.uri)[0]

    @property
    def prefix(self) -> str:
        return parse_uri(self.uri)[1]

    def shard_key(self, job: str, batch_id: str) -> str:
        return join_key(self.prefix, job, layout.SHARDS_DIR, layout.shard_name(batch_id, self.compression))

    def marker_key(self, job: str, batch_id: str) -> str:
        return join_key(self.prefix, job, layout.MANIFEST_DIR, layout.marker_name(batch_id))

    def write_shard(self, job: str, batch_id: str, data: bytes, records: int, at: float | None = None,
                    outcome: truth.Outcome | None = None) -> ShardInfo:
        """The shard, then its marker (created once: truth.commit_shard; raises truth.AlreadyWritten)."""
        return truth.commit_shard(self.store, job, batch_id, data, records, time.time() if at is None else at,
                                  compression=self.compression, incarnation=self.incarnation, outcome=outcome)


class ObjectStream(io.RawIOBase):
    """A GET streamed front to back; a connection that breaks mid-body is
    resumed with a Range request pinned to the first ETag, so a many-GB input
    survives a network blip and never mixes two versions of the object."""

    def __init__(self, s3: Any, bucket: str, key: str) -> None:
        super().__init__()
        self.s3, self.bucket, self.key = s3, bucket, key
        self.pos = 0
        self.etag: str | None = None
        self.size = 0
        self.resumes = 0
        self._resumed_at = 0
        self._body = self._open()

    def _open(self) -> Any:
        kwargs: dict[str, Any] = {}
        if self.pos:
            kwargs["Range"] = f"bytes={self.pos}-"
        if self.etag:
            kwargs["IfMatch"] = self.etag
        resp = self.s3.get_object(Bucket=self.bucket, Key=self.key, **kwargs)
        if self.etag is None:
            self.etag = resp.get("ETag")
            self.size = int(resp["ContentLength"])
        return resp["Body"]

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        while True:
            try:
                data = self._body.read(len(view))
            except _STREAM_ERRORS as exc:
                self._resume(exc)
                continue
            if not data and self.pos < self.size:
                self._resume(EOFError(f"body ended at byte {self.pos:,} of {self.size:,}"))
                continue
            view[: len(data)] = data
            self.pos += len(data)
            if self.resumes and self.pos - self._resumed_at > RESUME_RESET_BYTES:
                self.resumes = 0  # a long object may meet several blips over hours
            return len(data)

    def _resume(self, exc: BaseException) -> None:
        """Reopen at self.pos; the endpoint may be down for a while (backoff 0.5 s .. 8 s)."""
        try:
            self._body.close()
        except Exception:  # the connection is already broken
            pass
        while True:
            self.resumes += 1
            if self.resumes > STREAM_RESUMES:
                raise OSError(f"s3://{self.bucket}/{self.key}: reading failed at byte {self.pos:,} "
                              f"after {STREAM_RESUMES} resumes: {exc}") from exc
            log.warning("s3://%s/%s: %s at byte %s; resuming", self.bucket, self.key, exc, f"{self.pos:,}")
            time.sleep(min(0.5 * 2 ** (self.resumes - 1), 8))
            try:
                self._body = self._open()
                self._resumed_at = self.pos
                return
            except _STREAM_ERRORS as again:
                exc = again

    def close(self) -> None:
        if not self.closed:
            try:
                self._body.close()
            finally:
                super().close()


def open_stream(uri: str, endpoint_url: str | None = None, buffer_size: int = 1 << 20) -> io.BufferedReader:
    """A buffered, forward-only reader of an S3 object. Raises botocore errors (see describe)."""
    bucket, key = parse_uri(uri)
    return io.BufferedReader(ObjectStream(client(endpoint_url), bucket, key), buffer_size=buffer_size)


class RangeFile(io.RawIOBase):
    """A seekable S3 object read with ranged GETs (for Parquet, whose footer is at the end)."""

    def __init__(self, s3: Any, bucket: str, key: str) -> None:
        super().__init__()
        self.s3, self.bucket, self.key = s3, bucket, key
        head = s3.head_object(Bucket=bucket, Key=key)
        self.size = int(head["ContentLength"])
        self.etag = head.get("ETag")
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = min(len(view), self.size - self.pos)
        if want <= 0:
            return 0
        data = self._get(self.pos, self.pos + want - 1)
        view[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def _get(self, first: int, last: int) -> bytes:
        for attempt in range(STREAM_RESUMES + 1):
            try:
                kwargs = {"IfMatch": self.etag} if self.etag else {}
                resp = self.s3.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes={first}-{last}", **kwargs)
                return resp["Body"].read()
            except _STREAM_ERRORS as exc:
                if attempt == STREAM_RESUMES:
                    raise OSError(f"s3://{self.bucket}/{self.key}: ranged read failed: {exc}") from exc
                time.sleep(min(0.5 * 2 ** attempt, 8))
        raise AssertionError("unreachable")


def open_seekable(uri: str, endpoint_url: str | None = None, buffer_size: int = 8 << 20) -> io.BufferedReader:
    """A seekable reader with an 8 MiB read-ahead: small reads share one GET."""
    bucket, key = parse_uri(uri)
    return io.BufferedReader(RangeFile(client(endpoint_url), bucket, key), buffer_size=buffer_size)


def list_keys(uri: str, endpoint_url: str | None = None) -> Iterator[tuple[str, int]]:
    """(key, size) of every object under an s3:// prefix, in key order."""
    bucket, prefix = parse_uri(uri)
    paginator = client(endpoint_url).get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            yield item["Key"], int(item["Size"])


def read_object(uri: str, endpoint_url: str | None = None) -> bytes:
    """A small object (a manifest marker) in one GET."""
    bucket, key = parse_uri(uri)
    return client(endpoint_url).get_object(Bucket=bucket, Key=key)["Body"].read()


def upload_file(path: str, uri: str, endpoint_url: str | None = None) -> None:
    """Upload a local file (multipart when large), e.g. an export written locally first."""
    bucket, key = parse_uri(uri)
    client(endpoint_url).upload_file(path, bucket, key)
