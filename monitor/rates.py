"""Decode speed from the monitor's own samples over a recent window (tokens over request-seconds
decoding), or the workers' own rates with `--once`; a server's step cost a + b d from its decode bins."""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable
from typing import Any, NamedTuple

from genq.core.ledger.figures import JobSnapshot, WorkerCounters
from genq.core.records import DecodeBin
from genq.monitor.eta import Speed

REL_SE_FLOOR = 0.03  # speed drifts in ways a window cannot see (other jobs, throttling, the end's batches)
ONCE_REL_SE = 0.15  # --once: one look, no history of our own
MIN_TOKENS = 50.0  # tokens behind a decode bin before it is fitted
MIN_SPREAD = 1.3  # highest over lowest d among the bins fitted
MAX_OVERHEAD = 1e6  # a flatter line is "no dependence"


class Sample(NamedTuple):
    at: float  # when `generated` and `decoding` were true (the workers' mean publish time)
    read_at: float  # when `finished` was read
    generated: int  # output tokens so far, finished and running
    finished: int
    decoding: int  # requests being decoded
    workers: int  # workers decoding any of them
    slots: int  # the slots of the live workers that can serve the job
    paused: bool  # the job (or every job): its requests end and none start, whatever its slots


class RateTracker:
    def __init__(self, window_s: float = 120.0) -> None:
        self.window_s = window_s
        self.samples: deque[Sample] = deque()
        self._known: dict[str, list[tuple[float, int, float | None]]] = {}  # worker -> (read time, out_tok, last_at)
        self.snap: JobSnapshot | None = None

    def observe(self, snap: JobSnapshot) -> None:
        self.snap = snap
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
        """A sample as of the workers' in-flight records: finished tokens interpolated back to their time."""
        generated = 0.0
        stamps: list[float] = []
        for w in snap.workers:
            at = snap.at
            if w.live and w.inflight is not None:
                at = min(w.inflight.at, snap.at)
                generated += sum(w.running_tokens)
                stamps.append(at)
            generated += self._out_at(w.name, w.counters, snap.at, at)
        return Sample(sum(stamps) / len(stamps) if stamps else snap.at, snap.at, round(generated), snap.completed,
                      snap.decoding, sum(1 for w in snap.live if w.decoding), snap.slots, snap.paused)

    def _out_at(self, name: str, c: WorkerCounters, read_at: float, at: float) -> float:
        """A worker's finished tokens at `at` from its reads over the window (and 0 at its first request):
        a read's out_tok from its last result on, else interpolated from the reads either side."""
        pts = self._known.setdefault(name, [])
        if pts and c.out_tok < pts[-1][1]:  # counters went backwards: the job was reset
            pts.clear()
        if not pts and c.first_at is not None and c.first_at < read_at:
            pts.append((c.first_at, 0, None))
        if not pts or read_at > pts[-1][0]:
            pts.append((read_at, c.out_tok, c.last_at))
        while len(pts) > 2 and pts[1][0] < read_at - self.window_s:
            pts.pop(0)
        i = bisect.bisect_left(pts, at, key=lambda p: p[0])  # at <= read_at: pts[i] is there
        t1, out1, last_at = pts[i]
        if i == 0 or (last_at is not None and at >= last_at):
            return out1
        t0, out0, _ = pts[i - 1]
        return out0 + (out1 - out0) * (at - t0) / (t1 - t0)

    def speed(self) -> Speed | None:
        """Tokens generated over request-seconds decoding, over the intervals with requests decoding."""
        pts = list(self.samples)
        if len(pts) < 2:
            return None
        tokens_per_s = max(_line([(t, float(p.generated), 1.0) for t, p in zip(_unpaused(pts, "at"), pts)])[0], 0.0)
        kept = [(a, b) for a, b in zip(pts, pts[1:])
                if a.decoding > 0 and b.decoding > 0 and b.at > a.at and not (a.paused or b.paused)]
        source = f"monitor's samples over the last {pts[-1].read_at - pts[0].read_at:.0f}s"
        busy = [b.decoding * (b.at - a.at) for a, b in kept]
        total_busy = sum(busy)
        if total_busy <= 0:
            return Speed(0.0, 1.0, 0.0, 1, tokens_per_s=tokens_per_s, source=source)
        made = [b.generated - a.generated for a, b in kept]
        per_request = max(0.0, sum(made) / total_busy)
        rel = 1.0
        if len(kept) >= 3 and per_request > 0:  # the spread of the intervals' speeds, weighted by busy time
            var = sum(u * (m / u - per_request) ** 2 for m, u in zip(made, busy)) / total_busy
            n_eff = total_busy ** 2 / sum(u * u for u in busy)
            rel = min(1.0, max(REL_SE_FLOOR, 2 * math.sqrt(var / n_eff) / per_request))
        span = sum(b.at - a.at for a, b in kept)
        slots_s = sum(b.slots * (b.at - a.at) for a, b in kept)
        scale = pts[-1].slots * span / slots_s if slots_s > 0 and pts[-1].slots else 1.0
        return Speed(per_request, rel, span, len(kept) + 1, tokens_per_s=tokens_per_s, source=source,
                     decoding=total_busy / sum(max(1, b.workers) * (b.at - a.at) for a, b in kept),
                     running=total_busy / span * scale, **_server(self.snap))

    def prompts_per_s(self) -> float | None:
        pts = list(self.samples)
        if len(pts) < 2 or pts[-1].read_at - pts[0].read_at <= 0:
            return None
        return max(_line([(t, float(p.finished), 1.0) for t, p in zip(_unpaused(pts, "read_at"), pts)])[0], 0.0)


def _unpaused(pts: list[Sample], attr: str) -> list[float]:
    """Each sample's time with the intervals the job was paused (at either end) taken out."""
    clock = [0.0]
    for a, b in zip(pts, pts[1:]):
        clock.append(clock[-1] + (0.0 if a.paused or b.paused else getattr(b, attr) - getattr(a, attr)))
    return clock


def _line(pts: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through (x, y, weight) points; slope 0 where x is constant."""
    w = sum(n for _, _, n in pts)
    mx = sum(x * n for x, _, n in pts) / w
    my = sum(y * n for _, y, n in pts) / w
    sxx = sum(n * (x - mx) ** 2 for x, _, n in pts)
    slope = sum(n * (x - mx) * (y - my) for x, y, n in pts) / sxx if sxx > 0 else 0.0
    return slope, my - slope * mx


def once_speed(snap: JobSnapshot) -> tuple[Speed | None, float | None]:
    """(speed, prompts/s) from the workers' own records; one request's speed is not known (per_request 0)."""
    tokens = prompts = 0.0
    spans: list[float] = []
    sources: set[str] = set()
    for w in snap.workers:
        s, c = w.live_status, w.counters
        if s is None or w.inflight is None:
            continue  # not working on this job now
        start = max(s.started_at, snap.created_at or 0.0)
        if c.first_at is not None:
            start = min(start, c.first_at)
        span = snap.at - start
        if c.first_at is not None and c.first_at >= s.started_at - 1.0 and span >= 5.0:  # no restart since
            tokens += (c.out_tok + sum(w.running_tokens)) / span
            prompts += c.done / span
            spans.append(span)
            sources.add("workers' tokens since their first request")
        elif s.tok_per_s > 0:  # every job's: this job's part is its share of the requests in flight
            share = min(1.0, len(w.running_tokens) / s.in_flight) if s.in_flight else 1.0
            tokens += s.tok_per_s * share
            prompts += s.req_per_s * share
            spans.append(min(30.0, snap.at - s.started_at))
            sources.add("workers' last-30s rates")
    if not spans:
        return None, None
    # The requests a worker decodes at once when full: what a request's speed was measured at.
    slots = [w.slots for w in snap.live if w.inflight is not None and w.slots]
    return Speed(0.0, ONCE_REL_SE, min(spans), 3, tokens_per_s=tokens,
                 source=" + ".join(sorted(sources)) + " (--once: one look, less certain)",
                 decoding=sum(slots) / len(slots) if slots else 0.0, **_server(snap)), prompts


def _server(snap: JobSnapshot | None) -> dict[str, Any]:
    """The step's overhead (the decode bins of the live workers that can serve the job) and its mean prompt tokens."""
    if snap is None:
        return {}
    return {"overhead": fit_overhead(b for w in snap.serving if w.status is not None for b in w.status.decode),
            "prompt_tokens": snap.in_tokens / snap.completed if snap.completed else 0.0}


def fit_overhead(bins: Iterable[DecodeBin]) -> float | None:
    """The overhead a/b of the step time a + b d, weighted by tokens, through the clean bins where they tell,
    else all; None (no dependence) for too few bins, too narrow a spread of d, or a line that does not rise."""
    every = list(bins)
    for bins_ in ([b for b in every if b.clean], every):
        pts = [(b.decoding, b.busy_s / b.tokens, b.tokens) for b in bins_ if b.tokens >= MIN_TOKENS and b.busy_s > 0]
        if len(pts) < 2 or max(d for d, _, _ in pts) < MIN_SPREAD * min(d for d, _, _ in pts):
            continue
        slope, intercept = _line(pts)
        overhead = max(0.0, intercept / slope) if slope > 0 else MAX_OVERHEAD
        if overhead < MAX_OVERHEAD:
            return overhead
    return None
