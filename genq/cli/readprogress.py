"""enqueue's progress line: prompts read and their rate, and for an input whose size is known
(a local uncompressed JSONL file) the percent read and an ETA, from the byte offset of the
last line read against the file's size."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

from genq.core.records import Rejected
from genq.producer.rows import Row


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 90:
        return f"{seconds}s"
    if seconds < 90 * 60:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"


class ReadProgress:
    def __init__(self, input_uri: str) -> None:
        plain = "://" not in input_uri and not input_uri.endswith((".gz", ".parquet")) and os.path.isfile(input_uri)
        self.size: int | None = os.path.getsize(input_uri) if plain else None
        self.position = 0  # bytes of the input read (the end of the last line parsed)
        self.started = time.monotonic()

    def track(self, rows: Iterator[Row | Rejected]) -> Iterator[Row | Rejected]:
        for item in rows:
            if isinstance(item, Row) and item.end > self.position:
                self.position = item.end
            yield item

    def line(self, read: int, queued: int) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        text = f"read {read:,} prompts ({read / elapsed:,.0f}/s), queued {queued:,}"
        if self.size:
            fraction = min(1.0, self.position / self.size)
            eta = elapsed * (1 - fraction) / fraction if fraction > 0 else None
            text += f" · {100 * fraction:.1f}% of {self.size / 2**20:,.1f} MiB" + (
                f", ETA {_duration(eta)}" if eta is not None else "")
        return text
