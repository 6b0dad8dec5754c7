"""Output lengths: a lognormal fitted to censored observations (pure; no Redis, no clock).

What is known of a job's output lengths: the finished ones, binned in its log-spaced histogram
(genq.core.records.length_bucket: interval-censored); the running ones, at least as long as their
tokens so far (right-censored); and max_tokens, which cuts every one. fit_lengths() fits
ln(L + 1) ~ Normal(mu, sigma) by maximum likelihood over all three, so the long completions that
have started pull the estimate up as they should (the finished ones alone are the short ones).
LengthModel gives the expectations, cut at the cap, and given "at least t tokens so far".
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
