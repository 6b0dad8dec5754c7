"""How long the rest of a job will take: a pure estimator (no Redis, no clock).

Why not "remaining prompts x average length so far / tok/s": the completions
that finish first are the short ones, so the running average of finished
lengths is biased low until the very end (a real run estimated 208 h, then
115 h three minutes later). What is known about output lengths is:

* finished completions, binned in the job's log-spaced histogram
  (worker/results.py length_bucket): interval-censored observations;
* completions still running, with the tokens produced so far: right-censored
  observations (the final length is at least that);
* the job's max_tokens: no completion is longer (it is cut at the cap).

monitor/lengths.py fits a lognormal to log(L + 1) by maximum likelihood over
all three, so the long completions that have started but not finished pull the
estimate up as they should. The remaining time comes from a Monte-Carlo run
of the rest of the job through genq's own scheduling (monitor/simulate.py):
the running requests finish after a draw from their conditional length
(L | L >= tokens so far), the unstarted prompts draw fresh lengths, each
worker leases batches from the shared queue and keeps its decode slots busy
from what it holds, every request generating at the measured per-request
speed. The draws cover the fitted parameters' uncertainty and the speed's,
so the spread of the simulated finish times gives an honest range; the
drain at the end (a few long completions running while slots sit idle) is
part of the simulation rather than a fudge factor. Nothing here reads a
clock or Redis: tests feed it synthetic data with a known answer.

The in-flight lists are up to a heartbeat (1 s) old, so a request that
finished since is listed as running and is also in the histogram. Its
censored observation ("at least t tokens") is still true, so the fit uses the
data as published: an EM-style correction (weighing each listed request by its
chance of still running) was tried and made synthetic runs worse, not better.
The simulation plays no more prompts than are left: when the listed running
requests and the prompts held unsent outnumber them, the running list is trimmed
(_trim_stale; on real vLLM 151 listed for 143 left at 76 % done, #27).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from genq.monitor.etapool import MIN_DRAWS, EtaPool

# Re-exported: callers and tests take the whole estimator from here.
from genq.monitor.lengths import LengthData, LengthModel, fit_lengths, length_bucket  # noqa: F401
from genq.monitor.playout import WorkerState  # noqa: F401
from genq.monitor.simulate import Speed, calibrate, simulate_remaining  # noqa: F401

# Below this many finished completions the length fit is not worth a number.
MIN_FINISHED = 20
# The throughput window must span at least this long (seconds) and hold this
# many samples before an ETA is given.
MIN_RATE_SPAN_S = 3.0
MIN_RATE_SAMPLES = 3
# "steady" rather than "estimating": enough finished completions, a long
# enough throughput window and a tight enough throughput estimate.
STEADY_FINISHED = 200
STEADY_SPAN_S = 30.0
STEADY_RATE_REL_SE = 0.05
# The range is the central 90 % of the simulated finish times.
RANGE_QUANTILES = (0.05, 0.95)


@dataclass
class Estimate:
    eta_s: float | None
    eta_low_s: float | None
    eta_high_s: float | None
    state: str  # "warming up" | "estimating" | "steady" | "done" | "paused" | "stalled"
    note: str = ""
    model: LengthModel | None = None
    remaining_tokens: float | None = None  # expected, at the fitted parameters
    expected_output_tokens: float | None = None  # fitted mean completion length
    draws: list[float] = field(default_factory=list)


def estimate(
    *,
    total: int,
    completed: int,
    failed: int,
    lengths: LengthData,
    fleet: Sequence[WorkerState],
    batch_size: int,
    speed: Speed | None,
    paused: bool = False,
    samples: int = 100,
    seed: int = 20240601,
    max_events: int = 300_000,
    pool: EtaPool | None = None,
    now: float = 0.0,
) -> Estimate:
    """The job's remaining time: a point estimate (median draw) and a 90 % range.

    lengths: the finished-length histogram and the cap; the running requests
    are taken from the fleet (each worker's in-flight list), or from
    lengths.running when no fleet is given. speed: measured per-request speed,
    or (per_request 0) the fleet's tokens/s, to which the simulation calibrates.
    pool: a live monitor's EtaPool for this job (the work spread over refreshes within a
    budget; `now` dates its draws); None: all of it now, as `genq monitor --once` does.
    """
    finished = completed + failed
    fleet = _trim_stale(list(fleet), max(0, total - finished))
    # The running requests are the fleet's (each worker's in-flight record) when one is given.
    running = [t if t > 0 else 0 for w in fleet for t in w.running] if fleet else [max(0, int(t)) for t in lengths.running]
    unstarted = max(0, total - finished - len(running))
    lengths = LengthData(hist=lengths.hist, running=running, cap=lengths.cap)
    spent = 0
    if lengths.finished < MIN_FINISHED:
        model = None
    elif pool is not None:
        model, spent = pool.fit(lengths, now)
    else:
        model = fit_lengths(lengths)
    result = Estimate(None, None, None, "warming up", model=model)
    if model is not None:
        result.remaining_tokens = model.remaining_tokens(unstarted, running)
        result.expected_output_tokens = model.mean()
    if total > 0 and finished >= total:
        result.eta_s = result.eta_low_s = result.eta_high_s = 0.0
        result.state, result.remaining_tokens = "done", 0.0
        return result
    if paused:
        result.state, result.note = "paused", "paused: no estimate until it resumes"
        return result
    if model is None:
        result.note = (f"{lengths.finished} of {MIN_FINISHED} finished completions needed to fit output lengths"
                       if lengths.finished < MIN_FINISHED else "fitting output lengths")
        return result
    active = [w for w in fleet if w.slots > 0]
    if not active:
        result.state, result.note = "stalled", "no live worker has slots for this job"
        return result
    if speed is None or speed.span_s < MIN_RATE_SPAN_S or speed.samples < MIN_RATE_SAMPLES:
        span = 0.0 if speed is None else speed.span_s
        result.note = f"throughput window {span:.0f}s of {MIN_RATE_SPAN_S:.0f}s needed"
        return result
    if speed.per_request <= 0 and speed.tokens_per_s <= 0:
        result.state, result.note = "stalled", "no tokens generated in the window: is any worker running?"
        return result
    if speed.per_request <= 0:
        speed = calibrate(speed, model, active, batch_size, seed)
    # Prompts in the shared queue: not running and not held unsent by a worker.
    queue = max(0, unstarted - sum(w.ready for w in active))
    if pool is None:
        draws = sorted(simulate_remaining(model, active, queue, batch_size, speed,
                                          samples=samples, seed=seed, max_events=max_events))
    else:
        draws = pool.draws(model, active, queue, batch_size, speed, now=now, spent=spent,
                           samples=samples, seed=seed, max_events=max_events, work=result.remaining_tokens or 0.0)
        if len(draws) < MIN_DRAWS:
            result.note = f"{len(draws)} of {MIN_DRAWS} simulated draws so far"  # still "warming up"
            return result
    result.draws = draws
    result.eta_s = _quantile(draws, 0.5)
    result.eta_low_s = _quantile(draws, RANGE_QUANTILES[0])
    result.eta_high_s = _quantile(draws, RANGE_QUANTILES[1])
    steady = (lengths.finished >= STEADY_FINISHED and speed.span_s >= STEADY_SPAN_S
              and speed.rel_se <= STEADY_RATE_REL_SE)
    result.state = "steady" if steady else "estimating"
    return result


def _trim_stale(fleet: list[WorkerState], left: int) -> list[WorkerState]:
    """More requests listed (running, or held unsent) than prompts left: some lists are stale (a
    worker publishes once a second; a request that ended since is counted finished and still
    listed as running). The unsent prompts have not run: the running ones are trimmed to what
    is left beside them, keeping the longest-running, the likeliest still to run."""
    ready = sum(w.ready for w in fleet)
    if sum(len(w.running) for w in fleet) + ready <= left:
        return fleet
    listed = sorted(((t, i) for i, w in enumerate(fleet) for t in w.running), reverse=True)
    keep: list[list[int]] = [[] for _ in fleet]
    for t, i in listed[:max(0, left - ready)]:
        keep[i].append(t)
    return [replace(w, running=tuple(k)) for w, k in zip(fleet, keep)]


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    pos = q * (len(sorted_values) - 1)
    i = int(math.floor(pos))
    j = min(i + 1, len(sorted_values) - 1)
    return sorted_values[i] + (sorted_values[j] - sorted_values[i]) * (pos - i)


