"""How much of an input is queued: what enqueue's percent and ETA are made of.

The percent is of the rows handed on (queued, skipped or rejected), not of the rows read: enqueue's
reading thread runs up to READ_AHEAD chunks (16-24K rows) ahead of what is queued, so on an input of a
few chunks the part read says 100% while most of it is still to queue (#28). The reading thread notes
the position after each chunk it reads (read_upto, passed along with the chunk); the enqueuer says how
many rows are handed on (settle), and the position of that row is interpolated between the marks.

The position is filled in by the source as it opens the input (genq.producer.sources, genq.producer.parquet):
- uncompressed JSONL, local or S3: the end of the last line parsed, of the file's size;
- gzip-compressed JSONL (.gz), local or S3: the compressed bytes read so far, of the file's size
  (the decompressed size is not known before the end);
- Parquet, local or S3: the rows read, of the row count in the file's metadata.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any, BinaryIO

BYTES, ROWS = "bytes", "rows"


class Meter:
    def __init__(self) -> None:
        self.total = 0  # bytes (a .gz input: compressed) or rows; 0: not known
        self.unit = BYTES
        self.compressed = False
        self.done = 0  # of total: bytes parsed, or rows read
        self._raw: Any = None  # a .gz input's stream: its position is the compressed bytes read
        self.settled = 0.0  # of total: where the rows handed on end (the enqueuer's side)
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
        self.total, self.unit, self.compressed = int(size), BYTES, compressed
        if compressed:
            self._raw = raw

    def of_rows(self, rows: int) -> None:
        self.total, self.unit = rows, ROWS

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
        """`rows` rows (rejected ones included) were read in all, ending at `position` (a position() taken then)."""
        self._marks.append((rows, position))

    def settle(self, rows: int) -> None:
        """The first `rows` rows read are queued, skipped or rejected."""
        marks = self._marks
        while len(marks) > 1 and marks[1][0] <= rows:
            marks.popleft()  # older marks: every row up to them is settled
        (r0, p0), at = marks[0], float(marks[0][1])
        if len(marks) > 1 and rows > r0:
            r1, p1 = marks[1]
            at = p0 + (p1 - p0) * (rows - r0) / (r1 - r0)  # rows of a chunk are about the same size
        self.settled = max(self.settled, at)

    def finish(self) -> None:
        """Every row is read to the end and handed on: a .gz (or S3) stream's last position may
        stop short of the size, and it is still all of it."""
        self.settled = float(self.total)

    def fraction(self) -> float | None:
        """The part handed on, 0..1; None when the size is not known."""
        if self.total <= 0:
            return None
        return min(1.0, self.settled / self.total)

    def of_what(self) -> str:
        """'12.3 MiB', '4.1 MiB compressed' or '654,676 rows'."""
        if self.unit == ROWS:
            return f"{self.total:,} rows"
        return f"{self.total / 2**20:,.1f} MiB" + (" compressed" if self.compressed else "")
