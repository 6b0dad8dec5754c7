"""Where a batch's shard goes: the sink for a job's output, and the shard's bytes."""

from __future__ import annotations

import gzip
from typing import Protocol

import msgspec

from genq.core.records import JobConfig, Result, ShardInfo
from genq.output.local import LocalSink, LocalStore
from genq.output.truth import Outcome, Store

_encoder = msgspec.json.Encoder()


class Sink(Protocol):
    def write_shard(self, job: str, batch_id: str, data: bytes, records: int, at: float | None = None,
                    outcome: Outcome | None = None) -> ShardInfo: ...


def shard_bytes(results: list[Result], compression: str) -> bytes:
    ordered = sorted(results, key=lambda r: r.index)
    data = b"".join(_encoder.encode(r) + b"\n" for r in ordered)
    # mtime=0: the same results give byte-identical shards.
    return gzip.compress(data, mtime=0) if compression == "gzip" else data


def open_sink(config: JobConfig) -> Sink:
    if config.output.startswith("s3://"):
        from genq.output.s3 import S3Sink  # boto3 is only imported when a job writes to S3

        return S3Sink(config.output, compression=config.compression, endpoint_url=config.s3_endpoint_url,
                      incarnation=config.incarnation)
    return LocalSink(config.output, compression=config.compression, incarnation=config.incarnation)


def open_store(output: str, endpoint_url: str | None = None) -> Store:
    """A job output (a folder or s3://bucket/prefix) as a truth.Store."""
    if output.startswith("s3://"):
        from genq.output.s3 import S3Store

        return S3Store(output, endpoint_url)
    return LocalStore(output)
