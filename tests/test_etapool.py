"""The live monitor's ETA within a budget a refresh (monitor/etapool.py, issue #29).

Pure, like tests/test_eta.py: no Redis, no clock. The states are those of a
million-prompt job (bench/eta_cost.py builds the same), where one full estimate
plays a few hundred thousand simulated events.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from genq.monitor.eta import LengthData, LengthModel, Speed, WorkerState, estimate, length_bucket
from genq.monitor.etapool import BUDGET, MIN_DRAWS, REFIT_S, WARM_BUDGET, EtaPool
from genq.monitor.playout import YIELD_EVERY

MEAN, SIGMA, CAP = 512.0, 1.2, 8192
MU = math.log(MEAN) - SIGMA**2 / 2
SPEED = Speed(per_request=30.0, rel_se=0.05, span_s=100.0, samples=100)
# The most one step of work plays past the budget: a stretch of simulated events, or one
# Nelder-Mead iteration of the length fit (two evaluations of a few hundred terms).
STEP = max(YIELD_EVERY, 2000)


def million(done: int, workers: int, batch: int = 64, seed: int = 1) -> dict:
    rng = random.Random(seed)
    sample = [max(1, min(CAP, round(rng.lognormvariate(MU, SIGMA)))) for _ in range(5000)]
    hist = {k: round(v * done / len(sample)) for k, v in Counter(length_bucket(v) for v in sample).items()}
    fleet = [WorkerState(slots=37, leases=2, max_leases=16, reserve=batch,
                         running=tuple(rng.randint(0, 3000) for _ in range(37)), ready=batch, held=3,
                         held_unfinished=(batch // 4, batch // 2, batch)) for _ in range(workers)]
    return dict(total=1_000_000, completed=done, failed=0, lengths=LengthData(hist=hist, running=[], cap=CAP),
                fleet=fleet, batch_size=batch, speed=SPEED)


def fill(pool: EtaPool, inputs: dict, now: float, refreshes: int = 2000):
    """Refresh on unchanging data until the pool has gone once round all its slots: the last
    estimate, and the units each refresh spent, marked warm (True) where it showed no ETA."""
    spent, rounds = [], pool.rounds
    for _ in range(refreshes):
        est = estimate(**inputs, pool=pool, now=now)
        spent.append((pool.spent, est.eta_s is None))
        if pool.rounds > rounds:
            return est, spent
    raise AssertionError(f"the pool did not fill in {refreshes} refreshes")


@pytest.mark.parametrize("done,workers", [(2_000, 8), (500_000, 16), (995_000, 8)])
def test_pooled_eta_is_the_one_shot_eta_on_unchanging_data(done: int, workers: int) -> None:
    inputs = million(done, workers)
    one = estimate(**inputs)
    pool = EtaPool(warm_cpu_s=math.inf)  # the warm-up by units alone: the same on any machine
    est, spent = fill(pool, inputs, now=5_000.0)
    assert one.eta_s is not None and len(one.draws) >= MIN_DRAWS
    assert est.draws == pytest.approx(one.draws, rel=1e-12)
    assert (est.eta_s, est.eta_low_s, est.eta_high_s) == pytest.approx((one.eta_s, one.eta_low_s, one.eta_high_s),
                                                                       rel=1e-12)
    assert est.state == one.state and est.remaining_tokens == one.remaining_tokens
    # The work was spread: many refreshes, none over its budget by more than one step; the
    # warm-up's larger budget only for the few refreshes before the first ETA.
    first = next(i for i, (_, warming) in enumerate(spent) if not warming)  # the refresh that showed it
    warm, after = [units for units, _ in spent[:first + 1]], [units for units, _ in spent[first + 1:]]
    assert len(spent) > 10 and max(after) <= BUDGET + STEP, spent
    assert len(warm) <= 5 and max(warm) <= WARM_BUDGET + STEP, warm
    # Round again: the same draws again (each cycle is the one-shot's random stream).
    again, _ = fill(pool, inputs, now=5_000.0)
    assert again.draws == pytest.approx(one.draws, rel=1e-12)


def test_draws_follow_the_work_left_and_another_fleet_starts_afresh() -> None:
    inputs = million(500_000, 8)
    pool = EtaPool()
    est, _ = fill(pool, inputs, now=100.0)
    later = estimate(**inputs, pool=pool, now=160.0)  # a minute on with nothing done: as long to go as before
    assert later.draws == pytest.approx(est.draws, rel=1e-9)
    joined = dict(inputs, fleet=inputs["fleet"] + [WorkerState(slots=37, leases=2, max_leases=16, reserve=64)])
    fresh = estimate(**joined, pool=pool, now=161.0)
    assert fresh.eta_s is None and fresh.state == "warming up" and "simulated draws" in fresh.note


def test_the_eta_follows_the_work_left_at_once_not_a_cycle_of_draws_later() -> None:
    """#27 on real vLLM (2026-12-05): a length fit 4 % high for one refit kept the live ETA +20 % for
    the 30 s its draws lasted (one cycle through the slots, in a job of 80 s), while a fresh
    estimate from the same inputs read +7 %. Draws made before the work left moved (a refit, or
    work done faster than they played it) are read against the work left now."""
    before, after = million(500_000, 8), million(600_000, 8)
    one_before, one_after = estimate(**before), estimate(**after)
    assert one_after.eta_s < 0.85 * one_before.eta_s  # far enough apart for the test to fail
    pool = EtaPool()
    fill(pool, before, now=100.0)
    est = estimate(**after, pool=pool, now=101.0)  # the first refresh on the new state: draws of the old
    assert est.eta_s == pytest.approx(one_after.eta_s, rel=0.05), (est.eta_s, one_after.eta_s, one_before.eta_s)


def test_remaining_tokens_on_the_grid_match_the_exact_sum() -> None:
    model = LengthModel(mu=MU, sigma=SIGMA, cap=CAP)
    running = [random.Random(i).randint(0, 6000) for i in range(3000)]
    exact = sum(max(0.0, model.conditional_mean(t) - t) for t in running)
    assert model.remaining_tokens(0, running) == pytest.approx(exact, rel=0.01)


def early_job(finished: int, lag: float = 14.0, seed: int = 3) -> dict:
    """A job of 480 prompts (lengths as tests/test_eta_drain.py's sim: mean ~40, cap 96) on one worker
    of 48 slots, at the moment `finished` are done: the first to finish are the short ones."""
    rng = random.Random(seed)
    lengths = [max(1, min(96, round(rng.lognormvariate(math.log(40) - 0.18, 0.6)))) for _ in range(480)]
    ends = sorted((x, i) for i, x in enumerate(lengths[:48]))  # (end time, prompt), one token a unit each
    started, done, now = 48, [], 0.0
    running = {i: 0.0 for i in range(48)}
    while len(done) < finished:
        now, i = ends.pop(0)
        done.append(lengths[i])
        del running[i]
        running[started] = now
        ends.append((now + lengths[started], started))
        ends.sort()
        started += 1
    hist = Counter(length_bucket(x) for x in done)
    fleet = [WorkerState(slots=48, leases=6, max_leases=6, running=tuple(max(0, round(now - t - lag)) for t in running.values()),
                         ready=24, held=4)]
    return dict(total=480, completed=finished, failed=0, lengths=LengthData(hist=dict(hist), running=[], cap=96),
                fleet=fleet, batch_size=24, speed=Speed(per_request=1.0, rel_se=0.03, span_s=60.0, samples=60))


def test_a_fit_of_the_first_completions_gives_way_as_they_grow_not_only_after_refit_s() -> None:
    """The first fit comes from the earliest completions, the short ones (#27: tests/test_eta_drain.py's
    ETA read 22-39 % low at 25 % done: the fit of 20 completions was used until 28 %, REFIT_S later)."""
    first, later = early_job(20), early_job(120)
    one_first, one_later = estimate(**first), estimate(**later)
    assert one_first.eta_s is not None and one_later.eta_s is not None
    assert one_first.model.mean() < 0.8 * one_later.model.mean()  # the early fit is that wrong: the test can fail
    pool, now = EtaPool(), 0.0
    while estimate(**first, pool=pool, now=now).eta_s is None:
        now += 0.25
    start = now
    while now < start + REFIT_S - 1.0:  # well within REFIT_S of the first fit
        now += 0.25
        est = estimate(**later, pool=pool, now=now)
    assert est.eta_s == pytest.approx(one_later.eta_s, rel=0.05), (est.eta_s, one_later.eta_s, one_first.eta_s)


def test_a_fast_job_shows_its_eta_within_a_few_refreshes() -> None:
    """#27 on an H200 (2026-12-04): 8,000 prompts of 128 tokens through one worker of 128 slots
    took 61 s, and the live monitor showed "warming up" at 25, 50 and 75 % done. Each draw
    measured the bulk's steady rate afresh (a new length parameter, a new measured speed
    curve each refresh): about 0.3 draws a refresh at BUDGET, and 20 needed. The same state,
    refreshed once a second with the speed curve moving as it did there."""
    rng = random.Random(7)
    pool, shown = EtaPool(warm_cpu_s=math.inf), None  # units alone (WARM_CPU_S: below)
    for refresh in range(12):
        finished = 2_000 + 130 * refresh
        running = tuple(rng.randint(0, 127) for _ in range(128))
        fleet = [WorkerState(slots=128, leases=2, max_leases=16, reserve=50, running=running,
                             ready=rng.randint(0, 300), held=6, held_unfinished=(10, 50, 50, 50, 50, 50))]
        speed = Speed(per_request=165.0, rel_se=0.01, span_s=60.0, samples=200, tokens_per_s=17_000.0,
                      overhead=65.0 * 0.9**refresh, decoding=97.0 + 10 * rng.random())
        est = estimate(total=8_000, completed=finished, failed=0, fleet=fleet, batch_size=50, speed=speed,
                       lengths=LengthData(hist={length_bucket(128): finished - 3, length_bucket(1): 3}, running=[],
                                          cap=128), pool=pool, now=1_000.0 + refresh)
        if est.eta_s is not None:
            shown = refresh
            break
    assert shown is not None and shown <= 4, (shown, est.state, est.note)


def test_a_warming_refresh_stops_at_its_cpu_allowance() -> None:
    """WARM_CPU_S keeps a refresh near 10 ms at a million prompts (#29) while the pool warms up:
    at no allowance a warming refresh plays what a warm one does, BUDGET and one step."""
    inputs = million(2_000, 8)
    pool = EtaPool(warm_cpu_s=0.0)
    for i in range(12):
        est = estimate(**inputs, pool=pool, now=100.0 + i)
        assert pool.spent <= BUDGET + STEP and est.eta_s is None, (i, pool.spent)


def test_draws_made_stale_mid_refresh_stop_at_the_allowance_too() -> None:
    """The pool can start warming in the middle of a refresh (another fleet empties it, a refit
    moves the mean): that refresh's draws stop at the allowance as well (bench/eta_cost.py
    showed 30-33 ms refreshes at each new generation before they did)."""
    inputs = million(500_000, 8)
    pool = EtaPool(warm_cpu_s=0.0)
    fill(pool, inputs, now=100.0)
    joined = dict(inputs, fleet=inputs["fleet"] + [WorkerState(slots=37, leases=2, max_leases=16, reserve=64)])
    estimate(**joined, pool=pool, now=101.0)
    assert pool.spent <= BUDGET + STEP, pool.spent
