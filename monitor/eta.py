"""How long the rest of a job will take, in closed form (pure: no Redis, no clock).

    ETA = (work left - work of the drain) / measured tokens/s  +  time of the drain

Output lengths: ln(L + 1) ~ Normal(mu, sigma), fitted by maximum likelihood to every known length:
the finished ones in their log buckets (interval-censored), the running ones as "at least this long"
(right-censored, so the long ones that started pull the fit up as they should) and the cap
(max_tokens). The work left is its expectation: prompts not started times the mean, plus each running
request's expected remainder. While prompts are left to start the fleet is full and makes the measured
tokens/s. The drain is the requests running when the last prompt starts (a steady fleet's: as many as
decode now, each with the length-biased remainder E[(L - r)+] / E[L]; or, with fewer prompts left than
run at once, the running ones and the prompts left); it lasts as long as the longest of their
remainders (its distribution is the product of theirs), decoded at one request's measured speed. On a
server whose step costs a + b d for d decoding (a CPU; rates.py fits a/b) the last requests run faster
as the others end, and faster still without the prefills the bulk paid for (PREFILL_COST). The 90 %
range: the bulk spread by the speed's and the mean length's standard errors, the drain by the 5th and
95th percentiles of its longest remainder.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate

from genq.core.records import length_bucket

LN2 = math.log(2.0)
SQRT2 = math.sqrt(2.0)

SIGMA_BOUNDS = (0.02, 5.0)  # of log(L + 1); a wider fit is a broken one
CENSOR_GRID = 32  # steps per unit of ln(t + 1) on which running requests are counted in the fit
REMAINING_GRID = 8  # the same for the expected remaining tokens


def norm_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / SQRT2)


def log_q(x: float) -> float:
    """log P(N(0,1) >= x); -inf beyond x = 38, where erfc underflows (no length the fit believes in)."""
    q = norm_cdf(-x)
    return math.log(q) if q > 0 else -math.inf


def log_interval(lo: float, hi: float) -> float:
    """log P(lo <= N(0,1) < hi), each tail taken from its own side (no 1 - 1 cancellation)."""
    if lo > 0:
        p = norm_cdf(-lo) - norm_cdf(-hi)
    elif hi < 0:
        p = norm_cdf(hi) - norm_cdf(lo)
    else:
        p = 1.0 - norm_cdf(-hi) - norm_cdf(lo)
    return math.log(p) if p > 0 else -math.inf


def bucket_log_bounds(bucket: int) -> tuple[float, float]:
    """The bucket's range in z = ln(L + 1) (inverse of length_bucket)."""
    return (bucket - 0.5) / 4 * LN2, (bucket + 0.5) / 4 * LN2


@dataclass(frozen=True)
class LengthData:
    """Everything known about output lengths at one moment."""

    hist: Mapping[int, int]  # length bucket -> finished completions
    running: Sequence[int]  # tokens so far of each running request
    cap: int | None = None  # the job's max_tokens: no output is longer

    @property
    def finished(self) -> int:
        return sum(self.hist.values())


@dataclass
class LengthModel:
    """ln(L + 1) ~ Normal(mu, sigma); observed output = min(L, cap)."""

    mu: float
    sigma: float
    cap: int | None = None
    finished: int = 0  # finished completions fitted

    def mean_rel_se(self) -> float:
        """The fitted mean's relative standard error by the delta method: ln mean = mu + sigma^2 / 2,
        Var(mu) = sigma^2 / n, Var(sigma) = sigma^2 / 2n over the n finished (the cap ignored, and the
        running ones, which tell less, not counted)."""
        n = self.finished
        return self.sigma * math.sqrt((1 + self.sigma**2 / 2) / n) if n else 0.0

    def mean(self) -> float:
        return self.conditional_mean(0)

    def conditional_mean(self, tokens_so_far: int) -> float:
        """E[min(L, cap) | L >= tokens_so_far]."""
        mu, s = self.mu, self.sigma
        c0 = -math.inf if tokens_so_far <= 0 else (math.log(tokens_so_far + 1) - mu) / s
        lq_c = log_q(c0)
        if lq_c == -math.inf:  # far beyond anything the fit believes in
            return float(max(tokens_so_far, 1) if self.cap is None else min(max(tokens_so_far, 1), self.cap))
        # E[e^Z | Z >= c] = exp(mu + s^2/2) Q(c0 - s) / Q(c0)
        growth = mu + s * s / 2
        above_c = math.exp(min(700.0, growth + log_q(c0 - s) - lq_c))
        if self.cap is None:
            return above_c - 1.0
        m0 = (math.log(self.cap + 1) - mu) / s
        if c0 >= m0:
            return float(self.cap)
        above_m = math.exp(min(700.0, growth + log_q(m0 - s) - lq_c))
        p_m = math.exp(log_q(m0) - lq_c)  # P(L >= cap | L >= t)
        return (above_c - above_m) - (1.0 - p_m) + self.cap * p_m

    def second_moment(self) -> float:
        """E[min(L, cap)^2], for the spread of a large batch's total."""
        mu, s = self.mu, self.sigma
        if self.cap is None:
            m0 = math.inf
        else:
            m0 = (math.log(self.cap + 1) - mu) / s
        below = 1.0 - math.exp(log_q(m0)) if m0 != math.inf else 1.0
        e1 = math.exp(min(700.0, mu + s * s / 2)) * norm_cdf(m0 - s)  # E[e^Z; Z < m]
        e2 = math.exp(min(700.0, 2 * mu + 2 * s * s)) * norm_cdf(m0 - 2 * s)  # E[e^2Z; Z < m]
        value = e2 - 2 * e1 + below  # E[(e^Z - 1)^2; Z < m]
        if self.cap is not None:
            value += self.cap**2 * math.exp(log_q(m0))
        return value

    def remaining_tokens(self, unstarted: int, running: Iterable[int]) -> float:
        """Expected output tokens still to come: fresh prompts plus the rest of running ones."""
        total = unstarted * self.mean()
        for at, n, tokens in grid_groups(running, REMAINING_GRID):
            total += max(0.0, n * self.conditional_mean(at) - tokens)
        return total


def grid_groups(tokens: Iterable[int], grid: int) -> list[tuple[int, int, int]]:
    """Token counts grouped on a grid of ln(t + 1) (`grid` steps a unit): (the group's point,
    how many, their sum) for each group. A fleet runs thousands of requests, each at its own
    t; their expectations are taken at the group's point (t within 1/(2 grid) in ln)."""
    ordered = sorted(tokens)
    if ordered and ordered[0] < 0:
        ordered = [max(0, t) for t in ordered]
    sums = [0, *accumulate(ordered)]
    out = []
    i = 0
    while i < len(ordered):
        k = round(math.log(ordered[i] + 1) * grid)
        j = bisect_left(ordered, math.exp((k + 0.5) / grid) - 1, i)
        j = max(j, i + 1)
        out.append((round(math.exp(k / grid) - 1), j - i, sums[j] - sums[i]))
        i = j
    return out


def fit_lengths(data: LengthData) -> LengthModel | None:
    """Censored maximum likelihood for the lognormal; None with no finished completions."""
    cap = data.cap
    hist = {int(b): int(n) for b, n in data.hist.items() if int(n) > 0}
    if not hist:
        return None
    cap_bucket = length_bucket(cap) if cap else None
    if cap_bucket is not None and max(hist) > cap_bucket:
        cap = None  # rows overrode max_tokens upwards: the job's cap is not a cap
        cap_bucket = None
    intervals: list[tuple[float, float, int]] = []
    for b, n in hist.items():
        lo, hi = bucket_log_bounds(b)
        if b == cap_bucket:
            hi = math.inf  # a completion cut at the cap was at least that long
        intervals.append((lo, hi, n))
    cap_z = math.log(cap + 1) if cap else math.inf
    # Running requests as "at least t" observations, on a grid (grid_groups): the likelihood is
    # evaluated some hundred times a fit, and on the grid they are a few hundred terms at most.
    censored = [(math.log(at + 1), n) for at, n, _ in grid_groups(data.running, CENSOR_GRID)
                if at > 0 and math.log(at + 1) < cap_z]

    def nll(mu: float, log_s: float) -> float:
        s = math.exp(log_s)
        total = 0.0
        for lo, hi, n in intervals:
            total += n * log_interval((lo - mu) / s, (hi - mu) / s)
        for c, n in censored:
            total += n * log_q((c - mu) / s)
        return -total if total > -math.inf else 1e300

    # Start from the finished completions alone (biased short; the optimiser fixes that).
    count = sum(n for _, _, n in intervals)
    mids = [((lo + min(hi, lo + LN2 / 4)) / 2, n) for lo, hi, n in intervals]
    m0 = sum(z * n for z, n in mids) / count
    v0 = sum(n * (z - m0) ** 2 for z, n in mids) / count
    start = (m0, math.log(min(max(math.sqrt(v0), 0.3), 3.0)))
    lo_ls, hi_ls = math.log(SIGMA_BOUNDS[0]), math.log(SIGMA_BOUNDS[1])

    def bounded(mu: float, log_s: float) -> float:
        if not lo_ls <= log_s <= hi_ls:
            return 1e300
        return nll(mu, log_s)

    best = _nelder_mead(bounded, start, (0.5, 0.3))
    mu, log_s = best
    return LengthModel(mu=mu, sigma=math.exp(log_s), cap=cap, finished=count)


def _nelder_mead(f, start: tuple[float, float], step: tuple[float, float], *,
                 tol: float = 1e-7, max_iter: int = 400) -> tuple[float, float]:
    """A plain 2-D Nelder-Mead: the likelihood is smooth and cheap, no scipy needed."""
    pts = [start, (start[0] + step[0], start[1]), (start[0], start[1] + step[1])]
    vals = [f(*p) for p in pts]
    for _ in range(max_iter):
        order = sorted(range(3), key=lambda i: vals[i])
        pts = [pts[i] for i in order]
        vals = [vals[i] for i in order]
        if abs(vals[2] - vals[0]) <= tol * (1 + abs(vals[0])) and \
                max(abs(pts[2][0] - pts[0][0]), abs(pts[2][1] - pts[0][1])) < 1e-6:
            break
        cx = (pts[0][0] + pts[1][0]) / 2
        cy = (pts[0][1] + pts[1][1]) / 2
        worst = pts[2]
        refl = (cx + (cx - worst[0]), cy + (cy - worst[1]))
        fr = f(*refl)
        if fr < vals[0]:
            exp_ = (cx + 2 * (cx - worst[0]), cy + 2 * (cy - worst[1]))
            fe = f(*exp_)
            pts[2], vals[2] = (exp_, fe) if fe < fr else (refl, fr)
        elif fr < vals[1]:
            pts[2], vals[2] = refl, fr
        else:
            con = (cx + 0.5 * (worst[0] - cx), cy + 0.5 * (worst[1] - cy))
            fc = f(*con)
            if fc < vals[2]:
                pts[2], vals[2] = con, fc
            else:  # shrink towards the best point
                for i in (1, 2):
                    pts[i] = ((pts[i][0] + pts[0][0]) / 2, (pts[i][1] + pts[0][1]) / 2)
                    vals[i] = f(*pts[i])
    i = min(range(3), key=lambda k: vals[k])
    return pts[i]


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
