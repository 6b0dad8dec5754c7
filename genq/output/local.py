"""Shards on a local (or shared) filesystem, and the one atomic file write genq uses.

Layout: genq.output.layout. Every file is written beside its target and renamed into
place, so a reader never sees half a shard, marker, export or progress file.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from genq.core.records import ShardInfo
from genq.output import layout

_encoder = msgspec.json.Encoder()


def write_atomic(path: str | os.PathLike[str], data: bytes | Callable[[BinaryIO], Any]) -> Any:
    """Write `data` (bytes, or a function that writes to the open file and returns a value)
    to a temporary file in the target's folder, fsync, then rename it into place."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            value = out.write(data) if isinstance(data, bytes) else data(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return value


class LocalSink:
    def __init__(self, root: str, compression: str = "none") -> None:
        self.root = root
        self.compression = compression

    def write_shard(self, job: str, batch_id: str, data: bytes, records: int, at: float | None = None) -> ShardInfo:
        path = layout.shard_path(self.root, job, batch_id, self.compression)
        write_atomic(path, data)
        info = ShardInfo(batch=batch_id, uri=path, records=records, bytes=len(data),
                         at=time.time() if at is None else at)
        write_atomic(layout.marker_path(self.root, job, batch_id), _encoder.encode(info) + b"\n")
        return info
