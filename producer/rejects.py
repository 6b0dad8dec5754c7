"""The rejects file, written as rejects are found (never all held), sorted by line: rejects below the
line the enqueuer has checked up to (`release`) are written then. Written as PATH.partial, renamed
at the end; `discard` removes it and the folders it made. A write error is reported, not fatal;
no path (a dry run): nothing written."""

from __future__ import annotations

import heapq
import os
from pathlib import Path
from typing import BinaryIO

import msgspec

from genq.core.records import Rejected

SHOWN = 20  # the first rejects kept for the terminal; the file has them all

_encoder = msgspec.json.Encoder()


class RejectsFile:
    def __init__(self, path: str | None) -> None:
        self.path = path
        self.count = 0
        self.first: list[Rejected] = []  # the SHOWN lowest lines
        self.error: OSError | None = None
        self._held: list[tuple[int, int, Rejected]] = []  # a heap by line
        self._out: BinaryIO | None = None
        self._made: list[Path] = []  # the folders this created, deepest first
        self._partial = f"{path}.partial"

    def add(self, rejected: Rejected) -> None:
        self.count += 1
        heapq.heappush(self._held, (rejected.line, self.count, rejected))

    def release(self, below_line: int | None) -> None:
        """Write the rejects of lines before below_line (None: all of them)."""
        while self._held and (below_line is None or self._held[0][0] < below_line):
            self._write(heapq.heappop(self._held)[2])

    def close(self) -> None:
        """Write what is held and move the file into place."""
        self.release(None)
        if self._out is not None and self.path is not None:
            self._out.close()
            self._out = None
            try:
                os.replace(self._partial, self.path)
            except OSError as exc:
                self.error = exc

    def discard(self) -> None:
        self._held.clear()
        if self._out is not None:
            self._out.close()
            self._out = None
            Path(self._partial).unlink(missing_ok=True)
        for folder in self._made:
            try:
                folder.rmdir()
            except OSError:
                break

    def _write(self, rejected: Rejected) -> None:
        if len(self.first) < SHOWN:
            self.first.append(rejected)
        if self.error is not None or self.path is None:
            return
        try:
            if self._out is None:
                folder = Path(self.path).parent
                self._made = [p for p in (folder, *folder.parents) if not p.exists()]
                folder.mkdir(parents=True, exist_ok=True)
                self._out = open(self._partial, "wb")  # noqa: SIM115 (closed in close/discard)
            self._out.write(_encoder.encode(rejected) + b"\n")
        except OSError as exc:
            self.error = exc
