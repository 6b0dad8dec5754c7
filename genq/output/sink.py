"""Where a batch's shard goes: one Sink for local and S3 outputs (a truth.Store under it), and the
shard's bytes."""

from __future__ import annotations

import gzip
import time

import msgspec

from genq.core.records import JobConfig, Result, ShardInfo
from genq.output import truth
from genq.output.local import LocalStore

_encoder = msgspec.json.Encoder()


class Sink:
    """Writes a job's shards into its output. Building one never raises: a bad URI or endpoint fails in
    write_shard, where the engine logs it and retries, keeping the batch's results in Redis."""

    def __init__(self, store: truth.Store, compression: str = "none", incarnation: str = "") -> None:
        self.store = store
        self.compression = compression
        self.incarnation = incarnation

    def write_shard(self, job: str, batch_id: str, data: bytes, records: int, at: float | None = None,
                    outcome: truth.Outcome | None = None) -> ShardInfo:
        """The shard, then its marker (created once: truth.commit_shard; raises truth.AlreadyWritten)."""
        return truth.commit_shard(self.store, job, batch_id, data, records, time.time() if at is None else at,
                                  compression=self.compression, incarnation=self.incarnation, outcome=outcome)


def shard_bytes(results: list[Result], compression: str) -> bytes:
    data = b"".join(_encoder.encode(r) + b"\n" for r in sorted(results, key=lambda r: r.index))
    return gzip.compress(data, mtime=0) if compression == "gzip" else data  # mtime=0: same results, same bytes


def open_sink(config: JobConfig) -> Sink:
    return Sink(open_store(config.output, config.s3_endpoint_url), config.compression, config.incarnation)


def open_store(output: str, endpoint_url: str | None = None) -> truth.Store:
    """A job output (a folder or s3://bucket/prefix) as a truth.Store."""
    if output.startswith("s3://"):
        from genq.output.s3 import S3Store  # boto3 only when an output is on S3

        return S3Store(output, endpoint_url)
    return LocalStore(output)
