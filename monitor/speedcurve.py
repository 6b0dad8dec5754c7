"""How one request's decode speed depends on how many decode at once: fitted from the workers.

Each worker publishes what it streamed while d of its sequences decoded (WorkerStatus.decode,
worker/decoding.py): request-seconds and tokens per bin of d. A server's step makes one token
for each of the d and costs about a + b*d (a fixed part; a part per sequence), so the time one
request waits per token, busy / tokens, is a straight line in d. Its fit, weighted by the
tokens behind each bin, gives the overhead a/b in units of one sequence: large on a GPU
(memory-bound decode: a request's speed hardly depends on d), small on a CPU (compute-bound:
the server's tokens/s hardly depends on d, a request alone runs many times faster). The ETA
(monitor/eta.py) times a job's drain with it.

Nothing is assumed where the figures cannot tell: fewer than MIN_BINS bins with MIN_TOKENS
tokens, or their counts within a MIN_SPREAD ratio of each other, or a line that does not rise
(the speed does not fall with d): None, a speed that does not depend on d (what the ETA
assumed before). Figures from all live workers of the job are pooled: one curve for the fleet.

The bins come in two kinds (DecodeBin.clean): booked while a request of the worker waited for
its first token (the server prefilled it in the decoding requests' steps) or while none did, as
in a job's drain. The line goes through the clean ones where they tell: the steps of a job's
start, a few decoding beside many prefills, read a request slow at a small count and flattened
the line (an overhead of 57-72 for 0.7 on a compute-bound sim, 126-223 on vLLM on CPU where its
drain said 0). What admitting costs is counted apart (PREFILL_COST, monitor/eta.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from genq.core.decodefigures import DecodeBin

MIN_TOKENS = 50.0  # tokens behind a bin before it is used
MIN_BINS = 2
MIN_SPREAD = 1.3  # highest over lowest count decoding among the bins used
MAX_OVERHEAD = 1e6  # "no dependence" beyond this (a flat line's overhead is infinite)


def fit_overhead(bins: Iterable[DecodeBin]) -> float | None:
    """a/b of the step time a + b*d through the clean bins where they tell, else through all of
    them; None where neither does."""
    every = list(bins)
    clean = _overhead([b for b in every if b.clean])
    return clean if clean is not None else _overhead(every)


def _overhead(bins: list[DecodeBin]) -> float | None:
    pts = [(b.decoding, b.busy_s / b.tokens, b.tokens) for b in bins if b.tokens >= MIN_TOKENS and b.busy_s > 0]
    if len(pts) < MIN_BINS or max(d for d, _, _ in pts) < MIN_SPREAD * min(d for d, _, _ in pts):
        return None
    w = sum(n for _, _, n in pts)
    md = sum(d * n for d, _, n in pts) / w
    mt = sum(t * n for _, t, n in pts) / w
    sdd = sum(n * (d - md) ** 2 for d, _, n in pts)
    sdt = sum(n * (d - md) * (t - mt) for d, t, n in pts)
    slope = sdt / sdd if sdd > 0 else 0.0
    if slope <= 0:
        return None
    intercept = mt - slope * md
    overhead = max(0.0, intercept / slope)
    return None if overhead >= MAX_OVERHEAD else overhead
