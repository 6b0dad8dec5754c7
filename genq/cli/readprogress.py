"""enqueue's progress line: prompts read and their rate, and for an input whose size is known the
percent queued and an ETA (genq.producer.meter: bytes of a JSONL file, compressed bytes of a .gz
one, rows of a Parquet file's metadata; local or on S3)."""

from __future__ import annotations

import time

from genq.monitor.view import duration
from genq.producer.meter import Meter


class ReadProgress:
    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self.started = time.monotonic()

    def line(self, read: int, queued: int) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        text = f"read {read:,} prompts ({read / elapsed:,.0f}/s), queued {queued:,}"
        fraction = self.meter.fraction()
        if fraction is not None:
            text += f" · {100 * fraction:.1f}% of {self.meter.of_what()}"
            if fraction > 0:
                text += f", ETA {duration(elapsed * (1 - fraction) / fraction)}"
        return text
