"""How many batches a worker holds: one rule for the worker (worker/loops.py) and the
ETA's simulation of it (monitor/progress.py)."""

from __future__ import annotations

DEFAULT_PREFETCH = 2  # genq worker --prefetch: batches held at least (the current one and the next)
MAX_EXTRA_LOOPS = 14  # batches taken beyond --prefetch while held ones drain their tails


def reserve(prefetch: int, batch_size: int) -> int:
    """Unsent prompts a worker keeps in hand: (prefetch - 1) batches' worth, counted in prompts, not
    batches, because with heavy-tailed lengths several held batches can be in their tails at once."""
    return (prefetch - 1) * batch_size


def max_loops(prefetch: int) -> int:
    """The most batches a worker holds while the ones it has drain their tails."""
    return prefetch + MAX_EXTRA_LOOPS
