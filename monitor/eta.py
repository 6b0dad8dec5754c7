"""How long the rest of a job will take, in closed form (pure: no Redis, no clock).

    ETA = (work left - work of the drain) / measured tokens/s  +  time of the drain

The work left is the expectation under a lognormal fitted to every known output length (lengths.py:
finished, running as "at least this long", the cap): prompts not started times the mean, plus each
running request's expected remainder. While prompts are left to start the fleet is full and makes
the measured tokens/s. The drain is the requests running when the last prompt starts (a steady
fleet's: as many as decode now, each with the length-biased remainder E[(L - r)+] / E[L]; or, with
fewer prompts left than run at once, the running ones and the prompts left); it lasts as long as
the longest of their remainders (its distribution is the product of theirs), decoded at one
request's measured speed. On a server whose step costs a + b d for d decoding (a CPU; rates.py fits
a/b) the last requests run faster as the others end, and faster still without the prefills the
bulk paid for (PREFILL_COST). The 90 % range: the bulk spread by the speed's and the mean length's
standard errors, the drain by the 5th and 95th percentiles of its longest remainder.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from genq.monitor.lengths import LengthData, LengthModel, fit_lengths, grid_groups, length_bucket, log_q

__all__ = ["Estimate", "LengthData", "LengthModel", "Speed", "estimate", "fit_lengths", "length_bucket"]

# Below this many finished completions the length fit is not worth a number.
MIN_FINISHED = 20
# The throughput window must span at least this long (seconds) and hold this many samples.
MIN_RATE_SPAN_S = 3.0
MIN_RATE_SAMPLES = 3
# "steady" rather than "estimating": enough finished completions, a long enough throughput
# window and a tight enough throughput estimate.
STEADY_FINISHED = 200
STEADY_SPAN_S = 30.0
STEADY_RATE_REL_SE = 0.05
Z90 = 1.645  # the range is a central 90 %
# What one prompt token of a prefill costs a server's step, over what one decoding sequence costs
# it: vLLM on CPU, 0.30 to 0.99, median 0.56, in nine jobs (2026-12-05, docs/vllm.md).
PREFILL_COST = 0.5
DRAIN_GRID = 24  # points per unit of ln(r + 1) on which the drain's longest remainder is integrated


@dataclass(frozen=True)
class Speed:
    """Decode speed as measured over a recent window."""

    per_request: float  # output tokens/s of one decoding request (0: tokens_per_s over those running)
    rel_se: float  # relative standard error of the speed
    span_s: float  # length of the window
    samples: int
    tokens_per_s: float = 0.0  # the job's measured output tokens/s
    source: str = ""
    # How a request's speed depends on d, the requests decoding at once on its server: a step
    # costs in proportion to overhead + d (monitor/rates.py); per_request was measured at
    # about `decoding` per worker. None: the same speed at any d (a GPU's memory-bound decode).
    overhead: float | None = None
    decoding: float = 0.0
    prompt_tokens: float = 0.0  # the job's mean prompt tokens: what a request's start prefills
    running: float = 0.0  # the job's requests decoding, over the window, scaled to the slots now (0: unknown)


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


def estimate(*, total: int, completed: int, failed: int, lengths: LengthData, speed: Speed | None,
             workers: int, unsent: int = 0, paused: bool = False) -> Estimate:
    """The job's remaining time and a 90 % range.

    lengths: the finished-length histogram, the running requests' tokens so far, the cap.
    workers: the live workers that will work on the job. unsent: prompts they hold not yet sent.
    """
    finished = completed + failed
    left = max(0, total - finished)
    running = _trim_stale(lengths.running, max(0, left - unsent))
    unstarted = max(0, left - len(running))
    model = fit_lengths(LengthData(lengths.hist, running, lengths.cap)) if lengths.finished >= MIN_FINISHED else None
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
        result.note = f"{lengths.finished} of {MIN_FINISHED} finished completions needed to fit output lengths"
        return result
    if workers <= 0:
        result.state, result.note = "stalled", "no live worker has slots for this job"
        return result
    if speed is None or speed.span_s < MIN_RATE_SPAN_S or speed.samples < MIN_RATE_SAMPLES:
        span = 0.0 if speed is None else speed.span_s
        result.note = f"throughput window {span:.0f}s of {MIN_RATE_SPAN_S:.0f}s needed"
        return result
    busy = len(running)
    # The fleet's speed: one request's times the requests decoding (monitor/rates.py). A window's
    # tokens/s would count the time before the fleet filled up, and workers that have left.
    rate = speed.per_request * (speed.running or busy) if speed.per_request > 0 else speed.tokens_per_s
    per_request = speed.per_request if speed.per_request > 0 else rate / max(busy, 1)
    if rate <= 0 or per_request <= 0:
        result.state, result.note = "stalled", "no tokens generated in the window: is any worker running?"
        return result
    work = result.remaining_tokens or 0.0
    # Those that decode at once: as measured (a request waiting in the server's queue is in flight
    # and not decoding), or those in flight when there is no measure (--once).
    at_once = round(speed.running) if speed.running > 0 else busy
    bulk_s, drain_work, shift, fresh, steady = _phases(model, work, at_once, unstarted, rate, per_request)
    cdf = _longest(model, running, shift, fresh, steady)
    per_worker = speed.decoding if speed.decoding > 0 else max(busy, 1) / workers

    def drain_s(longest: float) -> float:
        if speed.overhead is None:
            return longest / per_request
        o = speed.overhead
        alone = 1.0 + PREFILL_COST * speed.prompt_tokens * per_worker / ((o + per_worker) * model.mean())
        return (o * longest + drain_work / workers) / (per_request * (o + per_worker)) / alone

    rel = math.hypot(speed.rel_se, model.mean_rel_se())
    result.eta_s = bulk_s + drain_s(_mean_of(cdf))
    result.eta_low_s = max(0.0, bulk_s * (1 - Z90 * rel)) + drain_s(_quantile(cdf, 0.05)) * max(0.0, 1 - Z90 * speed.rel_se)
    result.eta_high_s = bulk_s * (1 + Z90 * rel) + drain_s(_quantile(cdf, 0.95)) * (1 + Z90 * speed.rel_se)
    result.eta_low_s, result.eta_high_s = min(result.eta_low_s, result.eta_s), max(result.eta_high_s, result.eta_s)
    steady_now = (lengths.finished >= STEADY_FINISHED and speed.span_s >= STEADY_SPAN_S
                  and speed.rel_se <= STEADY_RATE_REL_SE)
    result.state = "steady" if steady_now else "estimating"
    return result


def _phases(model: LengthModel, work: float, at_once: int, unstarted: int, rate: float,
            per_request: float) -> tuple[float, float, float, int, bool]:
    """(seconds of the full fleet, tokens of the drain, tokens the running requests make before it,
    requests that join the drain, whether those are a steady fleet's)."""
    if at_once == 0:  # nothing decoding and no measure of how many do: the work at the measured rate
        return work / rate, 0.0, 0.0, 0, False
    if unstarted < at_once:  # the drain is now: the running ones and the prompts left
        return 0.0, work, 0.0, unstarted, False
    mean = max(model.mean(), 1e-9)
    drain_work = min(work, at_once * model.second_moment() / (2 * mean))
    bulk_s = (work - drain_work) / rate
    return bulk_s, drain_work, per_request * bulk_s, at_once, True


def _survival(model: LengthModel, x: float) -> float:
    """P(L >= x), the observed length min(L, cap)."""
    if x <= 0:
        return 1.0
    if model.cap is not None and x > model.cap:
        return 0.0
    return math.exp(log_q((math.log(x + 1) - model.mu) / model.sigma))


def _longest(model: LengthModel, running: Sequence[int], shift: float, fresh: int,
             steady: bool) -> list[tuple[float, float]]:
    """(r, P(the drain's longest remainder <= r)) on a log grid: the product of each request's
    P(remainder <= r). A running request with t tokens so far has shift more made by the drain."""
    mean = max(model.mean(), 1e-9)
    groups = [(at, n, _survival(model, at)) for at, n, _ in grid_groups(running, 8)]
    top = model.cap if model.cap is not None else math.exp(model.mu + 8 * model.sigma)
    top += max(running, default=0)
    cdf = []
    for k in range(int(math.log(top + 1) * DRAIN_GRID) + 2):
        r = math.exp(k / DRAIN_GRID) - 1
        log_p = 0.0
        for at, n, alive in groups:
            p = 1.0 - _survival(model, at + shift + r) / alive if alive > 0 else 1.0
            log_p += n * math.log(p) if p > 0 else -math.inf
        if fresh:
            if steady:  # a renewal process' remainder: P(R > r) = E[(L - r)+] / E[L]
                beyond = _survival(model, r) * max(0.0, model.conditional_mean(round(r)) - r) / mean
            else:
                beyond = _survival(model, r)
            log_p += fresh * math.log1p(-beyond) if beyond < 1 else -math.inf
        cdf.append((r, math.exp(log_p)))
        if log_p > -1e-12:
            break
    return cdf


def _mean_of(cdf: list[tuple[float, float]]) -> float:
    """E[M] = integral of P(M > r) dr."""
    return sum((r1 - r0) * (2 - p0 - p1) / 2 for (r0, p0), (r1, p1) in zip(cdf, cdf[1:]))


def _quantile(cdf: list[tuple[float, float]], q: float) -> float:
    prev_r, prev_p = 0.0, 0.0
    for r, p in cdf:
        if p >= q:
            return r if p <= prev_p else prev_r + (r - prev_r) * (q - prev_p) / (p - prev_p)
        prev_r, prev_p = r, p
    return cdf[-1][0]


def _trim_stale(running: Sequence[int], room: int) -> list[int]:
    """A worker publishes its running requests once a second; one that ended since is counted
    finished and still listed. More listed than prompts left beside the unsent ones: the longest
    are kept, the likeliest still to run."""
    listed = [max(0, int(t)) for t in running]
    return listed if len(listed) <= room else sorted(listed, reverse=True)[:room]
