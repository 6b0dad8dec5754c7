"""How much of an input is queued: what enqueue's percent and ETA are made of.

The percent is of the rows handed on (queued, skipped or rejected), not of the rows read: the reading
thread runs up to two chunks (16K rows) ahead of what is queued. The reader notes its position after
each chunk (read_upto); the enqueuer says how many rows are handed on (settle), and their position
is interpolated between the marks. Positions: the end of the last line parsed of an uncompressed
JSONL input; the compressed bytes read of a .gz one (its size unpacked is not known before the end);
the rows read of a Parquet one, of the count in its footer.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any, BinaryIO


class Meter:
    def __init__(self) -> None:
        self.total = 0  # bytes (a .gz input: compressed) or rows; 0: not known
        self.rows = False  # total counts rows, not bytes
        self.compressed = False
        self.done = 0  # of total: bytes parsed, or rows read
        self.settled = 0.0  # of total: where the rows handed on end
        self._raw: Any = None  # a .gz input's stream: its position is the compressed bytes read
        self._marks: deque[tuple[int, int]] = deque([(0, 0)])  # (rows read in all, position after them)

    def of_stream(self, stream: BinaryIO, *, compressed: bool) -> None:
        """A JSONL input's binary stream (a local file, or genq.output.s3's object stream)."""
        raw = getattr(stream, "raw", stream)
        size = getattr(raw, "size", None)  # an S3 object: its ContentLength
        if size is None:
            try:
                size = os.fstat(stream.fileno()).st_size
            except (OSError, AttributeError, ValueError):
                size = 0
        self.total, self.compressed = int(size), compressed
        self._raw = raw if compressed else None

    def of_rows(self, rows: int) -> None:
        self.total, self.rows = rows, True

    def position(self) -> int:
        if self._raw is None:
            return self.done
        pos = getattr(self._raw, "pos", None)  # an S3 object stream
        if pos is None:
            try:
                pos = self._raw.tell()
            except (OSError, ValueError):  # closed: read to the end
                pos = self.total
        return int(pos)

    def read_upto(self, rows: int, position: int) -> None:
        """`rows` rows (rejected ones included) were read in all, ending at `position`."""
        self._marks.append((rows, position))

    def settle(self, rows: int) -> None:
        """The first `rows` rows read are handed on; the percent never goes back."""
        marks = self._marks
        while len(marks) > 1 and marks[1][0] <= rows:
            marks.popleft()
        (r0, p0), at = marks[0], float(marks[0][1])
        if len(marks) > 1 and rows > r0:
            r1, p1 = marks[1]
            at = p0 + (p1 - p0) * (rows - r0) / (r1 - r0)  # rows of a chunk are about the same size
        self.settled = max(self.settled, at)

    def finish(self) -> None:
        """All read and handed on (a .gz or S3 stream's last position may stop short of its size)."""
        self.settled = float(self.total)

    def fraction(self) -> float | None:
        """The part handed on, 0..1; None when the size is not known."""
        return min(1.0, self.settled / self.total) if self.total > 0 else None

    def of_what(self) -> str:
        """'12.3 MiB', '4.1 MiB compressed' or '654,676 rows'."""
        if self.rows:
            return f"{self.total:,} rows"
        return f"{self.total / 2**20:,.1f} MiB" + (" compressed" if self.compressed else "")
