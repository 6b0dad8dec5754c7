"""Where shards go. One shard per batch, named by batch id, so a re-run batch
overwrites its shard instead of adding a second copy.

Layout under the job's output (a directory, or s3://bucket/prefix):
  JOB/shards/BATCH.jsonl[.gz]     the results, one JSON object a line
  JOB/manifest/BATCH.json         written after its shard: {batch, uri, records, bytes, at}
A reader lists manifest/ and reads only the shards named there: a shard
without a marker may still be being written.
"""

from __future__ import annotations

import gzip
import os
import time
from pathlib import Path
from typing import Protocol

import msgspec

from genq.records import JobConfig, Result, ShardInfo

_encoder = msgspec.json.Encoder()


class Sink(Protocol):
    def write_shard(self, job: str, batch_id: str, data: bytes, records: int) -> ShardInfo: ...


def shard_bytes(results: list[Result], compression: str) -> bytes:
    ordered = sorted(results, key=lambda r: r.index)
    data = b"".join(_encoder.encode(r) + b"\n" for r in ordered)
    # mtime=0: the same results give byte-identical shards.
    return gzip.compress(data, mtime=0) if compression == "gzip" else data


def shard_name(batch_id: str, compression: str) -> str:
    return f"{batch_id}.jsonl.gz" if compression == "gzip" else f"{batch_id}.jsonl"


class LocalSink:
    def __init__(self, root: str, compression: str = "none") -> None:
        self.root = Path(root)
        self.compression = compression

    def write_shard(self, job: str, batch_id: str, data: bytes, records: int) -> ShardInfo:
        path = self.root / job / "shards" / shard_name(batch_id, self.compression)
        _atomic_write(path, data)
        info = ShardInfo(batch=batch_id, uri=str(path), records=records, bytes=len(data), at=time.time())
        _atomic_write(self.root / job / "manifest" / f"{batch_id}.json", _encoder.encode(info) + b"\n")
        return info


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def open_sink(config: JobConfig) -> Sink:
    if config.output.startswith("s3://"):
        from genq.s3 import S3Sink  # boto3 is only imported when a job writes to S3

        return S3Sink(config.output, compression=config.compression, endpoint_url=config.s3_endpoint_url)
    return LocalSink(config.output, compression=config.compression)
