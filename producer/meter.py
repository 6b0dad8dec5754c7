"""How much of an input has been read: what enqueue's percent and ETA are made of.

Filled in by the source as it opens the input (genq.producer.sources, genq.producer.parquet):
- uncompressed JSONL, local or S3: the end of the last line parsed, of the file's size;
- gzip-compressed JSONL (.gz), local or S3: the compressed bytes read so far, of the file's size
  (the decompressed size is not known before the end);
- Parquet, local or S3: the rows read, of the row count in the file's metadata.
"""

from __future__ import annotations

import os
from typing import Any, BinaryIO

BYTES, ROWS = "bytes", "rows"


class Meter:
    def __init__(self) -> None:
        self.total = 0  # bytes (a .gz input: compressed) or rows; 0: not known
        self.unit = BYTES
        self.compressed = False
        self.done = 0  # of total: bytes parsed, or rows read
        self._raw: Any = None  # a .gz input's stream: its position is the compressed bytes read

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

    def fraction(self) -> float | None:
        """The part read, 0..1; None when the size is not known."""
        if self.total <= 0:
            return None
        return min(1.0, self.position() / self.total)

    def of_what(self) -> str:
        """'12.3 MiB', '4.1 MiB compressed' or '654,676 rows'."""
        if self.unit == ROWS:
            return f"{self.total:,} rows"
        return f"{self.total / 2**20:,.1f} MiB" + (" compressed" if self.compressed else "")
