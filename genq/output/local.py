"""Shards on a local (or shared) filesystem, and the one atomic file write genq uses.

Layout: genq.output.layout. Every file is written beside its target and renamed (or, to be
created only once, hard-linked) into place, so a reader never sees half a shard, marker,
export or progress file.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from genq.core.records import ShardInfo
from genq.output import truth


def _umask() -> int:
    """The process's umask (read from /proc where it can be, which changes nothing; else set
    and set back at once, at import, before any thread writes a file)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# What open() would give a new file: 0644 under the usual umask 022. mkstemp's temporary
# files are 0600, which the rename would carry into place, and teammates could not read the
# shards, markers, job.json and exports.
FILE_MODE = 0o666 & ~_umask()


def _temporary(target: Path) -> tuple[int, str]:
    """A new file beside `target` (renamed or linked into place), with FILE_MODE."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.fchmod(fd, FILE_MODE)
    return fd, tmp


def write_atomic(path: str | os.PathLike[str], data: bytes | Callable[[BinaryIO], Any]) -> Any:
    """Write `data` (bytes, or a function that writes to the open file and returns a value)
    to a temporary file in the target's folder, fsync, then rename it into place."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _temporary(target)
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


def create_atomic(path: str | os.PathLike[str], data: bytes) -> bool:
    """Write `data` at `path` only if nothing is there (whole or not at all, like write_atomic):
    False when something is. A hard link of the finished temporary file is the one step that
    both creates and fails if the name exists."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _temporary(target)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.link(tmp, target)
        return True
    except FileExistsError:
        return False
    finally:
        Path(tmp).unlink(missing_ok=True)


class LocalStore:
    """A local (or shared) output folder as a truth.Store."""

    def __init__(self, root: str) -> None:
        self.root = root

    def uri(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}"

    def read(self, rel: str) -> bytes | None:
        try:
            return Path(self.uri(rel)).read_bytes()
        except FileNotFoundError:
            return None

    def create(self, rel: str, data: bytes) -> bool:
        return create_atomic(self.uri(rel), data)

    def put(self, rel: str, data: bytes) -> None:
        write_atomic(self.uri(rel), data)

    def names(self, rel_dir: str) -> list[str]:
        try:
            return sorted(os.listdir(self.uri(rel_dir)))
        except FileNotFoundError:
            return []


class LocalSink:
    def __init__(self, root: str, compression: str = "none", incarnation: str = "") -> None:
        self.root = root
        self.compression = compression
        self.incarnation = incarnation
        self.store = LocalStore(root)

    def write_shard(self, job: str, batch_id: str, data: bytes, records: int, at: float | None = None,
                    outcome: truth.Outcome | None = None) -> ShardInfo:
        """The shard, then its marker (created once: truth.commit_shard; raises truth.AlreadyWritten)."""
        return truth.commit_shard(self.store, job, batch_id, data, records, time.time() if at is None else at,
                                  compression=self.compression, incarnation=self.incarnation, outcome=outcome)
