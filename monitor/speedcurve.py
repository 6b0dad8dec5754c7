"""How one request's decode speed depends on how many decode at once: fitted from the workers.

Each worker publishes what it streamed while d of its sequences decoded (WorkerStatus.decode,
worker/decoding.py): request-seconds and tokens per bin of d. A server's step makes one token
for each of the d and costs about a + b*d (a fixed part; a part per sequence), so the time one
request waits per token, busy / tokens, is a straight line in d. Its fit, weighted by the
tokens behind each bin, gives the overhead a/b in units of one sequence: large on a GPU
(memory-bound decode: a request's speed hardly depends on d), small on a CPU (compute-bound:
the server's tokens/s hardly depends on d, a request alone runs many times faster). The ETA's
simulation (monitor/simulate.py) plays each worker's requests at (overhead + ref) / (overhead + d)
times the measured speed.

Nothing is assumed where the figures cannot tell: fewer than MIN_BINS bins with MIN_TOKENS
tokens, or their counts within a MIN_SPREAD ratio of each other, or a line that does not rise
(the speed does not fall with d): None, a speed that does not depend on d (what the ETA
assumed before). Figures from all live workers of the job are pooled: one curve for the fleet.

The bins come in two kinds (DecodeBin.clean): booked while the worker's requests were being
admitted (a prefill in the server's steps) or while none waited, as in a job's drain once
nothing is left to send. The line is fitted through the clean ones where they tell (else all),
and the drain's gain is the clean line's speed over the admitting bins' at the count those ran at:
on vLLM on CPU the drain's first seconds ran 15-20 % faster than the bulk (#27).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from genq.core.decodefigures import DecodeBin

MIN_TOKENS = 50.0  # tokens behind a bin before it is used
MIN_BINS = 2
MIN_SPREAD = 1.3  # highest over lowest count decoding among the bins used
MAX_OVERHEAD = 1e6  # "no dependence" beyond this (a flat line's overhead is infinite)
DRAIN_GAIN_BOUNDS = (2 / 3, 1.5)  # beyond these the two kinds of bins disagree too much to be believed
NEAR = 1.25  # admitting bins within this ratio of the busiest one's count make the bulk's speed


@dataclass(frozen=True)
class Curve:
    """How one request's speed depends on the count decoding and on admissions."""

    overhead: float | None = None  # a/b of the step time a + b*d; None: no dependence on d
    drain_gain: float = 1.0  # speed with nothing admitted over speed while admitting, at the bulk's count


def fit_curve(bins: Iterable[DecodeBin]) -> Curve:
    """The overhead (through the clean bins where they tell, else all) and the drain's gain."""
    usable = [b for b in bins if b.tokens >= MIN_TOKENS and b.busy_s > 0]
    clean = [b for b in usable if b.clean]
    admitting = [b for b in usable if not b.clean]
    overhead = fit_overhead(clean)
    if overhead is None:
        overhead = fit_overhead(usable)
    return Curve(overhead=overhead, drain_gain=_drain_gain(clean, admitting))


def _drain_gain(clean: list[DecodeBin], admitting: list[DecodeBin]) -> float:
    if not clean or not admitting:
        return 1.0
    bulk = max(admitting, key=lambda b: b.busy_s).decoding  # where the worker spends its time admitting
    near = [b for b in admitting if bulk / NEAR <= b.decoding <= bulk * NEAR]
    bulk_time = sum(b.busy_s for b in near) / sum(b.tokens for b in near)  # a request's seconds a token
    line = _line(clean)
    if line is not None:
        clean_time = line[0] + line[1] * bulk
    else:  # no line through them: the clean bins near the bulk's count, if any
        close = [b for b in clean if bulk / NEAR <= b.decoding <= bulk * NEAR]
        if not close:
            return 1.0
        clean_time = sum(b.busy_s for b in close) / sum(b.tokens for b in close)
    if clean_time <= 0:
        return 1.0
    low, high = DRAIN_GAIN_BOUNDS
    return min(max(bulk_time / clean_time, low), high)


def fit_overhead(bins: Iterable[DecodeBin]) -> float | None:
    """a/b of the step time a + b*d through the bins, or None where they do not tell."""
    line = _line(bins)
    if line is None:
        return None
    intercept, slope = line
    overhead = max(0.0, intercept / slope)
    return None if overhead >= MAX_OVERHEAD else overhead


def _line(bins: Iterable[DecodeBin]) -> tuple[float, float] | None:
    """(intercept, slope) of a request's seconds a token against d, weighted by tokens; None where
    the bins do not tell a rising line."""
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
    return mt - slope * md, slope
