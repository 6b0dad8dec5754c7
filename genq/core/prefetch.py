"""How many batches a worker holds: one rule for the worker (worker/loops.py) and the
ETA's simulation of it (monitor/progress.py)."""

from __future__ import annotations

DEFAULT_PREFETCH = 2  # genq worker --prefetch: batches held at least (the current one and the next)
MAX_EXTRA_LOOPS = 14  # batches taken beyond --prefetch while held ones drain their tails
