"""A local (or shared) output folder as a Store, and the one atomic file write genq uses: every file
is written beside its target and renamed (or, to be created once, hard-linked) into place, so a
reader never sees half a shard, marker, export or progress file."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

_UMASK = os.umask(0o022)  # read by setting it: set back at once, at import, before any file is written
os.umask(_UMASK)
# What open() would give a new file (0644 under umask 022): mkstemp's files are 0600, which the
# rename would carry into place, and teammates could not read the shards and exports.
FILE_MODE = 0o666 & ~_UMASK


def _temporary(target: Path, data: bytes | Callable[[BinaryIO], Any]) -> tuple[str, Any]:
    """A finished, fsynced file beside `target` with FILE_MODE: its name, and what writing returned."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as out:
            value = out.write(data) if isinstance(data, bytes) else data(out)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp, value


def write_atomic(path: str | os.PathLike[str], data: bytes | Callable[[BinaryIO], Any]) -> Any:
    """Write `data` (bytes, or a function that writes to the open file and returns a value) whole,
    replacing what is at `path`; returns what the function returned."""
    tmp, value = _temporary(Path(path), data)
    try:
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return value


def create_atomic(path: str | os.PathLike[str], data: bytes) -> bool:
    """Write `data` whole at `path` only if nothing is there (False when something is): a hard link
    is the one step that both creates and fails if the name exists."""
    tmp, _ = _temporary(Path(path), data)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        Path(tmp).unlink(missing_ok=True)


class LocalStore:
    """A job output folder's files by path relative to it (truth.Store)."""

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

    def open(self, rel: str) -> BinaryIO:
        return open(self.uri(rel), "rb")
