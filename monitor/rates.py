"""Decode speed from what the monitor saw, not from elapsed time since the job began.

A live monitor keeps its own samples between refreshes and reads the job's
throughput as the slope of "output tokens generated so far" (finished
completions plus the tokens of running ones) over a recent window. Counting
running tokens makes the curve smooth (a 4,000-token completion does not land
in one lump), and taking deltas means work done before the monitor started (a
resumed run) never inflates the rate. Dividing by the average number of
requests decoding over the same window gives the speed of one request. The
fleet's speed is that times the requests decoding: their mean over the window
(slots idle behind batches' tails count), scaled by the live workers' slots now
over their mean (workers joining or leaving change the forecast at once).

`genq monitor --once` has no samples of its own: it takes the workers'
generation since their first result (when the worker has run without a
restart since) or their own last-30-s figures, leaves the per-request speed
to the ETA (tokens/s over the requests running), and says it is less certain.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from genq.monitor.eta import Speed
from genq.monitor.snapshot import JobSnapshot
from genq.monitor.speedcurve import fit_overhead

# Relative standard error never below this: speed drifts in ways a window
# cannot see (other jobs, thermal throttling, batch-size effects at the end).
REL_SE_FLOOR = 0.03
ONCE_REL_SE = 0.15  # --once: one look, no history of our own


@dataclass(frozen=True)
class Sample:
    at: float  # when `generated` and `decoding` were true (the workers' mean publish time)
    read_at: float  # when `finished` was read
    generated: int  # output tokens so far, finished and running
    finished: int  # prompts with a result (a dead letter is no progress: it never counts toward the rate)
    decoding: int  # requests being decoded (at most each server's capacity)
    workers: int = 0  # workers with any of them (a request's speed depends on its own worker's count)
    slots: int = 0  # the live workers' slots


class RateTracker:
    def __init__(self, window_s: float = 120.0) -> None:
        self.window_s = window_s
        self.samples: deque[Sample] = deque()
        self._out: dict[str, tuple[float, int]] = {}  # worker -> (read time, out_tok then)
        self.overhead: float | None = None  # the speed's dependence on the count decoding, as last seen
        self.prompt_tokens = 0.0  # the job's mean prompt tokens, as last seen

    def observe(self, snap: JobSnapshot) -> None:
        self.overhead = curve_of(snap)
        self.prompt_tokens = prompt_tokens(snap)
        s = self._aligned(snap)
        if self.samples:
            last = self.samples[-1]
            if s.at <= last.at or s.read_at <= last.read_at:
                return
            if s.finished < last.finished:  # counters went backwards: the job was reset
                self.samples.clear()
        self.samples.append(s)
        while len(self.samples) > 2 and s.read_at - self.samples[0].read_at > self.window_s:
            self.samples.popleft()

    def _aligned(self, snap: JobSnapshot) -> Sample:
        """A sample as of the workers' in-flight records, not as of this read.

        A worker publishes its running requests once a second; its finished
        count and tokens are written as results come in. Adding the two as read
        now counts a request that finished after the publish twice (in the
        in-flight record and in the finished tokens), which inflates an early
        rate. So each worker's finished tokens are taken back to its publish
        time (interpolated between this read and the previous one), and the
        sample is dated at the mean publish time.
        """
        generated = 0.0
        stamps: list[float] = []
        for w in snap.workers:
            out_now = w.counters.out_tok
            prev = self._out.get(w.name)
            self._out[w.name] = (snap.at, out_now)
            if not w.live or w.inflight is None:
                generated += out_now
                continue
            at = min(w.inflight.at, snap.at)
            if prev is not None and snap.at > prev[0]:
                frac = max(0.0, (at - prev[0]) / (snap.at - prev[0]))
                generated += prev[1] + (out_now - prev[1]) * frac
            else:
                generated += out_now
            generated += sum(w.running_tokens)
            stamps.append(at)
        at = sum(stamps) / len(stamps) if stamps else snap.at
        return Sample(at=at, read_at=snap.at, generated=round(generated), finished=snap.completed,
                      decoding=snap.decoding, workers=sum(1 for w in snap.workers if w.live and w.decoding),
                      slots=snap.slots)

    def speed(self) -> Speed | None:
        """Speed of one decoding request = tokens generated / request-seconds spent decoding.

        A ratio of integrals over the window, so idle stretches (the minute before
        the first worker started, a pause) count in neither. The requests decoding
        over an interval are taken as published at its end (the in-flight records a
        sample is built from were written during the interval). An interval that
        starts with nothing known to be decoding (before the workers' first
        in-flight records, or after a pause) may end with tokens made before it:
        such intervals teach nothing about speed and are left out.
        """
        pts = list(self.samples)
        if len(pts) < 2:
            return None
        tokens_per_s, _ = _ols([p.at for p in pts], [float(p.generated) for p in pts])
        tokens_per_s = max(tokens_per_s, 0.0)
        usable = [(b.generated - a.generated, b.decoding * (b.at - a.at), b.at - a.at)
                  for a, b in zip(pts, pts[1:]) if a.decoding > 0 and b.decoding > 0 and b.at > a.at]
        # The count per worker the speed was measured at (what a request's speed depends on).
        worker_s = sum(max(1, b.workers) * (b.at - a.at) for a, b in zip(pts, pts[1:])
                       if a.decoding > 0 and b.decoding > 0 and b.at > a.at)
        span = sum(dt for _, _, dt in usable)
        source = f"monitor's samples over the last {pts[-1].read_at - pts[0].read_at:.0f}s"
        total_busy = sum(busy for _, busy, _ in usable)
        if total_busy <= 0:
            return Speed(per_request=0.0, rel_se=1.0, span_s=0.0, samples=1, tokens_per_s=tokens_per_s,
                         source=source)
        per_request = max(0.0, sum(made for made, _, _ in usable) / total_busy)
        # Its standard error from the spread of the per-interval speeds, weighted by busy time.
        if len(usable) >= 3 and per_request > 0:
            var = sum(busy * (made / busy - per_request) ** 2 for made, busy, _ in usable) / total_busy
            n_eff = total_busy ** 2 / sum(busy * busy for _, busy, _ in usable)
            rel = max(REL_SE_FLOOR, 2 * math.sqrt(var / n_eff) / per_request)
        else:
            rel = 1.0
        kept = [b for a, b in zip(pts, pts[1:]) if a.decoding > 0 and b.decoding > 0 and b.at > a.at]
        slots_s = sum(b.slots * dt for b, (_, _, dt) in zip(kept, usable))
        running = total_busy / span * (pts[-1].slots * span / slots_s if slots_s > 0 and pts[-1].slots else 1.0)
        return Speed(per_request=per_request, rel_se=min(rel, 1.0), span_s=span, samples=len(usable) + 1,
                     tokens_per_s=tokens_per_s, source=source, decoding=total_busy / worker_s,
                     overhead=self.overhead, prompt_tokens=self.prompt_tokens, running=running)

    def prompts_per_s(self) -> float | None:
        pts = list(self.samples)
        if len(pts) < 2 or pts[-1].read_at - pts[0].read_at <= 0:
            return None
        slope, _ = _ols([p.read_at for p in pts], [float(p.finished) for p in pts])
        return max(slope, 0.0)


def curve_of(snap: JobSnapshot) -> float | None:
    """How a request's speed depends on its worker's count decoding, from the live workers'
    figures (monitor/speedcurve.py): the overhead a/b, or None."""
    return fit_overhead(b for w in snap.workers if w.live_status is not None for b in w.live_status.decode)


def prompt_tokens(snap: JobSnapshot) -> float:
    """The job's mean prompt tokens per finished prompt (what each start makes its server prefill)."""
    return snap.in_tokens / snap.completed if snap.completed else 0.0


def _ols(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and its standard error."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        return 0.0, math.inf
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    if n < 3:
        return slope, abs(slope)  # two points: no idea how noisy
    resid = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    return slope, math.sqrt(resid / (n - 2) / sxx)


def once_speed(snap: JobSnapshot) -> tuple[Speed | None, float | None]:
    """(speed, prompts/s) from one snapshot: the workers' own records.

    The job's tokens/s is known; the speed of one request is not (one look
    cannot average the number decoding), so per_request is left at 0: the estimator
    divides the tokens/s by the requests running.
    """
    tokens = 0.0
    prompts = 0.0
    spans: list[float] = []
    sources: set[str] = set()
    for w in snap.workers:
        s, c = w.live_status, w.counters
        if s is None or w.inflight is None:
            continue  # not working on this job now: contributes nothing from here on
        clean = c.first_at is not None and c.first_at >= s.started_at - 1.0  # no restart since its first result
        start = max(s.started_at, snap.created_at or 0.0)
        if c.first_at is not None:
            start = min(start, c.first_at)
        span = snap.at - start
        if clean and span >= 5.0:
            tokens += (c.out_tok + sum(w.running_tokens)) / span
            prompts += c.done / span  # results only: dead letters are no progress
            spans.append(span)
            sources.add("workers' tokens since their first request")
        elif s.tok_per_s > 0:
            tokens += s.tok_per_s
            prompts += s.req_per_s
            spans.append(min(30.0, snap.at - s.started_at))
            sources.add("workers' last-30s rates")
    if not spans:
        return None, None
    # The requests a worker decodes at once when full: what a request's speed was measured at.
    slots = [w.slots for w in snap.workers if w.live_status is not None and w.inflight is not None and w.slots]
    speed = Speed(per_request=0.0, rel_se=ONCE_REL_SE, span_s=min(spans), samples=3, tokens_per_s=tokens,
                  source=" + ".join(sorted(sources)) + " (--once: one look, less certain)",
                  decoding=sum(slots) / len(slots) if slots else 0.0, overhead=curve_of(snap),
                  prompt_tokens=prompt_tokens(snap))
    return speed, prompts
