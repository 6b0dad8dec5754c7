"""How much of an input is queued (enqueue's percent and ETA): of the rows handed on, not of those read,
which run up to two chunks ahead. The reader marks its position after each chunk (read_upto), the
enqueuer says how many rows are handed on (settle), interpolated between marks. Positions are bytes
parsed (JSONL), compressed bytes read (.gz: its unpacked size is unknown) or rows (Parquet's footer)."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from typing import BinaryIO


class Meter:
    def __init__(self) -> None:
        self.total = 0  # bytes (a .gz input: compressed) or rows; 0: not known
        self.unit = "MiB"  # what total counts, as shown: "MiB", "MiB compressed" or "rows"
        self.done = 0  # the reader's count: bytes parsed, or rows read
        self.settled = 0.0  # of total: where the rows handed on end
        self.position: Callable[[], int] = lambda: self.done  # where the reader is, in units of total
        self._marks: deque[tuple[int, int]] = deque([(0, 0)])  # (rows read in all, position after them)

    def of_stream(self, stream: BinaryIO, *, compressed: bool) -> None:
        """A JSONL input's binary stream (a local file, or genq.output.s3's object stream)."""
        size = getattr(getattr(stream, "raw", None), "size", None)  # an S3 object: its ContentLength
        try:
            self.total = int(size if size is not None else os.fstat(stream.fileno()).st_size)
        except (OSError, ValueError):
            self.total = 0
        if compressed:
            self.unit, self.position = "MiB compressed", lambda: _tell(stream, self.total)

    def of_rows(self, rows: int) -> None:
        self.total, self.unit = rows, "rows"

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
        return f"{self.total:,} rows" if self.unit == "rows" else f"{self.total / 2**20:,.1f} {self.unit}"


def _tell(stream: BinaryIO, end: int) -> int:
    """The compressed bytes a stream has given (its end once it is closed: read to the end)."""
    try:
        return stream.tell()
    except (OSError, ValueError):
        return end
