"""How long the rest of a job will take, in closed form (pure: no Redis, no clock; docs/monitoring.md):
ETA = (work left - work of the drain) / measured tokens/s + time of the drain, with ln(L + 1) ~ Normal
fitted to the finished lengths (censored in their buckets), the running ones and the cap."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain

from genq.core.records import length_bucket

LN2 = math.log(2.0)
SIGMA_BOUNDS = (0.02, 5.0)  # of log(L + 1); a wider fit is a broken one
CENSOR_GRID = 32  # steps per unit of ln(t + 1) on which running requests are counted in the fit
REMAINING_GRID = 8  # the same for the expected remaining tokens
DRAIN_GRID = 24  # points per unit of ln(r + 1) on which the drain's longest remainder is integrated
MIN_FINISHED = 20  # finished completions before the length fit is worth a number
MIN_RATE_SPAN_S, MIN_RATE_SAMPLES = 3.0, 3  # the throughput window before an ETA
# "steady" rather than "estimating": enough finished, a long enough window, a tight enough speed.
STEADY_FINISHED, STEADY_SPAN_S, STEADY_RATE_REL_SE = 200, 30.0, 0.05
Z90 = 1.645  # the range is a central 90 %
# What one prompt token of a prefill costs a server's step, over what one decoding sequence costs
# it: vLLM on CPU, 0.30 to 0.99, median 0.56, in nine jobs (2026-12-05, docs/vllm.md).
PREFILL_COST = 0.5


def norm_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def log_q(x: float) -> float:
    """log P(N(0,1) >= x); -inf beyond x = 38, where erfc underflows."""
    q = norm_cdf(-x)
    return math.log(q) if q > 0 else -math.inf


def log_interval(lo: float, hi: float) -> float:
    """log P(lo <= N(0,1) < hi), each tail taken from its own side (no 1 - 1 cancellation)."""
    if hi < 0:  # the same interval mirrored
        lo, hi = -hi, -lo
    p = norm_cdf(-lo) - norm_cdf(-hi) if lo > 0 else 1.0 - norm_cdf(-hi) - norm_cdf(lo)
    return math.log(p) if p > 0 else -math.inf


def bucket_log_bounds(bucket: int) -> tuple[float, float]:
    """The bucket's range in z = ln(L + 1) (inverse of length_bucket)."""
    return (bucket - 0.5) / 4 * LN2, (bucket + 0.5) / 4 * LN2


@dataclass(frozen=True)
class LengthData:
    hist: Mapping[int, int]  # length bucket -> finished completions
    running: Sequence[int]  # tokens so far of each running request
    cap: int | None = None  # the job's max_tokens

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
        """The mean's relative standard error by the delta method over the n finished."""
        n = self.finished
        return self.sigma * math.sqrt((1 + self.sigma**2 / 2) / n) if n else 0.0

    def mean(self) -> float:
        return self.conditional_mean(0)

    def conditional_mean(self, tokens_so_far: int) -> float:
        """E[min(L, cap) | L >= tokens_so_far]; E[e^Z | Z >= c] = exp(mu + s^2/2) Q(c0 - s) / Q(c0)."""
        mu, s, cap = self.mu, self.sigma, self.cap
        c0 = -math.inf if tokens_so_far <= 0 else (math.log(tokens_so_far + 1) - mu) / s
        lq_c = log_q(c0)
        if lq_c == -math.inf:  # far beyond anything the fit believes in
            return float(max(tokens_so_far, 1) if cap is None else min(max(tokens_so_far, 1), cap))
        growth = mu + s * s / 2
        above_c = math.exp(min(700.0, growth + log_q(c0 - s) - lq_c))
        if cap is None:
            return above_c - 1.0
        m0 = (math.log(cap + 1) - mu) / s
        if c0 >= m0:
            return float(cap)
        above_m = math.exp(min(700.0, growth + log_q(m0 - s) - lq_c))
        p_m = math.exp(log_q(m0) - lq_c)  # P(L >= cap | L >= t)
        return (above_c - above_m) - (1.0 - p_m) + cap * p_m

    def second_moment(self) -> float:
        """E[min(L, cap)^2] = E[(e^Z - 1)^2; Z < m] + cap^2 P(Z >= m)."""
        mu, s = self.mu, self.sigma
        m0 = math.inf if self.cap is None else (math.log(self.cap + 1) - mu) / s
        capped = math.exp(log_q(m0))  # P(Z >= m), 0 without a cap
        e1 = math.exp(min(700.0, mu + s * s / 2)) * norm_cdf(m0 - s)
        e2 = math.exp(min(700.0, 2 * mu + 2 * s * s)) * norm_cdf(m0 - 2 * s)
        return e2 - 2 * e1 + (1.0 - capped) + (self.cap or 0) ** 2 * capped

    def remaining_tokens(self, unstarted: int, running: Iterable[int]) -> float:
        """Expected output tokens still to come: fresh prompts plus the rest of running ones."""
        return sum((max(0.0, n * self.conditional_mean(at) - tokens)
                    for at, n, tokens in grid_groups(running, REMAINING_GRID)), unstarted * self.mean())

    def survival(self, x: float) -> float:
        """P(min(L, cap) >= x)."""
        if x <= 0:
            return 1.0
        if self.cap is not None and x > self.cap:
            return 0.0
        return math.exp(log_q((math.log(x + 1) - self.mu) / self.sigma))


def grid_groups(tokens: Iterable[int], grid: int) -> list[tuple[int, int, int]]:
    """(point, how many, their sum) of token counts grouped on a grid of ln(t + 1), `grid` steps a unit."""
    ordered = sorted(max(0, t) for t in tokens)
    sums = [0, *accumulate(ordered)]
    out = []
    i = 0
    while i < len(ordered):
        k = round(math.log(ordered[i] + 1) * grid)
        j = max(bisect_left(ordered, math.exp((k + 0.5) / grid) - 1, i), i + 1)
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
        cap = cap_bucket = None  # rows overrode max_tokens upwards: the job's cap is not a cap
    # A completion cut at the cap was at least that long.
    intervals = [(bucket_log_bounds(b)[0], math.inf if b == cap_bucket else bucket_log_bounds(b)[1], n)
                 for b, n in hist.items()]
    cap_z = math.log(cap + 1) if cap else math.inf
    censored = [(math.log(at + 1), n) for at, n, _ in grid_groups(data.running, CENSOR_GRID)
                if at > 0 and math.log(at + 1) < cap_z]
    lo_ls, hi_ls = math.log(SIGMA_BOUNDS[0]), math.log(SIGMA_BOUNDS[1])

    def nll(mu: float, log_s: float) -> float:
        if not lo_ls <= log_s <= hi_ls:
            return 1e300
        s = math.exp(log_s)
        total = sum(chain((n * log_interval((lo - mu) / s, (hi - mu) / s) for lo, hi, n in intervals),
                          (n * log_q((c - mu) / s) for c, n in censored)))
        return -total if total > -math.inf else 1e300

    # Start from the finished completions alone (biased short; the optimiser fixes that).
    count = sum(n for _, _, n in intervals)
    mids = [((lo + min(hi, lo + LN2 / 4)) / 2, n) for lo, hi, n in intervals]
    m0 = sum(z * n for z, n in mids) / count
    v0 = sum(n * (z - m0) ** 2 for z, n in mids) / count
    mu, log_s = _nelder_mead(nll, (m0, math.log(min(max(math.sqrt(v0), 0.3), 3.0))), (0.5, 0.3))
    return LengthModel(mu=mu, sigma=math.exp(log_s), cap=cap, finished=count)


def _nelder_mead(f, start: tuple[float, float], step: tuple[float, float], *,
                 tol: float = 1e-7, max_iter: int = 400) -> tuple[float, float]:
    def towards(a: tuple[float, float], b: tuple[float, float], t: float) -> tuple[float, float]:
        return a[0] + t * (b[0] - a[0]), a[1] + t * (b[1] - a[1])

    pts = [start, (start[0] + step[0], start[1]), (start[0], start[1] + step[1])]
    vals = [f(*p) for p in pts]
    for _ in range(max_iter):
        vals, pts = map(list, zip(*sorted(zip(vals, pts), key=lambda vp: vp[0])))
        if abs(vals[2] - vals[0]) <= tol * (1 + abs(vals[0])) and \
                max(abs(pts[2][0] - pts[0][0]), abs(pts[2][1] - pts[0][1])) < 1e-6:
            break
        c = towards(pts[0], pts[1], 0.5)
        refl = towards(c, pts[2], -1.0)
        fr = f(*refl)
        if fr < vals[0]:
            exp_ = towards(c, pts[2], -2.0)
            fe = f(*exp_)
            pts[2], vals[2] = (exp_, fe) if fe < fr else (refl, fr)
        elif fr < vals[1]:
            pts[2], vals[2] = refl, fr
        elif (fc := f(*(con := towards(c, pts[2], 0.5)))) < vals[2]:
            pts[2], vals[2] = con, fc
        else:  # shrink towards the best point
            pts[1:] = [towards(p, pts[0], 0.5) for p in pts[1:]]
            vals[1:] = [f(*p) for p in pts[1:]]
    return pts[min(range(3), key=lambda k: vals[k])]


@dataclass(frozen=True)
class Speed:
    per_request: float  # output tokens/s of one decoding request (0: tokens_per_s over those running)
    rel_se: float  # relative standard error of the speed
    span_s: float  # length of the window
    samples: int
    tokens_per_s: float = 0.0  # the job's measured output tokens/s
    source: str = ""
    overhead: float | None = None  # a step costs overhead + d for d decoding; None: the same at any d
    decoding: float = 0.0  # per worker, when per_request was measured
    prompt_tokens: float = 0.0  # the job's mean prompt tokens: what a request's start prefills
    running: float = 0.0  # the job's requests decoding over the window, scaled to the slots now (0: unknown)


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
    """The job's remaining time and a 90 % range; unsent: prompts the live workers hold not yet sent."""
    finished = completed + failed
    left = max(0, total - finished)
    # A worker's running list is up to a second old: beyond the prompts left (less the unsent ones)
    # it lists requests that have ended; the longest are kept, the likeliest still to run.
    running = sorted((max(0, int(t)) for t in lengths.running), reverse=True)[:max(0, left - unsent)]
    unstarted = max(0, left - len(running))
    model = fit_lengths(LengthData(lengths.hist, running, lengths.cap)) if lengths.finished >= MIN_FINISHED else None
    result = Estimate(None, None, None, "warming up", model=model)
    if model is not None:
        result.remaining_tokens = model.remaining_tokens(unstarted, running)
        result.expected_output_tokens = model.mean()
    span = 0.0 if speed is None else speed.span_s
    if total > 0 and finished >= total:
        result.eta_s = result.eta_low_s = result.eta_high_s = 0.0
        result.state, result.remaining_tokens = "done", 0.0
    elif paused:
        result.state, result.note = "paused", "paused: no estimate until it resumes"
    elif model is None:
        result.note = f"{lengths.finished} of {MIN_FINISHED} finished completions needed to fit output lengths"
    elif workers <= 0:
        result.state, result.note = "stalled", "no live worker has slots for this job"
    elif speed is None or span < MIN_RATE_SPAN_S or speed.samples < MIN_RATE_SAMPLES:
        result.note = f"throughput window {span:.0f}s of {MIN_RATE_SPAN_S:.0f}s needed"
    else:
        _timed(result, model, lengths.finished, speed, running, unstarted, workers)
    return result


def _timed(result: Estimate, model: LengthModel, finished: int, speed: Speed, running: list[int], unstarted: int,
           workers: int) -> None:
    busy = len(running)
    rate = speed.per_request * (speed.running or busy) if speed.per_request > 0 else speed.tokens_per_s
    per_request = speed.per_request if speed.per_request > 0 else rate / max(busy, 1)
    if rate <= 0 or per_request <= 0:
        result.state, result.note = "stalled", "no tokens generated in the window: is any worker running?"
        return
    work = result.remaining_tokens or 0.0
    # Those that decode at once: as measured, or those in flight when there is no measure (--once).
    at_once = round(speed.running) if speed.running > 0 else busy
    if at_once == 0:  # nothing decoding and no measure of how many do: the work at the measured rate
        bulk_s, drain_work, shift, fresh, steady = work / rate, 0.0, 0.0, 0, False
    elif unstarted < at_once:  # the drain is now: the running ones and the prompts left
        bulk_s, drain_work, shift, fresh, steady = 0.0, work, 0.0, unstarted, False
    else:  # a steady fleet's drain: at_once requests, each with E[L^2] / 2 E[L] left
        drain_work = min(work, at_once * model.second_moment() / (2 * max(model.mean(), 1e-9)))
        bulk_s = (work - drain_work) / rate
        shift, fresh, steady = per_request * bulk_s, at_once, True
    cdf = _longest(model, running, shift, fresh, steady)
    per_worker = speed.decoding if speed.decoding > 0 else max(busy, 1) / workers

    def drain_s(longest: float) -> float:
        if speed.overhead is None:
            return longest / per_request
        o = speed.overhead
        alone = 1.0 + PREFILL_COST * speed.prompt_tokens * per_worker / ((o + per_worker) * model.mean())
        return (o * longest + drain_work / workers) / (per_request * (o + per_worker)) / alone

    rel = math.hypot(speed.rel_se, model.mean_rel_se())
    mean = sum((r1 - r0) * (2 - p0 - p1) / 2 for (r0, p0), (r1, p1) in zip(cdf, cdf[1:]))  # integral of P(M > r)
    result.eta_s = bulk_s + drain_s(mean)
    low = max(0.0, bulk_s * (1 - Z90 * rel)) + drain_s(_quantile(cdf, 0.05)) * max(0.0, 1 - Z90 * speed.rel_se)
    high = bulk_s * (1 + Z90 * rel) + drain_s(_quantile(cdf, 0.95)) * (1 + Z90 * speed.rel_se)
    result.eta_low_s, result.eta_high_s = min(low, result.eta_s), max(high, result.eta_s)
    steady_now = finished >= STEADY_FINISHED and speed.span_s >= STEADY_SPAN_S and speed.rel_se <= STEADY_RATE_REL_SE
    result.state = "steady" if steady_now else "estimating"


def _longest(model: LengthModel, running: Sequence[int], shift: float, fresh: int,
             steady: bool) -> list[tuple[float, float]]:
    """(r, P(the drain's longest remainder <= r)) on a log grid; a fresh request of a steady fleet has a
    renewal process' remainder, P(R > r) = E[(L - r)+] / E[L]."""
    mean = max(model.mean(), 1e-9)
    groups = [(at, n, model.survival(at)) for at, n, _ in grid_groups(running, 8)]
    top = (model.cap if model.cap is not None else math.exp(model.mu + 8 * model.sigma)) + max(running, default=0)
    cdf = []
    for k in range(int(math.log(top + 1) * DRAIN_GRID) + 2):
        r = math.exp(k / DRAIN_GRID) - 1
        log_p = 0.0
        for at, n, alive in groups:
            p = 1.0 - model.survival(at + shift + r) / alive if alive > 0 else 1.0
            log_p += n * math.log(p) if p > 0 else -math.inf
        if fresh:
            beyond = model.survival(r) * max(0.0, model.conditional_mean(round(r)) - r) / mean if steady \
                else model.survival(r)
            log_p += fresh * math.log1p(-beyond) if beyond < 1 else -math.inf
        cdf.append((r, math.exp(log_p)))
        if log_p > -1e-12:
            break
    return cdf


def _quantile(cdf: list[tuple[float, float]], q: float) -> float:
    prev_r, prev_p = 0.0, 0.0
    for r, p in cdf:
        if p >= q:
            return r if p <= prev_p else prev_r + (r - prev_r) * (q - prev_p) / (p - prev_p)
        prev_r, prev_p = r, p
    return cdf[-1][0]
