"""The job's output-length histogram (keys.job_hist): one bucketing for writers and readers."""

from __future__ import annotations

import math


def length_bucket(tokens: int) -> int:
    """Log-spaced bucket (4 per doubling) of a completion's length in tokens."""
    return int(round(4 * math.log2(tokens + 1)))


def bucket_bounds(bucket: int) -> tuple[float, float]:
    """Token range a bucket stands for (inverse of length_bucket)."""
    return 2 ** ((bucket - 0.5) / 4) - 1, 2 ** ((bucket + 0.5) / 4) - 1
